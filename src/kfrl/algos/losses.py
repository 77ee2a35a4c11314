"""Policy-gradient losses and the clipped value loss, with veRL v0.7.1's numbers and metrics.

`policy_loss(mode, old_log_prob, log_prob, advantages, response_mask, ...)` returns
`(loss, metrics)`: a scalar tensor to backpropagate and a dict of python floats named as veRL
logs them ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower").
All tensors are (bs, L) over response tokens; `log_prob` carries the gradient.
"""
from __future__ import annotations

import torch

from kfrl.algos.core import AGG_MODES, agg_loss, masked_mean, masked_sum, resolve_choice

POLICY_LOSS_MODES: tuple[str, ...] = ("vanilla", "gspo", "gpg", "cispo")

# log(pi/pi_old) is clamped to +-20 before exp() so one wild token cannot overflow the ratio.
LOG_RATIO_CLAMP = 20.0
# GSPO clamps the (sequence) log-ratio from above only, at 10.
GSPO_LOG_RATIO_MAX = 10.0


def _clipped_log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    return torch.clamp(log_prob - old_log_prob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)


def _metrics(pg_clipfrac: torch.Tensor | float, ppo_kl: torch.Tensor, pg_clipfrac_lower: torch.Tensor | float):
    return {
        "actor/pg_clipfrac": float(pg_clipfrac),
        "actor/ppo_kl": float(ppo_kl),
        "actor/pg_clipfrac_lower": float(pg_clipfrac_lower),
    }


def vanilla_policy_loss(
    old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, clip_ratio_low, clip_ratio_high,
    clip_ratio_c, agg_kwargs, rollout_is_weights=None,
):
    """PPO clipped surrogate (Schulman et al. 2017) with dual-clip (Ye et al. 2019, arXiv:1912.09729).

    ratio = pi / pi_old. Per token:
      PPO:        L = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))
      dual-clip:  for A < 0 only, L = min(L, -A * c): bounds the loss when the ratio explodes on
                  a token the policy should un-learn.
    eps_low != eps_high is DAPO's "clip-higher" (e.g. 0.2 / 0.28).
    """
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip lower bound of the ratio) must be > 1.0, got {clip_ratio_c}")
    log_ratio = _clipped_log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    # Mean of log(pi_old / pi): the sampled-token estimate of KL(pi_old || pi).
    approx_kl = masked_mean(-log_ratio, response_mask)

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual_clip_bound = -advantages * clip_ratio_c
    loss_dual_clipped = torch.minimum(loss_dual_clip_bound, loss_ppo)
    per_token_loss = torch.where(advantages < 0, loss_dual_clipped, loss_ppo)
    if rollout_is_weights is not None:
        per_token_loss = per_token_loss * rollout_is_weights

    loss = agg_loss(per_token_loss, response_mask, loss_agg_mode, **agg_kwargs)

    with torch.no_grad():
        # Fraction of tokens where the clip is active (the clipped branch is the larger loss).
        clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask)
        # Fraction of tokens where the dual clip is active (negative advantage, huge ratio).
        clipfrac_lower = masked_mean(((loss_ppo > loss_dual_clip_bound) & (advantages < 0)).float(), response_mask)
    return loss, _metrics(clipfrac, approx_kl.detach(), clipfrac_lower)


