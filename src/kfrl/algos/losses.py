"""Policy-gradient losses and the clipped value loss, with veRL's numbers and metrics.

Modes follow veRL 0.9.1's ``core_algos`` registry (one process: no data-parallel global-batch
normalisation). `policy_loss(mode, old_log_prob, log_prob, advantages, response_mask, ...)`
returns `(loss, metrics)`: a scalar tensor to backpropagate and a dict of detached 0-d tensors named
as veRL logs them ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"). They stay on the
loss's device: reading one (``float()``) waits for the GPU, so the update loop reads them all once, at
its end (``kfrl.engines.minibatch``), instead of stalling every micro-batch before its backward pass.
All tensors are (bs, L) over response tokens; `log_prob` carries the gradient.

Each mode is a function registered with `@register_policy_loss(name)`; all share the signature
``fn(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, params, rollout_is_weights)``
where `params` (a `PolicyLossParams`) carries the clip ranges, the per-mode knobs (veRL's names and
defaults), the `agg_loss` overrides and the random generator of `clip_cov`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from kfrl.algos.core import AGG_MODES, agg_loss, masked_mean, masked_sum, resolve_choice

# log(pi/pi_old) is clamped to +-20 before exp() so one wild token cannot overflow the ratio.
LOG_RATIO_CLAMP = 20.0
# GSPO clamps the (sequence) log-ratio from above only, at 10.
GSPO_LOG_RATIO_MAX = 10.0
# DPPO-Binary-KL: epsilon inside log((1 - p_old) / (1 - p)) so p -> 1 stays finite.
DPPO_KL_EPS = 1e-8
# GMPO (geo_mean): epsilons of the per-sequence means and of the geometric mean of IS weights.
GEO_MEAN_EPS = 1e-8
GEO_MEAN_IS_WEIGHT_EPS = 1e-10

# veRL 0.9.1's defaults for the policy-loss knobs (ActorConfig.tau_pos/tau_neg and
# ActorConfig.policy_loss.*).
DEFAULT_TAU_POS = 1.0
DEFAULT_TAU_NEG = 1.05
DEFAULT_CLIP_COV_RATIO = 0.0002
DEFAULT_CLIP_COV_LB = 1.0
DEFAULT_CLIP_COV_UB = 5.0
DEFAULT_KL_COV_RATIO = 0.0002
DEFAULT_PPO_KL_COEF = 0.1


@dataclass(frozen=True)
class PolicyLossParams:
    """Everything a registered policy loss may read besides the tensors."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    tau_pos: float = DEFAULT_TAU_POS
    tau_neg: float = DEFAULT_TAU_NEG
    clip_cov_ratio: float = DEFAULT_CLIP_COV_RATIO
    clip_cov_lb: float = DEFAULT_CLIP_COV_LB
    clip_cov_ub: float = DEFAULT_CLIP_COV_UB
    kl_cov_ratio: float = DEFAULT_KL_COV_RATIO
    ppo_kl_coef: float = DEFAULT_PPO_KL_COEF
    dro_beta: Optional[float] = None
    global_batch_size: int | float | torch.Tensor | None = None
    batch_num_tokens: int | float | torch.Tensor | None = None
    loss_scale_factor: int | float | None = None
    # clip_cov's random pick among candidate tokens; None = torch's global generator (as veRL).
    generator: Optional[torch.Generator] = None

    @property
    def agg_kwargs(self) -> dict:
        return dict(global_batch_size=self.global_batch_size, batch_num_tokens=self.batch_num_tokens,
                    loss_scale_factor=self.loss_scale_factor)


