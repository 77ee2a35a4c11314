"""Advantage estimators: `advantage(estimator, token_level_rewards, response_mask, ...)`.

Each estimator turns per-token rewards of shape (bs, L) into `(advantages, returns)` of the same
shape, with veRL v0.7.1's numbers (`verl/trainer/ppo/core_algos.py`); gdpo and
optimal_token_baseline, added to veRL later, follow veRL 0.9.1. Outcome-reward estimators
use the sequence score s_i = sum_t r_it (the reward sits on the last valid token) and compare it
with the other responses to the same prompt: the group of i is every j with index[j] == index[i].

Group statistics are computed for all groups at once with scatter ops (index_add / scatter_reduce)
instead of veRL's Python loop over samples; GAE and REINFORCE++ scan the L time steps in reverse
with tensor ops over the batch, exactly like veRL's loop.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from kfrl.algos.core import masked_whiten, resolve_choice



@dataclass(frozen=True)
class _Groups:
    """Per-sample view of the prompt groups: which group, and how large it is."""

    ids: torch.Tensor  # (bs,) long, 0..num_groups-1
    num_groups: int
    size_of_sample: torch.Tensor  # (bs,) float: n_g of each sample's group

    def total(self, per_sample: torch.Tensor) -> torch.Tensor:
        """Sum of `per_sample` over each group, shape (num_groups,)."""
        return per_sample.new_zeros(self.num_groups).index_add(0, self.ids, per_sample)

    def mean_of_sample(self, per_sample: torch.Tensor) -> torch.Tensor:
        """Group mean of `per_sample`, broadcast back to each sample, shape (bs,)."""
        return self.total(per_sample)[self.ids] / self.size_of_sample

    def unbiased_std_of_sample(self, per_sample: torch.Tensor) -> torch.Tensor:
        """Group standard deviation with the N-1 (Bessel) denominator, like torch.std; NaN for
        singleton groups (callers replace it)."""
        squared_deviation = (per_sample - self.mean_of_sample(per_sample)) ** 2
        return (self.total(squared_deviation)[self.ids] / (self.size_of_sample - 1)).sqrt()


def _prompt_groups(index: Any, batch_size: int, device: torch.device, dtype: torch.dtype) -> _Groups:
    if index is None:
        raise ValueError("this advantage estimator needs `index` (one prompt-group id per sample, e.g. the uid)")
    # Tensors/arrays → python scalars, so that ids compare by value (a 0-d tensor hashes by identity).
    ids_as_list = index.tolist() if hasattr(index, "tolist") else list(index)
    if len(ids_as_list) != batch_size:
        raise ValueError(f"index has {len(ids_as_list)} entries for a batch of {batch_size} responses")
    group_number: dict[Any, int] = {}
    ids = torch.tensor([group_number.setdefault(key, len(group_number)) for key in ids_as_list],
                       dtype=torch.long, device=device)
    counts = torch.bincount(ids, minlength=len(group_number)).to(dtype)
    return _Groups(ids=ids, num_groups=len(group_number), size_of_sample=counts[ids])


def _broadcast_over_tokens(per_sequence: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One scalar per response, copied to each of its valid tokens, 0 elsewhere."""
    return per_sequence.unsqueeze(-1) * mask


# ---------------------------------------------------------------------------------------------
# Critic-based: GAE.
# ---------------------------------------------------------------------------------------------