def gspo_policy_loss(
    old_log_prob, log_prob, advantages, response_mask, *, clip_ratio_low, clip_ratio_high, agg_kwargs,
    rollout_is_weights=None,
):
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): clip a *sequence*-level ratio.

    s_i = exp(mean_t log(pi/pi_old)) over the valid tokens of response i (no +-20 clamp).
    Per token the ratio is exp(log pi - sg(log pi) + sg(log s_i)): its value is s_i, its
    gradient flows through each token's log pi. Loss = max(-A*s, -A*clip(s, 1-eps_low, 1+eps_high)),
    always aggregated with "seq-mean-token-mean" whatever loss_agg_mode says (as veRL does).
    """
    log_ratio = log_prob - old_log_prob
    valid_tokens = response_mask.sum(dim=-1).clamp(min=1)
    sequence_log_ratio = masked_sum(log_ratio, response_mask, axis=-1) / valid_tokens
    token_log_ratio = log_prob - log_prob.detach() + sequence_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=GSPO_LOG_RATIO_MAX))

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    per_token_loss = torch.maximum(loss_unclipped, loss_clipped)
    if rollout_is_weights is not None:
        per_token_loss = per_token_loss * rollout_is_weights

    loss = agg_loss(per_token_loss, response_mask, "seq-mean-token-mean", **agg_kwargs)

    with torch.no_grad():
        clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask)
        approx_kl = masked_mean(-log_ratio, response_mask)
    return loss, _metrics(clipfrac, approx_kl, 0.0)


def gpg_policy_loss(log_prob, advantages, response_mask, *, loss_agg_mode, agg_kwargs, rollout_is_weights=None):
    """GPG (Chu et al. 2025): plain policy gradient, L = -A * log pi. No ratio, no clip, and (as
    in veRL) no metrics."""
    per_token_loss = -log_prob * advantages
    if rollout_is_weights is not None:
        per_token_loss = per_token_loss * rollout_is_weights
    return agg_loss(per_token_loss, response_mask, loss_agg_mode, **agg_kwargs), {}


def cispo_policy_loss(
    old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, clip_ratio_low, clip_ratio_high,
    agg_kwargs, rollout_is_weights=None,
):
    """CISPO (MiniMax-M1, arXiv:2506.13585): clip the importance weight, not the update.

    L = -sg(clip(ratio, 1-eps_low, 1+eps_high)) * A * log pi: every token keeps a gradient
    (unlike PPO, which zeroes clipped tokens), only its weight is bounded.
    """
    log_ratio = _clipped_log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    per_token_loss = -clipped_ratio.detach() * advantages * log_prob
    if rollout_is_weights is not None:
        per_token_loss = per_token_loss * rollout_is_weights

    loss = agg_loss(per_token_loss, response_mask, loss_agg_mode, **agg_kwargs)

    with torch.no_grad():
        clipfrac = masked_mean((ratio != clipped_ratio).float(), response_mask)
        approx_kl = masked_mean(-log_ratio, response_mask)
    return loss, _metrics(clipfrac, approx_kl, 0.0)


def policy_loss(
    mode: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    global_batch_size: int | float | torch.Tensor | None = None,
    batch_num_tokens: int | float | torch.Tensor | None = None,
    loss_scale_factor: int | float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy loss of the given mode (one of POLICY_LOSS_MODES) and its metrics.

    - "vanilla": PPO clip + dual-clip (clip_ratio_c); clip_ratio_low/high (default clip_ratio)
      give DAPO's asymmetric clip-higher.
    - "gspo": sequence-level ratio; always "seq-mean-token-mean".
    - "gpg": -A * log pi; metrics {}.
    - "cispo": stop-gradient clipped importance weight times -A * log pi.
    `global_batch_size` / `batch_num_tokens` / `loss_scale_factor` go to `agg_loss`;
    `rollout_is_weights` (optional, (bs, L)) multiplies the per-token loss, as in veRL.
    """
    mode = resolve_choice(mode, POLICY_LOSS_MODES, "policy loss mode")
    # Validate the aggregation mode up front, also for gspo which then ignores it: a typo in a
    # config should fail, not pass silently.
    resolve_choice(loss_agg_mode, AGG_MODES, "loss aggregation mode")
    clip_ratio_low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    clip_ratio_high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    agg_kwargs = dict(global_batch_size=global_batch_size, batch_num_tokens=batch_num_tokens,
                      loss_scale_factor=loss_scale_factor)

    if mode == "vanilla":
        return vanilla_policy_loss(
            old_log_prob, log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode,
            clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c,
            agg_kwargs=agg_kwargs, rollout_is_weights=rollout_is_weights)
    if mode == "gspo":
        return gspo_policy_loss(
            old_log_prob, log_prob, advantages, response_mask, clip_ratio_low=clip_ratio_low,
            clip_ratio_high=clip_ratio_high, agg_kwargs=agg_kwargs, rollout_is_weights=rollout_is_weights)
    if mode == "gpg":
        return gpg_policy_loss(log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode,
                               agg_kwargs=agg_kwargs, rollout_is_weights=rollout_is_weights)
    assert mode == "cispo", mode
    return cispo_policy_loss(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode,
        clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, agg_kwargs=agg_kwargs,
        rollout_is_weights=rollout_is_weights)