PolicyLossFn = Callable[..., "tuple[torch.Tensor, dict[str, torch.Tensor | float]]"]
POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: make `fn` reachable as ``policy_loss(name, ...)``."""

    def decorate(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSS_REGISTRY and POLICY_LOSS_REGISTRY[name] is not fn:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSS_REGISTRY[name] = fn
        return fn

    return decorate


def get_policy_loss_fn(mode: str) -> PolicyLossFn:
    """The registered function of `mode`; an unknown mode names the nearest valid one."""
    return POLICY_LOSS_REGISTRY[resolve_choice(mode, tuple(POLICY_LOSS_REGISTRY), "policy loss mode")]


def _clipped_log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    return torch.clamp(log_prob - old_log_prob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)


def _metrics(pg_clipfrac: torch.Tensor | float, ppo_kl: torch.Tensor, pg_clipfrac_lower: torch.Tensor | float):
    return {
        "actor/pg_clipfrac": _stat(pg_clipfrac),
        "actor/ppo_kl": _stat(ppo_kl),
        "actor/pg_clipfrac_lower": _stat(pg_clipfrac_lower),
    }


def _stat(value: torch.Tensor | float) -> torch.Tensor | float:
    """A metric as the losses return it: a detached tensor (read later, all at once) or a python number."""
    return value.detach() if isinstance(value, torch.Tensor) else float(value)


def _weighted(per_token_loss: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    return per_token_loss if rollout_is_weights is None else per_token_loss * rollout_is_weights


@register_policy_loss("vanilla")
def vanilla_policy_loss(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, params,
                        rollout_is_weights=None):
    """PPO clipped surrogate (Schulman et al. 2017) with dual-clip (Ye et al. 2019, arXiv:1912.09729).

    ratio = pi / pi_old. Per token:
      PPO:        L = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))
      dual-clip:  for A < 0 only, L = min(L, -A * c): bounds the loss when the ratio explodes on
                  a token the policy should un-learn.
    eps_low != eps_high is DAPO's "clip-higher" (e.g. 0.2 / 0.28).
    """
    clip_ratio_c = params.clip_ratio_c
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip lower bound of the ratio) must be > 1.0, got {clip_ratio_c}")
    log_ratio = _clipped_log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    # Mean of log(pi_old / pi): the sampled-token estimate of KL(pi_old || pi).
    approx_kl = masked_mean(-log_ratio, response_mask)

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - params.clip_ratio_low, 1 + params.clip_ratio_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual_clip_bound = -advantages * clip_ratio_c
    loss_dual_clipped = torch.minimum(loss_dual_clip_bound, loss_ppo)
    per_token_loss = _weighted(torch.where(advantages < 0, loss_dual_clipped, loss_ppo), rollout_is_weights)

    loss = agg_loss(per_token_loss, response_mask, loss_agg_mode, **params.agg_kwargs)

    with torch.no_grad():
        # Fraction of tokens where the clip is active (the clipped branch is the larger loss).
        clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask)
        # Fraction of tokens where the dual clip is active (negative advantage, huge ratio).
        clipfrac_lower = masked_mean(((loss_ppo > loss_dual_clip_bound) & (advantages < 0)).float(), response_mask)
    return loss, _metrics(clipfrac, approx_kl.detach(), clipfrac_lower)


def _dppo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, params, rollout_is_weights,
               trust_region: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]):
    """Shared body of DPPO-Binary-TV / -KL (arXiv:2602.04879): a policy gradient
    -A * sg(min(ratio, c)) * log pi on the tokens inside a divergence trust region, 0 outside.

    `trust_region(prob, old_prob)` gives the (positive-advantage, other) masks of tokens kept.
    clip_ratio_low/high are the divergence thresholds here, not ratio ranges; clip_ratio_c caps the
    (truncated) importance ratio instead of a dual clip.
    """
    log_ratio = _clipped_log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    approx_kl = masked_mean(-log_ratio, response_mask)
    truncated_ratio = torch.clamp(ratio, max=params.clip_ratio_c).detach()
    with torch.no_grad():
        keep_positive, keep_other = trust_region(torch.exp(log_prob), torch.exp(old_log_prob))
        # A > 0 uses the upper threshold; A <= 0 (zero included, as in veRL) the lower one.
        inside = torch.where(advantages > 0, keep_positive, keep_other).float()
    per_token_loss = _weighted(-advantages * truncated_ratio * log_prob * inside, rollout_is_weights)
    loss = agg_loss(per_token_loss, response_mask, loss_agg_mode, **params.agg_kwargs)
    with torch.no_grad():
        clipfrac = masked_mean(1.0 - inside, response_mask)
        # Tokens kept but with a truncated importance ratio.
        clipfrac_lower = masked_mean((ratio > params.clip_ratio_c).float() * inside, response_mask)
    return loss, _metrics(clipfrac, approx_kl.detach(), clipfrac_lower)


@register_policy_loss("dppo_tv")
def dppo_tv_policy_loss(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, params,
                        rollout_is_weights=None):
    """DPPO-Binary-TV: keep a token when p - p_old <= clip_ratio_high (A > 0) or
    p - p_old >= -clip_ratio_low (A <= 0), p = pi(token)."""

    def trust_region(prob, old_prob):
        return (prob - old_prob) <= params.clip_ratio_high, (prob - old_prob) >= -params.clip_ratio_low

    return _dppo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, params,
                      rollout_is_weights, trust_region)


@register_policy_loss("dppo_kl")
def dppo_kl_policy_loss(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, params,
                        rollout_is_weights=None):
    """DPPO-Binary-KL: D = KL(Bernoulli(p_old) || Bernoulli(p))
    = p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8)).
    A > 0 keeps a token when D <= clip_ratio_high or p <= p_old; A <= 0 when D <= clip_ratio_low
    or p >= p_old (moving away in the direction the advantage asks is bounded, the other is free)."""

    def trust_region(prob, old_prob):
        divergence = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + DPPO_KL_EPS) / (1.0 - prob + DPPO_KL_EPS))
        return ((divergence <= params.clip_ratio_high) | (prob <= old_prob),
                (divergence <= params.clip_ratio_low) | (prob >= old_prob))

    return _dppo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, params,
                      rollout_is_weights, trust_region)


@register_policy_loss("gspo")
def gspo_policy_loss(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, params,
                     rollout_is_weights=None):
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): clip a *sequence*-level ratio.

    s_i = exp(mean_t log(pi/pi_old)) over the valid tokens of response i (no +-20 clamp).
    Per token the ratio is exp(log pi - sg(log pi) + sg(log s_i)): its value is s_i, its
    gradient flows through each token's log pi. Loss = max(-A*s, -A*clip(s, 1-eps_low, 1+eps_high)),
    aggregated with `loss_agg_mode` (veRL >= 0.9; 0.7.1 forced "seq-mean-token-mean", the paper's
    choice, which gives the same numbers when asked for).
    """
    log_ratio = log_prob - old_log_prob
    valid_tokens = response_mask.sum(dim=-1).clamp(min=1)
    sequence_log_ratio = masked_sum(log_ratio, response_mask, axis=-1) / valid_tokens
    token_log_ratio = log_prob - log_prob.detach() + sequence_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=GSPO_LOG_RATIO_MAX))

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - params.clip_ratio_low, 1 + params.clip_ratio_high)
    per_token_loss = _weighted(torch.maximum(loss_unclipped, loss_clipped), rollout_is_weights)

    loss = agg_loss(per_token_loss, response_mask, loss_agg_mode, **params.agg_kwargs)

    with torch.no_grad():
        clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask)
        approx_kl = masked_mean(-log_ratio, response_mask)
    return loss, _metrics(clipfrac, approx_kl, 0.0)


