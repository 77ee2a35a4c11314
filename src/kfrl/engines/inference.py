"""Log-probs and entropy of response tokens under a causal LM (old/ref log-prob, and the update's forward).

Sequences are prompt + response, right-padded. The LM head is applied only at the positions that
predict response tokens, so (batch, response_length, vocab) is the largest tensor, never
(batch, prompt + response, vocab): with a 150k vocabulary that is the difference between fitting
and not.
"""
from __future__ import annotations

import torch

from kfrl.engines import autocast
from kfrl.trajectory import Trajectories


def response_logits(model, batch: Trajectories) -> torch.Tensor:
    """Logits (B, L, V) that predict each response token."""
    decoder = model.get_decoder()
    hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    index = batch.gather_positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    picked = torch.gather(hidden, 1, index)
    return model.get_output_embeddings()(picked)


def forward_response(model, batch: Trajectories, temperature: float, with_entropy: bool,
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
def compute_logprobs(model, trajectories: Trajectories, *, temperature: float, micro_batch_size: int,
                     with_entropy: bool, autocast_dtype=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, L) of the response tokens (and entropies, or None), micro-batched; positions past
    a response's length hold no meaning (``Trajectories.unpad`` drops them)."""
    device = next(model.parameters()).device
    trajectories = trajectories.to(device)
    logprobs, entropies = [], []
    for start in range(0, len(trajectories), micro_batch_size):
        batch = trajectories.select(slice(start, start + micro_batch_size))
        log_probs, entropy = forward_response(model, batch, temperature, with_entropy, autocast_dtype)
        logprobs.append(log_probs)
        if with_entropy:
            entropies.append(entropy)
    return torch.cat(logprobs), (torch.cat(entropies) if with_entropy else None)
