"""Next-token sampling for the rollout backends: temperature, top-k, top-p, greedy, and the log-prob
of the chosen token.

``sample_tokens`` is written for CUDA-graph capture: no host synchronisation, no data-dependent
shapes, randomness from the default generator (a captured graph draws fresh numbers on every replay,
and the same seed replays the same numbers).

The returned log-prob is that of the temperature-scaled distribution, ``log_softmax(logits / T)``,
before top-k/top-p truncation: the quantity the old-logprob stage recomputes and veRL's actor uses,
so rollout and recomputed log-probs are comparable token by token. Greedy decoding reports
``log_softmax(logits)`` (temperature 1), as the HF backend does.
"""
from __future__ import annotations

import torch


def _gumbel_argmax(scores: torch.Tensor) -> torch.Tensor:
    """Index of a sample from softmax(scores) per row (the Gumbel-max trick: argmax(s - log E), E ~ Exp(1))."""
    noise = torch.empty_like(scores).exponential_()
    return (scores - noise.log_()).argmax(dim=-1)


def _nucleus(sorted_scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Sorted scores (descending) with everything after the smallest prefix of mass >= top_p set to -inf."""
    probs = sorted_scores.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    return sorted_scores.masked_fill(mass_before >= top_p, float("-inf"))


def sample_tokens(logits: torch.Tensor, *, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
                  greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B,) int64, logprobs (B,) float32) for logits (B, V) of any float dtype."""
    scores = logits.float()
    if greedy:
        tokens = scores.argmax(dim=-1)
        logprobs = scores.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - scores.logsumexp(dim=-1)
        return tokens, logprobs
    if temperature != 1.0:
        scores = scores / temperature
    log_norm = scores.logsumexp(dim=-1)
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        top_scores, top_ids = scores.topk(top_k, dim=-1)  # sorted, descending
        if top_p < 1.0:
            top_scores = _nucleus(top_scores, top_p)
        tokens = top_ids.gather(-1, _gumbel_argmax(top_scores).unsqueeze(-1)).squeeze(-1)
    elif top_p < 1.0:
        sorted_scores, sorted_ids = scores.sort(dim=-1, descending=True)
        choice = _gumbel_argmax(_nucleus(sorted_scores, top_p))
        tokens = sorted_ids.gather(-1, choice.unsqueeze(-1)).squeeze(-1)
    else:
        tokens = _gumbel_argmax(scores)
    logprobs = scores.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - log_norm
    return tokens, logprobs


def filtered_distribution(logits: torch.Tensor, *, temperature: float = 1.0, top_k: int = -1,
                          top_p: float = 1.0) -> torch.Tensor:
    """The distribution ``sample_tokens`` draws from, as probabilities (B, V): the reference that
    sampling tests compare empirical frequencies against."""
    scores = logits.double() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, sorted_ids = scores.sort(dim=-1, descending=True)
        kept = _nucleus(sorted_scores, top_p)
        scores = torch.full_like(scores, float("-inf")).scatter(-1, sorted_ids, kept)
    return scores.softmax(dim=-1)