def gae_advantage(rewards, values, mask, gamma: float, lam: float):
    """Generalised Advantage Estimation (Schulman et al. 2015), veRL flavour.

    delta_t = r_t + gamma * V_{t+1} - V_t ;  A_t = delta_t + gamma * lam * A_{t+1}.
    Tokens with mask 0 (padding, tool-observation spans) are skipped: they neither contribute a
    TD error nor break the chain; V_{t+1} / A_{t+1} carry through them from the next valid token,
    and the position reports the carried A. returns = A + V (raw); advantages = A whitened over
    the valid tokens of the whole batch (applied to every position).
    """
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages_reversed = []
    for t in reversed(range(rewards.shape[-1])):
        td_error = rewards[:, t] + gamma * next_value - values[:, t]
        advantage_t = td_error + gamma * lam * next_advantage
        valid = mask[:, t]
        next_value = values[:, t] * valid + (1 - valid) * next_value
        next_advantage = advantage_t * valid + (1 - valid) * next_advantage
        advantages_reversed.append(next_advantage)
    raw_advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = raw_advantages + values
    return masked_whiten(raw_advantages, mask), returns


# ---------------------------------------------------------------------------------------------
# Group baselines (outcome reward).
# ---------------------------------------------------------------------------------------------


def grpo_advantage(scores, mask, groups: _Groups, norm_by_std: bool, epsilon: float):
    """GRPO (Shao et al. 2024): a_i = (s_i - mean_g) / (std_g + eps), std unbiased (N-1).

    norm_by_std=False is Dr.GRPO (Liu et al. 2025): a_i = s_i - mean_g. A singleton group uses
    mean 0 and std 1 (its score passes through, / (1 + eps)); a group of equal scores gets 0.
    """
    is_singleton = groups.size_of_sample == 1
    group_mean = torch.where(is_singleton, torch.zeros_like(scores), groups.mean_of_sample(scores))
    if norm_by_std:
        group_std = torch.where(is_singleton, torch.ones_like(scores), groups.unbiased_std_of_sample(scores))
        per_sequence = (scores - group_mean) / (group_std + epsilon)
    else:
        per_sequence = scores - group_mean
    advantages = _broadcast_over_tokens(per_sequence, mask)
    return advantages, advantages.clone()


def grpo_passk_advantage(scores, mask, groups: _Groups, norm_by_std: bool, epsilon: float):
    """Pass@k training (Chen et al. 2025, arXiv:2503.19595): only the best response of each group
    is credited, with r_max - r_second_max (/ (std_g + eps) if norm_by_std); all others get 0.

    Needs groups of at least 2. On a tie for the maximum the credit is 0 whichever response holds
    it, so the choice of the tied response does not matter.
    """
    if bool((groups.size_of_sample < 2).any()):
        raise ValueError("grpo_passk needs at least 2 responses per prompt group; found a singleton group")
    sample_position = torch.arange(scores.shape[0], device=scores.device)
    group_max = scores.new_full((groups.num_groups,), float("-inf")).scatter_reduce(
        0, groups.ids, scores, reduce="amax")
    # The best response: the first position that reaches the group maximum.
    reaches_max = scores == group_max[groups.ids]
    best_position = torch.full((groups.num_groups,), scores.shape[0], device=scores.device).scatter_reduce(
        0, groups.ids, torch.where(reaches_max, sample_position, scores.shape[0]), reduce="amin")
    is_best = sample_position == best_position[groups.ids]
    second_max = scores.new_full((groups.num_groups,), float("-inf")).scatter_reduce(
        0, groups.ids, scores.masked_fill(is_best, float("-inf")), reduce="amax")
    margin = (group_max - second_max)[groups.ids]
    if norm_by_std:
        margin = margin / (groups.unbiased_std_of_sample(scores) + epsilon)
    per_sequence = torch.where(is_best, margin, torch.zeros_like(scores))
    advantages = _broadcast_over_tokens(per_sequence, mask)
    return advantages, advantages.clone()


def rloo_advantage(scores, mask, groups: _Groups):
    """RLOO (Ahmadian et al. 2024): a_i = s_i - mean of the *other* responses of the group,
    computed as veRL does: s_i * n/(n-1) - mean_g * n/(n-1). A singleton keeps its raw score."""
    n = groups.size_of_sample
    leave_one_out = scores * n / (n - 1).clamp(min=1) - groups.mean_of_sample(scores) * n / (n - 1).clamp(min=1)
    per_sequence = torch.where(n > 1, leave_one_out, scores)
    advantages = _broadcast_over_tokens(per_sequence, mask)
    return advantages, advantages.clone()