@register_policy_loss("sapo")
def sapo_policy_loss(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, params,
                     rollout_is_weights=None):
    """SAPO (arXiv:2511.20347): a smooth gate instead of a hard clip.

    L = -A * f(ratio), f(r) = sigmoid(tau * (r - 1)) * 4 / tau, tau = tau_pos where A > 0 else
    tau_neg. f(1) = 2/tau and f'(1) = 1, so on-policy the gradient is the plain policy gradient;
    off-policy it fades smoothly (f'(r) = 4 s (1 - s), s = sigmoid(tau (r - 1))).
    Always aggregated "seq-mean-token-mean", whatever loss_agg_mode says (as veRL 0.9.1 does).
    """
    del loss_agg_mode  # veRL 0.9.1 forces seq-mean-token-mean for SAPO
    tau = torch.where(advantages > 0,
                      torch.as_tensor(params.tau_pos, dtype=advantages.dtype, device=advantages.device),
                      torch.as_tensor(params.tau_neg, dtype=advantages.dtype, device=advantages.device))
    log_ratio = _clipped_log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    per_token_loss = _weighted(-gate * advantages, rollout_is_weights)
    loss = agg_loss(per_token_loss, response_mask, "seq-mean-token-mean", **params.agg_kwargs)
    with torch.no_grad():
        approx_kl = masked_mean(-log_ratio, response_mask)
    return loss, _metrics(0.0, approx_kl, 0.0)


