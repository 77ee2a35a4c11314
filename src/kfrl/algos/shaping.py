"""Token-level rewards (veRL's reward manager and ``apply_kl_penalty``), the critic's explained
variance, and DAPO's group filter: the math of the ``advantage`` and ``rollout`` stages."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kfrl.algos.core import kl_penalty, masked_mean


def outcome_rewards(scores: Sequence[float], response_lengths: Sequence[int], width: int) -> torch.Tensor:
    """(bs, width) zeros with each score at its last valid response token (veRL's reward manager)."""
    rewards = torch.zeros((len(scores), width), dtype=torch.float32)
    rows = torch.arange(len(scores))
    last = torch.clamp(torch.as_tensor(response_lengths) - 1, min=0)
    rewards[rows, last] = torch.as_tensor(scores, dtype=torch.float32)
    return rewards


def kl_in_reward(token_level_scores: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                 mask: torch.Tensor, controller, kind: str) -> tuple[torch.Tensor, dict[str, float]]:
    """veRL's ``apply_kl_penalty``: rewards = scores - beta * KL(old || ref) per token; then the
    controller sees the batch's mean per-sequence KL (and updates beta). Returns (rewards, metrics)."""
    kld = kl_penalty(old_logprobs, ref_logprobs, kind) * mask
    beta = controller.value
    rewards = token_level_scores - beta * kld
    current_kl = float(masked_mean(kld, mask, axis=-1).mean())
    controller.update(current_kl, n_steps=token_level_scores.shape[0])
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": float(beta)}


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> float | None:
    """veRL's critic/vf_explained_var: 1 - Var(R - V) / (Var(R) + 1e-5) over valid tokens (unbiased);
    None with fewer than two valid tokens."""
    valid = mask.bool()
    r, v = returns[valid], values[valid]
    if r.numel() < 2:
        return None
    return float(1.0 - torch.var(r - v) / (torch.var(r) + 1e-5))


def masked_stats(values: torch.Tensor, mask: torch.Tensor, prefix: str) -> dict[str, float]:
    """``{prefix}/mean``, ``/max``, ``/min`` over the valid tokens (empty when there are none)."""
    picked = values[mask.bool()]
    if picked.numel() == 0:
        return {}
    return {f"{prefix}/mean": float(picked.mean()), f"{prefix}/max": float(picked.max()),
            f"{prefix}/min": float(picked.min())}


def kept_groups(values: np.ndarray, n: int) -> list[int]:
    """DAPO's dynamic-sampling filter: indices of the prompt groups (n consecutive trajectories
    each, in order) whose values have non-zero population std; every group when n == 1."""
    groups = np.asarray(values, dtype=np.float64).reshape(-1, n)
    return [g for g in range(groups.shape[0]) if n == 1 or np.std(groups[g]) > 0]