def opo_advantage(scores, mask, groups: _Groups):
    """OPO (Hao et al. 2025, arXiv:2505.23585): baseline = length-weighted group mean
    sum_j(len_j * s_j) / sum_j(len_j), len = number of valid tokens. Singleton baseline: 0."""
    lengths = mask.sum(dim=-1)
    weighted_mean = (groups.total(lengths * scores) / groups.total(lengths))[groups.ids]
    baseline = torch.where(groups.size_of_sample > 1, weighted_mean, torch.zeros_like(scores))
    advantages = _broadcast_over_tokens(scores - baseline, mask)
    return advantages, advantages.clone()


def gpg_advantage(scores, mask, groups: _Groups, f_norm: float = 1.0):
    """GPG (Chu et al. 2025): a_i = alpha * (s_i - mean_g) / f_norm with
    alpha = bs / max(#responses with a non-zero score, 1), which rescales the gradient up when
    few responses are rewarded. Singleton mean: 0. (veRL computes but never uses the group std.)"""
    batch_size = scores.shape[0]
    alpha = batch_size / torch.count_nonzero(scores).clamp(min=1)
    group_mean = torch.where(groups.size_of_sample > 1, groups.mean_of_sample(scores), torch.zeros_like(scores))
    advantages = _broadcast_over_tokens(alpha * (scores - group_mean) / f_norm, mask)
    return advantages, advantages.clone()


def reinforce_plus_plus_baseline_advantage(scores, mask, groups: _Groups):
    """REINFORCE++ with a group baseline (Hu 2025): s_i - mean_g (singleton mean 0) on every valid
    token, then whitened over all valid tokens of the batch and re-masked."""
    group_mean = torch.where(groups.size_of_sample > 1, groups.mean_of_sample(scores), torch.zeros_like(scores))
    per_token = (scores - group_mean).unsqueeze(-1).expand_as(mask) * mask
    advantages = masked_whiten(per_token, mask) * mask
    return advantages, advantages.clone()


# ---------------------------------------------------------------------------------------------
# Return-based: REINFORCE++ and ReMax.
# ---------------------------------------------------------------------------------------------


def reinforce_plus_plus_advantage(rewards, mask, gamma: float):
    """REINFORCE++ (Hu 2025): discounted return G_t = r_t + gamma * G_{t+1}, whitened over the
    batch's valid tokens and re-masked.

    veRL v0.7.1 quirk kept for parity: G is reset to 0 *after* each masked position (G_{t+1}
    is multiplied by mask_t), so a hole in the mask cuts the return of the tokens before it; and
    `returns` at masked positions holds r_t + gamma * G_{t+1}, not 0.
    """
    running_return = torch.zeros_like(rewards[:, 0])
    returns_reversed = []
    for t in reversed(range(rewards.shape[-1])):
        running_return = rewards[:, t] + gamma * running_return
        returns_reversed.append(running_return)
        running_return = running_return * mask[:, t]
    returns = torch.stack(returns_reversed[::-1], dim=1)
    advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