@register_policy_loss("gpg")
def gpg_policy_loss(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, params,
                    rollout_is_weights=None):
    """GPG (Chu et al. 2025): plain policy gradient, L = -A * log pi. No ratio, no clip, and (as
    in veRL) no metrics."""
    del old_log_prob
    per_token_loss = _weighted(-log_prob * advantages, rollout_is_weights)
    return agg_loss(per_token_loss, response_mask, loss_agg_mode, **params.agg_kwargs), {}


@register_policy_loss("clip_cov")
def clip_cov_policy_loss(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, params,
                         rollout_is_weights=None):
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv:2505.22617).

    PPO-clip (no dual clip, no +-20 clamp), plus: the gradient of a few tokens with a large
    covariance between advantage and log-prob is dropped. Per valid token
    cov = (A - mean(A)) * (log pi - mean(log pi)) (means over valid tokens). Candidates: tokens not
    already clipped by PPO with clip_cov_lb < cov < clip_cov_ub; max(1, int(clip_cov_ratio * n_valid))
    of them, picked uniformly at random with `params.generator`, get a zero loss.
    Metrics: actor/pg_clipfrac (share of valid tokens zeroed by the covariance clip), actor/ppo_kl.
    """
    if not params.clip_cov_ratio > 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {params.clip_cov_ratio}")
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - params.clip_ratio_low, 1 + params.clip_ratio_high)

    with torch.no_grad():
        valid = response_mask > 0
        approx_kl = masked_mean(-log_ratio, response_mask)
        clipped_by_ppo = (loss_clipped > loss_unclipped) & valid
        cov = (advantages - masked_mean(advantages, response_mask)) * (
            log_prob.detach() - masked_mean(log_prob.detach(), response_mask))
        candidates = valid & ~clipped_by_ppo & (cov > params.clip_cov_lb) & (cov < params.clip_cov_ub)
        candidate_idx = torch.nonzero(candidates)  # row-major (row, col) pairs
        n_clip = max(int(params.clip_cov_ratio * response_mask.sum().item()), 1)
        keep = torch.ones_like(advantages)
        if len(candidate_idx) > 0:
            order = torch.randperm(len(candidate_idx), generator=params.generator).to(candidate_idx.device)
            picked = candidate_idx[order[:n_clip]]
            keep[picked[:, 0], picked[:, 1]] = 0.0
        clipfrac = masked_mean((keep == 0).float(), response_mask)

    per_token_loss = _weighted(torch.maximum(loss_unclipped, loss_clipped) * keep, rollout_is_weights)
    loss = agg_loss(per_token_loss, response_mask, loss_agg_mode, **params.agg_kwargs)
    return loss, {"actor/pg_clipfrac": _stat(clipfrac), "actor/ppo_kl": _stat(approx_kl)}


@register_policy_loss("kl_cov")
def kl_cov_policy_loss(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, params,
                       rollout_is_weights=None):
    """KL-Cov (same paper as Clip-Cov): L = -A * ratio (no clip, no clamp), and on the
    max(1, int(kl_cov_ratio * n_valid)) valid tokens with the largest covariance
    (A - mean A)(log pi - mean log pi) a penalty ppo_kl_coef * |log pi - log pi_old| is added.
    Metrics: actor/ppo_kl only, which here is the mean *absolute* log-ratio (as veRL logs it).
    """
    if not params.kl_cov_ratio > 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {params.kl_cov_ratio}")
    log_ratio = log_prob - old_log_prob
    abs_log_ratio = log_ratio.abs()
    loss_pg = -advantages * torch.exp(log_ratio)

    with torch.no_grad():
        valid = response_mask > 0
        penalised = torch.zeros_like(valid)
        n_valid = int(valid.sum().item())
        if n_valid > 0:
            valid_adv = advantages[valid]
            valid_logp = log_prob.detach()[valid]
            cov = (valid_adv - valid_adv.mean()) * (valid_logp - valid_logp.mean())
            top = torch.topk(cov, max(1, int(n_valid * params.kl_cov_ratio)), largest=True).indices
            flat_valid_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
            penalised.view(-1)[flat_valid_idx[top]] = True
        approx_abs_kl = masked_mean(abs_log_ratio, response_mask)

    per_token_loss = torch.where(penalised, loss_pg + params.ppo_kl_coef * abs_log_ratio, loss_pg)
    per_token_loss = _weighted(per_token_loss, rollout_is_weights)
    loss = agg_loss(per_token_loss, response_mask, loss_agg_mode, **params.agg_kwargs)
    return loss, {"actor/ppo_kl": _stat(approx_abs_kl)}


@register_policy_loss("geo_mean")
def geo_mean_policy_loss(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, params,
                         rollout_is_weights=None):
    """GMPO (Zhao et al. 2025, arXiv:2507.20673): the geometric mean of token ratios per sequence.

    Per token the log-ratio x is clipped to [-eps_low, eps_high] on the side the advantage
    pushes: x' = sgn(A) * min(sgn(A) x, sgn(A) clip(x)). Per sequence
    r_i = exp(mean_t x'), A_i = mean_t A (sequence-level advantages assumed), L_i = -A_i r_i; the
    loss is the plain mean of L_i over *all* rows (an empty row counts, with L_i = 0).
    `loss_agg_mode` and the agg_loss overrides are not used (as in veRL). IS weights, when given,
    enter as their per-sequence geometric mean. No +-20 clamp.
    Metrics: pg_clipfrac / pg_clipfrac_lower: share of valid tokens whose log-ratio lies outside
    [-eps_low, eps_high] with A > 0 / A < 0.
    """
    del loss_agg_mode  # veRL's geo_mean always takes the mean over sequences
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    log_ratio_clipped = torch.clamp(log_ratio, -params.clip_ratio_low, params.clip_ratio_high)
    log_ratio_pessimistic = sign * torch.minimum(sign * log_ratio, sign * log_ratio_clipped)

    tokens = response_mask.sum(dim=-1)
    sequence_ratio = torch.exp(masked_sum(log_ratio_pessimistic, response_mask, axis=-1) / (tokens + GEO_MEAN_EPS))
    sequence_advantage = masked_sum(advantages, response_mask, axis=-1) / (tokens + GEO_MEAN_EPS)
    sequence_loss = -sequence_advantage * sequence_ratio
    if rollout_is_weights is not None:
        log_w = torch.log(rollout_is_weights + GEO_MEAN_IS_WEIGHT_EPS)
        sequence_loss = sequence_loss * torch.exp(masked_sum(log_w, response_mask, axis=-1) / (tokens + GEO_MEAN_EPS))
    loss = sequence_loss.mean()

    with torch.no_grad():
        approx_kl = masked_mean(-log_ratio, response_mask)
        outside = log_ratio != log_ratio_clipped
        clipfrac = masked_mean((outside & (advantages > 0)).float(), response_mask)
        clipfrac_lower = masked_mean((outside & (advantages < 0)).float(), response_mask)
    return loss, _metrics(clipfrac, approx_kl, clipfrac_lower)


@register_policy_loss("dro")
def dro_policy_loss(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, params,
                    rollout_is_weights=None):
    """Direct Reward Optimization with a quadratic log-ratio penalty:
    L = -(A * log pi - beta / 2 * (log pi - log pi_old)^2), beta = dro_beta > 0 (required).
    No ratio clamp. Metrics: actor/ppo_kl only."""
    beta = params.dro_beta
    if beta is None or not beta > 0:
        raise ValueError(f"loss mode 'dro' needs a positive dro_beta (veRL's policy_loss.dro_beta), got {beta}")
    log_ratio = log_prob - old_log_prob
    per_token_loss = _weighted(-(log_prob * advantages - 0.5 * beta * log_ratio.square()), rollout_is_weights)
    loss = agg_loss(per_token_loss, response_mask, loss_agg_mode, **params.agg_kwargs)
    with torch.no_grad():
        approx_kl = masked_mean(-log_ratio, response_mask)
    return loss, {"actor/ppo_kl": _stat(approx_kl)}


@register_policy_loss("cispo")
def cispo_policy_loss(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, params,
                      rollout_is_weights=None):
    """CISPO (MiniMax-M1, arXiv:2506.13585): clip the importance weight, not the update.

    L = -sg(clip(ratio, 1-eps_low, 1+eps_high)) * A * log pi: every token keeps a gradient
    (unlike PPO, which zeroes clipped tokens), only its weight is bounded.
    """
    log_ratio = _clipped_log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - params.clip_ratio_low, 1 + params.clip_ratio_high)
    per_token_loss = _weighted(-clipped_ratio.detach() * advantages * log_prob, rollout_is_weights)

    loss = agg_loss(per_token_loss, response_mask, loss_agg_mode, **params.agg_kwargs)

    with torch.no_grad():
        clipfrac = masked_mean((ratio != clipped_ratio).float(), response_mask)
        approx_kl = masked_mean(-log_ratio, response_mask)
    return loss, _metrics(clipfrac, approx_kl, 0.0)


# In veRL 0.9.1's registry order.
POLICY_LOSS_MODES: tuple[str, ...] = tuple(POLICY_LOSS_REGISTRY)


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
    tau_pos: float = DEFAULT_TAU_POS,
    tau_neg: float = DEFAULT_TAU_NEG,
    clip_cov_ratio: float = DEFAULT_CLIP_COV_RATIO,
    clip_cov_lb: float = DEFAULT_CLIP_COV_LB,
    clip_cov_ub: float = DEFAULT_CLIP_COV_UB,
    kl_cov_ratio: float = DEFAULT_KL_COV_RATIO,
    ppo_kl_coef: float = DEFAULT_PPO_KL_COEF,
    dro_beta: float | None = None,
    generator: torch.Generator | int | None = None,
    global_batch_size: int | float | torch.Tensor | None = None,
    batch_num_tokens: int | float | torch.Tensor | None = None,
    loss_scale_factor: int | float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy loss of the given mode (one of POLICY_LOSS_MODES) and its metrics.

    - "vanilla": PPO clip + dual-clip (clip_ratio_c); clip_ratio_low/high (default clip_ratio)
      give DAPO's asymmetric clip-higher.
    - "dppo_tv" / "dppo_kl": policy gradient with a truncated ratio (<= clip_ratio_c) inside a
      TV / binary-KL trust region of size clip_ratio_low/high.
    - "gspo": sequence-level ratio, aggregated with loss_agg_mode.
    - "sapo": smooth sigmoid gate (tau_pos, tau_neg); always "seq-mean-token-mean".
    - "gpg": -A * log pi; metrics {}.
    - "clip_cov": PPO-clip plus a random covariance clip (clip_cov_ratio/lb/ub, `generator`).
    - "kl_cov": -A * ratio plus ppo_kl_coef * |log-ratio| on the top kl_cov_ratio covariance tokens.
    - "geo_mean": GMPO, geometric mean of clipped token ratios per sequence; mean over rows.
    - "dro": -A * log pi + dro_beta / 2 * log-ratio^2 (dro_beta > 0 required).
    - "cispo": stop-gradient clipped importance weight times -A * log pi.
    Knobs are veRL's names and defaults. `generator` (a torch.Generator or an int seed) drives
    clip_cov's random pick so that a retried update gives the same loss; None uses torch's global
    generator. `global_batch_size` / `batch_num_tokens` / `loss_scale_factor` go to `agg_loss`;
    `rollout_is_weights` (optional, (bs, L)) multiplies the per-token loss, as in veRL.
    """
    fn = get_policy_loss_fn(mode)
    # Validate the aggregation mode up front, also for modes that then ignore it (sapo, geo_mean):
    # a typo in a config should fail, not pass silently.
    resolve_choice(loss_agg_mode, AGG_MODES, "loss aggregation mode")
    if isinstance(generator, int) and not isinstance(generator, bool):
        generator = torch.Generator().manual_seed(generator)
    params = PolicyLossParams(
        clip_ratio_low=clip_ratio if clip_ratio_low is None else clip_ratio_low,
        clip_ratio_high=clip_ratio if clip_ratio_high is None else clip_ratio_high,
        clip_ratio_c=clip_ratio_c, tau_pos=tau_pos, tau_neg=tau_neg, clip_cov_ratio=clip_cov_ratio,
        clip_cov_lb=clip_cov_lb, clip_cov_ub=clip_cov_ub, kl_cov_ratio=kl_cov_ratio, ppo_kl_coef=ppo_kl_coef,
        dro_beta=dro_beta, global_batch_size=global_batch_size, batch_num_tokens=batch_num_tokens,
        loss_scale_factor=loss_scale_factor, generator=generator)
    return fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode, params=params,
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
    **policy_loss_knobs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """veRL's actor objective on one micro-batch: the policy loss, minus ``entropy_coeff`` x the
    aggregated entropy, plus ``kl_loss_coef`` x the aggregated KL to the reference policy (when
    ``ref_log_prob`` is given). All tensors (bs, L). Returns (loss, stats): ``actor/pg_loss``, the
    policy loss's metrics, ``actor/kl_loss`` and ``actor/kl_coef`` (with a reference) and
    ``actor/entropy`` (token-mean, when ``entropy`` is given).
    ``policy_loss_knobs`` (tau_pos, tau_neg, clip_cov_ratio, clip_cov_lb, clip_cov_ub, kl_cov_ratio,
    ppo_kl_coef, dro_beta, generator) go to `policy_loss` as they are."""
    from kfrl.algos.core import kl_penalty

    pg_loss, stats = policy_loss(loss_mode, old_log_prob, log_prob, advantages, response_mask,
                                 loss_agg_mode=loss_agg_mode, clip_ratio=clip_ratio, clip_ratio_low=clip_ratio_low,
                                 clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c, **policy_loss_knobs)
    stats = {"actor/pg_loss": _stat(pg_loss), **stats}
    scale = policy_loss_knobs.get("loss_scale_factor")  # the entropy and KL terms share the policy loss's
    loss = pg_loss
    if entropy_coeff != 0:
        if entropy is None:
            raise ValueError("entropy_coeff != 0 needs the per-token entropy")
        loss = loss - entropy_coeff * agg_loss(entropy, response_mask, loss_agg_mode, loss_scale_factor=scale)
    if ref_log_prob is not None:
        kl_loss = agg_loss(kl_penalty(log_prob, ref_log_prob, kl_loss_type), response_mask, loss_agg_mode,
                           loss_scale_factor=scale)
        loss = loss + kl_loss_coef * kl_loss
        stats["actor/kl_loss"] = _stat(kl_loss)
        stats["actor/kl_coef"] = float(kl_loss_coef)
    if entropy is not None:
        stats["actor/entropy"] = _stat(agg_loss(entropy.detach(), response_mask, "token-mean"))
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
