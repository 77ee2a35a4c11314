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


# Positions whose logits are computed at once: the fp32 logits of one chunk (elements = positions x
# vocabulary) are the largest tensor of the pass, about 1 GiB, whatever the batch. In training each
# chunk's logits are recomputed in the backward pass instead of being kept.
LOGIT_CHUNK_ELEMENTS = 2**28


def response_hidden(model, batch: Trajectories) -> torch.Tensor:
    """Final hidden states (B, L, H) at the positions that predict each response token."""
    decoder = model.get_decoder()
    hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    index = batch.gather_positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    return torch.gather(hidden, 1, index)


def response_logits(model, batch: Trajectories) -> torch.Tensor:
    """Logits (B, L, V) that predict each response token."""
    return model.get_output_embeddings()(response_hidden(model, batch))


def _token_stats(hidden, targets, head, temperature: float, with_entropy: bool, autocast_dtype):
    """Log-probs of ``targets`` and entropies (or None) for a (N, H) chunk of hidden states."""
    from kfrl.algos import entropy_from_logits

    with autocast(hidden.device.type, autocast_dtype):
        logits = head(hidden)
    logits = logits.float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return log_probs, (entropy_from_logits(logits) if with_entropy else None)


def forward_response(model, batch: Trajectories, temperature: float, with_entropy: bool,
                     autocast_dtype: torch.dtype | None = None):
    """(log_probs (B, L), entropy (B, L) or None); differentiable when grad is enabled. The LM head,
    softmax and entropy run over chunks of positions (``LOGIT_CHUNK_ELEMENTS``), so the full
    (B, L, V) fp32 logits never exist."""
    from torch.utils.checkpoint import checkpoint

    with autocast(batch.input_ids.device.type, autocast_dtype):
        hidden = response_hidden(model, batch)
    head = model.get_output_embeddings()
    rows, length, width = hidden.shape
    flat, targets = hidden.reshape(rows * length, width), batch.response_ids.reshape(-1)
    chunk = max(1, LOGIT_CHUNK_ELEMENTS // head.weight.shape[0])
    recompute = torch.is_grad_enabled() and len(flat) > chunk
    parts = []
    for start in range(0, len(flat), chunk):
        args = (flat[start:start + chunk], targets[start:start + chunk], head, temperature, with_entropy,
                autocast_dtype)
        parts.append(checkpoint(_token_stats, *args, use_reentrant=False) if recompute else _token_stats(*args))
    log_probs = torch.cat([lp for lp, _ in parts]).view(rows, length)
    entropy = torch.cat([ent for _, ent in parts]).view(rows, length) if with_entropy else None
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