def remax_advantage(rewards, mask, reward_baselines):
    """ReMax (Li et al. 2023): the baseline is the reward of the greedy response to the same
    prompt. returns = reverse cumulative sum of the masked rewards; advantages = returns -
    baseline on valid tokens (masked positions keep their return; no whitening)."""
    if reward_baselines is None:
        raise ValueError("remax needs `reward_baselines` (bs,): the reward of a greedy rollout per prompt")
    returns = (rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    advantages = returns - reward_baselines.to(returns.dtype).unsqueeze(-1) * mask
    return advantages, returns


# ---------------------------------------------------------------------------------------------
# veRL 0.9 additions: GDPO (several reward dimensions) and the optimal token baseline.
# ---------------------------------------------------------------------------------------------


def gdpo_advantage(dimension_scores, mask, groups: _Groups, weights=None, epsilon: float = 1e-6):
    """GDPO (arXiv:2601.05242; veRL 0.9 `compute_gdpo_outcome_advantage`): each reward dimension k is
    normalised within its prompt group on its own, A_k,i = (s_k,i - mean_g(s_k)) / (std_g(s_k) + eps)
    (GRPO's rule: unbiased std, singleton mean 0 / std 1), then A_i = sum_k w_k A_k,i is broadcast
    over the valid tokens and whitened over all valid tokens of the batch, and re-masked.

    dimension_scores: (K, bs), one row per dimension; weights: K floats (None: all 1).
    """
    if weights is None:
        weights = [1.0] * dimension_scores.shape[0]
    if len(weights) != dimension_scores.shape[0]:
        raise ValueError(f"gdpo: {len(weights)} weight(s) for {dimension_scores.shape[0]} reward dimension(s)")
    # float32 weights, as veRL's torch.tensor(weights, dtype=float32).
    weights = torch.tensor([float(w) for w in weights], dtype=torch.float32).to(dimension_scores)
    combined = sum(weights[k] * grpo_advantage(dimension_scores[k], mask, groups, True, epsilon)[0]
                   for k in range(dimension_scores.shape[0]))
    advantages = masked_whiten(combined, mask) * mask
    return advantages, advantages.clone()


def optimal_token_baseline_advantage(rewards, mask, groups: _Groups, old_logprobs, sum_pi_squared,
                                     rollout_is_weights=None, handle_zero_tail: bool = True,
                                     epsilon: float = 1e-8):
    """Optimal token baseline (veRL 0.9 `compute_optimal_token_baseline_advantage`): a baseline per
    time step and prompt group, weighted by a cumulative path-variance proxy.

        G_t = sum_{t' >= t} r_t' m_t'                    (reward-to-go; returns)
        w_t = (1 - 2 exp(old_logprob_t) + sum_v pi_t(v)^2) * rho_t^2   (rho: rollout IS weights, or 1)
        W_t = sum_{j <= t} w_j m_j                         (prefix sum, from the first token)
        B_t = sum_{i in g} G_it W_it m_it / (sum_{i in g} W_it m_it + eps)
        A_t = (G_t - B_t) m_t

    A singleton group has B = 0 (A = G). With ``handle_zero_tail``, when one response of a group is
    strictly the longest (length = number of valid tokens), its baseline is 0 from position
    "second-longest length" on, where no other response of the group has a token.
    """
    returns = (rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    per_step = 1 - 2 * old_logprobs.exp() + sum_pi_squared
    if rollout_is_weights is not None:
        per_step = per_step * rollout_is_weights ** 2
    path_weight = (per_step * mask).cumsum(dim=-1)
    numerator = returns.new_zeros(groups.num_groups, returns.shape[1]).index_add(
        0, groups.ids, returns * path_weight * mask)
    denominator = returns.new_zeros(groups.num_groups, returns.shape[1]).index_add(
        0, groups.ids, path_weight * mask) + epsilon
    in_group = (groups.size_of_sample > 1).unsqueeze(-1)
    baselines = torch.where(in_group, (numerator / denominator)[groups.ids], torch.zeros_like(returns))
    if handle_zero_tail:
        lengths = mask.sum(dim=-1)
        longest = lengths.new_full((groups.num_groups,), float("-inf")).scatter_reduce(
            0, groups.ids, lengths, reduce="amax")[groups.ids]
        is_longest = lengths == longest
        count_longest = groups.total(is_longest.to(lengths.dtype))[groups.ids]
        second_longest = lengths.new_full((groups.num_groups,), float("-inf")).scatter_reduce(
            0, groups.ids, lengths.masked_fill(is_longest, float("-inf")), reduce="amax")[groups.ids]
        alone = is_longest & (count_longest == 1) & (groups.size_of_sample > 1)
        position = torch.arange(returns.shape[1], device=returns.device, dtype=lengths.dtype)
        tail = alone.unsqueeze(-1) & (position >= second_longest.unsqueeze(-1))
        baselines = baselines.masked_fill(tail, 0.0)
    advantages = (returns - baselines) * mask
    return advantages, returns


# ---------------------------------------------------------------------------------------------
# The registry (veRL's @register_adv_est): each estimator by name, called with AdvantageInputs.
# ---------------------------------------------------------------------------------------------


@dataclass
class AdvantageInputs:
    """What any estimator may read: rewards and mask (bs, L), prompt-group ids, critic values,
    greedy baselines and the knobs. ``scores`` and ``groups`` are derived on first use."""

    rewards: torch.Tensor
    mask: torch.Tensor
    index: Sequence[Any] | None
    values: torch.Tensor | None
    reward_baselines: torch.Tensor | None
    gamma: float
    lam: float
    norm_adv_by_std: bool
    epsilon: float
    reward_dimensions: torch.Tensor | None = None  # (bs, K): gdpo's reward dimensions
    reward_weights: Sequence[float] | None = None  # K weights of gdpo's dimensions (None: all 1)
    old_logprobs: torch.Tensor | None = None  # (bs, L): optimal_token_baseline's pi_t = exp(old log-prob)
    sum_pi_squared: torch.Tensor | None = None  # (bs, L): sum over the vocabulary of pi_t(v)^2
    rollout_is_weights: torch.Tensor | None = None  # (bs, L): truncated rollout IS weights, if any

    @cached_property
    def scores(self) -> torch.Tensor:
        return self.rewards.sum(dim=-1)

    @cached_property
    def groups(self) -> _Groups:
        return _prompt_groups(self.index, self.scores.shape[0], self.scores.device, self.scores.dtype)


_REGISTRY: dict[str, Callable[[AdvantageInputs], tuple[torch.Tensor, torch.Tensor]]] = {}


def register_adv_est(name: str):
    """Registers an estimator ``fn(AdvantageInputs) -> (advantages, returns)`` under ``name``."""
    def register(fn):
        if name in _REGISTRY:
            raise ValueError(f"advantage estimator {name!r} is registered twice")
        _REGISTRY[name] = fn
        return fn
    return register


@register_adv_est("gae")
def _gae(x: AdvantageInputs):
    if x.values is None:
        raise ValueError("gae needs `values` (bs, L): the critic's value of each response token")
    return gae_advantage(x.rewards, x.values.detach().to(x.rewards.dtype), x.mask, x.gamma, x.lam)


@register_adv_est("grpo")
def _grpo(x: AdvantageInputs):
    return grpo_advantage(x.scores, x.mask, x.groups, x.norm_adv_by_std, x.epsilon)


# Estimators of the sequence scores against the prompt group (leave-one-out, optimal or plain baselines).
for _name, _group_estimator in (("rloo", rloo_advantage), ("opo", opo_advantage), ("gpg", gpg_advantage)):
    register_adv_est(_name)(lambda x, fn=_group_estimator: fn(x.scores, x.mask, x.groups))


@register_adv_est("grpo_passk")
def _grpo_passk(x: AdvantageInputs):
    return grpo_passk_advantage(x.scores, x.mask, x.groups, x.norm_adv_by_std, x.epsilon)


@register_adv_est("reinforce_plus_plus")
def _reinforce_plus_plus(x: AdvantageInputs):
    return reinforce_plus_plus_advantage(x.rewards, x.mask, x.gamma)


@register_adv_est("reinforce_plus_plus_baseline")
def _reinforce_plus_plus_baseline(x: AdvantageInputs):
    return reinforce_plus_plus_baseline_advantage(x.scores, x.mask, x.groups)


@register_adv_est("remax")
def _remax(x: AdvantageInputs):
    return remax_advantage(x.rewards, x.mask, x.reward_baselines)


@register_adv_est("gdpo")
def _gdpo(x: AdvantageInputs):
    # Without dimensions, veRL falls back to one dimension: the token-level rewards' sum.
    if x.reward_dimensions is None:
        dimensions = x.scores.unsqueeze(0)
    else:
        dimensions = x.reward_dimensions.detach().to(x.rewards.dtype)
        if dimensions.dim() != 2 or dimensions.shape[0] != x.rewards.shape[0]:
            raise ValueError(f"gdpo: reward_dimensions must be (bs, K) = ({x.rewards.shape[0]}, K); "
                             f"got {tuple(dimensions.shape)}")
        dimensions = dimensions.T
    return gdpo_advantage(dimensions, x.mask, x.groups, x.reward_weights, x.epsilon)


@register_adv_est("optimal_token_baseline")
def _optimal_token_baseline(x: AdvantageInputs):
    for name in ("old_logprobs", "sum_pi_squared"):
        tensor = getattr(x, name)
        if tensor is None:
            raise ValueError(f"optimal_token_baseline needs `{name}` (bs, L) from the old-logprob pass")
        if tensor.shape != x.rewards.shape:
            raise ValueError(f"optimal_token_baseline: `{name}` is {tuple(tensor.shape)}, expected "
                             f"{tuple(x.rewards.shape)}")
    weights = None if x.rollout_is_weights is None else x.rollout_is_weights.detach().to(x.rewards.dtype)
    # veRL's trainer passes neither epsilon nor handle_zero_tail: its defaults (1e-8, True) apply.
    return optimal_token_baseline_advantage(x.rewards, x.mask, x.groups, x.old_logprobs.detach().to(x.rewards.dtype),
                                            x.sum_pi_squared.detach().to(x.rewards.dtype), weights)


ESTIMATORS: tuple[str, ...] = tuple(_REGISTRY)


def advantage(
    estimator: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: Sequence[Any] | None = None,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
    reward_dimensions: torch.Tensor | None = None,
    reward_weights: Sequence[float] | None = None,
    old_logprobs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute `(advantages, returns)`, both (bs, L), with the named estimator.

    estimator: one of ESTIMATORS. `index` (prompt-group ids) is required by the group estimators,
    `values` by "gae", `reward_baselines` by "remax". `gamma` is used by gae and
    reinforce_plus_plus, `lam` by gae, `norm_adv_by_std` (False = Dr.GRPO) and `epsilon` by grpo
    and grpo_passk. "gdpo" reads `reward_dimensions` (bs, K) and `reward_weights` (K; None = all 1),
    always divides by the group std and uses `epsilon` (without dimensions it uses the rewards' sum as
    its one dimension); "optimal_token_baseline" reads `old_logprobs` and `sum_pi_squared` (bs, L)
    and optionally `rollout_is_weights` (bs, L), with its own epsilon 1e-8 as in veRL.
    Gradients never flow through the result (computed under no_grad).
    """
    estimator = resolve_choice(estimator, ESTIMATORS, "advantage estimator")
    if token_level_rewards.dim() != 2 or response_mask.shape != token_level_rewards.shape:
        raise ValueError(
            f"token_level_rewards and response_mask must both be (bs, L); got "
            f"{tuple(token_level_rewards.shape)} and {tuple(response_mask.shape)}")
    with torch.no_grad():
        rewards = token_level_rewards.detach()
        # A float copy of the mask, so that (1 - mask) and products work for bool/int masks too.
        mask = response_mask.detach().to(rewards.dtype)
        return _REGISTRY[estimator](AdvantageInputs(rewards, mask, index, values, reward_baselines, gamma, lam,
                                                    norm_adv_by_std, epsilon, reward_dimensions, reward_weights,
                                                    old_logprobs, sum_pi_squared, rollout_is_weights))
