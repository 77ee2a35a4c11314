"""Log-probs and entropy of response tokens under a causal LM (old/ref log-prob, and the update's forward).

Sequences are prompt + response, right-padded. The LM head is applied only at the positions that
predict response tokens, so (batch, response_length, vocab) is the largest tensor, never
(batch, prompt + response, vocab): with a 150k vocabulary that is the difference between fitting
and not.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kfrl.engines import autocast


@dataclass
class PaddedBatch:
    input_ids: torch.Tensor        # (B, T) prompt + response, right-padded
    attention_mask: torch.Tensor   # (B, T)
    gather_positions: torch.Tensor  # (B, L) position whose logits predict response token t
    response_ids: torch.Tensor     # (B, L) right-padded with 0
    response_mask: torch.Tensor    # (B, L) float 0/1 (the rollout's mask, zero on padding)

    @classmethod
    def build(cls, prompts: list[list[int]], responses: list[list[int]], response_masks: list[list[int]] | None,
              pad_id: int, device) -> "PaddedBatch":
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        width = max(lengths)
        resp_width = max(1, max(len(r) for r in responses))
        bsz = len(prompts)
        input_ids = torch.full((bsz, width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((bsz, width), dtype=torch.long)
        response_ids = torch.zeros((bsz, resp_width), dtype=torch.long)
        response_mask = torch.zeros((bsz, resp_width), dtype=torch.float32)
        gather_positions = torch.zeros((bsz, resp_width), dtype=torch.long)
        for row, (prompt, response) in enumerate(zip(prompts, responses)):
            seq = list(prompt) + list(response)
            input_ids[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
            attention_mask[row, :len(seq)] = 1
            n = len(response)
            if n:
                response_ids[row, :n] = torch.tensor(response, dtype=torch.long)
                mask = response_masks[row] if response_masks is not None else [1] * n
                response_mask[row, :n] = torch.tensor(mask, dtype=torch.float32)
            # Token t of the response sits at len(prompt)+t and is predicted by the position before it;
            # padding positions point at the last real position (their values are masked out).
            pos = torch.arange(resp_width) + len(prompt) - 1
            gather_positions[row] = torch.clamp(pos, max=len(seq) - 1)
        return cls(*(t.to(device) for t in (input_ids, attention_mask, gather_positions, response_ids, response_mask)))

    def select(self, rows) -> "PaddedBatch":
        return PaddedBatch(self.input_ids[rows], self.attention_mask[rows], self.gather_positions[rows],
                           self.response_ids[rows], self.response_mask[rows])


def response_logits(model, batch: PaddedBatch) -> torch.Tensor:
    """Logits (B, L, V) that predict each response token."""
    decoder = model.get_decoder()
    hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    index = batch.gather_positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    picked = torch.gather(hidden, 1, index)
    return model.get_output_embeddings()(picked)


def forward_response(model, batch: PaddedBatch, temperature: float, with_entropy: bool,
                     autocast_dtype: torch.dtype | None = None):
    """(log_probs (B, L), entropy (B, L) or None); differentiable when grad is enabled."""
    from kfrl.algos import entropy_from_logits

    with autocast(batch.input_ids.device.type, autocast_dtype):
        logits = response_logits(model, batch)
    logits = logits.float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    entropy = entropy_from_logits(logits) if with_entropy else None
    return log_probs, entropy


@torch.no_grad()
def compute_logprobs(model, prompts, responses, response_masks, *, pad_id: int, temperature: float,
                     micro_batch_size: int, with_entropy: bool, autocast_dtype=None):
    """Per-sample lists of response-token log-probs (and entropies), micro-batched."""
    device = next(model.parameters()).device
    logprobs_out: list[list[float]] = []
    entropy_out: list[list[float]] = []
    for start in range(0, len(prompts), micro_batch_size):
        stop = start + micro_batch_size
        batch = PaddedBatch.build(prompts[start:stop], responses[start:stop], response_masks[start:stop], pad_id, device)
        log_probs, entropy = forward_response(model, batch, temperature, with_entropy, autocast_dtype)
        for row, response in enumerate(responses[start:stop]):
            n = len(response)
            logprobs_out.append(log_probs[row, :n].tolist())
            if with_entropy:
                entropy_out.append(entropy[row, :n].tolist())
    return logprobs_out, (entropy_out if with_entropy else None)