def actor_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_mode: str = "vanilla",
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    entropy: torch.Tensor | None = None,
    entropy_coeff: float = 0.0,
    ref_log_prob: torch.Tensor | None = None,
    kl_loss_type: str = "low_var_kl",
    kl_loss_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """veRL's actor objective on one micro-batch: the policy loss, minus ``entropy_coeff`` x the
    aggregated entropy, plus ``kl_loss_coef`` x the aggregated KL to the reference policy (when
    ``ref_log_prob`` is given). All tensors (bs, L). Returns (loss, stats): ``actor/pg_loss``, the
    policy loss's metrics, ``actor/kl_loss`` and ``actor/kl_coef`` (with a reference) and
    ``actor/entropy`` (token-mean, when ``entropy`` is given)."""
    from kfrl.algos.core import kl_penalty

    pg_loss, stats = policy_loss(loss_mode, old_log_prob, log_prob, advantages, response_mask,
                                 loss_agg_mode=loss_agg_mode, clip_ratio=clip_ratio, clip_ratio_low=clip_ratio_low,
                                 clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c)
    stats = {"actor/pg_loss": float(pg_loss.detach()), **stats}
    loss = pg_loss
    if entropy_coeff != 0:
        if entropy is None:
            raise ValueError("entropy_coeff != 0 needs the per-token entropy")
        loss = loss - entropy_coeff * agg_loss(entropy, response_mask, loss_agg_mode)
    if ref_log_prob is not None:
        kl_loss = agg_loss(kl_penalty(log_prob, ref_log_prob, kl_loss_type), response_mask, loss_agg_mode)
        loss = loss + kl_loss_coef * kl_loss
        stats["actor/kl_loss"] = float(kl_loss.detach())
        stats["actor/kl_coef"] = float(kl_loss_coef)
    if entropy is not None:
        stats["actor/entropy"] = float(agg_loss(entropy.detach(), response_mask, "token-mean"))
    return loss, stats


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    global_batch_size: int | float | torch.Tensor | None = None,
    batch_num_tokens: int | float | torch.Tensor | None = None,
    loss_scale_factor: int | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss: 0.5 * agg(max((V - R)^2, (V_clip - R)^2)), where V_clip keeps the
    new prediction within +-cliprange_value of the rollout-time value.

    Returns (vf_loss, vf_clipfrac): vf_clipfrac (a 0-d tensor, as in veRL) is the fraction of
    valid tokens where the clipped error is the larger one.
    """
    vpreds_clipped = torch.maximum(torch.minimum(vpreds, values + cliprange_value), values - cliprange_value)
    error_unclipped = (vpreds - returns) ** 2
    error_clipped = (vpreds_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(
        torch.maximum(error_unclipped, error_clipped), response_mask, loss_agg_mode,
        global_batch_size=global_batch_size, batch_num_tokens=batch_num_tokens, loss_scale_factor=loss_scale_factor)
    with torch.no_grad():
        vf_clipfrac = masked_mean((error_clipped > error_unclipped).float(), response_mask)
    return vf_loss, vf_clipfrac
