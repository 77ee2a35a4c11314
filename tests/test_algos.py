"""kfrl.algos against hand-derived numbers (veRL v0.7.1 semantics) and property tests.

Expected values are worked out by hand or with plain Python arithmetic in the test, never by
calling the function under test.
"""
from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kfrl.algos import (
    AGG_MODES,
    ESTIMATORS,
    KL_KINDS,
    POLICY_LOSS_MODES,
    AdaptiveKLController,
    FixedKLController,
    advantage,
    agg_loss,
    entropy_from_logits,
    kl_penalty,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    policy_loss,
    value_loss,
)
from numerics import gamma

F = torch.float32

# float32 results against exact values, tolerances from the error model of close(): also run under make test-portability.
pytestmark = pytest.mark.numerics
EPS = 1e-6  # GRPO's default epsilon


def T(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F)


def close(actual, expected, atol=1e-6, rtol=1e-5):
    """A float32 result against its exact (hand-derived, float64) value. Error model (tests/numerics.py):
    the inputs here have at most ~30 elements, so a float32 result is within gamma(30) ~ 1.8e-6 of the
    exact one relative to the sum of |terms| it is built from; these small cases keep that sum within a
    few |expected| (rtol 1e-5) or, where a result cancels to ~0, below ~0.5 (atol 1e-6). Whitening
    divides by a std below 1: those checks pass atol 1e-5."""
    torch.testing.assert_close(torch.as_tensor(actual, dtype=F), torch.as_tensor(expected, dtype=F),
                               atol=atol, rtol=rtol)


def whiten_by_hand(valid_values):
    """(x - mean) / sqrt(unbiased var + 1e-8) as a function, from plain Python statistics."""
    mean = statistics.mean(valid_values)
    std = math.sqrt(statistics.variance(valid_values) + 1e-8)
    return lambda x: (x - mean) / std


def outcome_rewards(scores, lengths, L):
    """veRL puts the sequence score on the last valid response token."""
    rewards = torch.zeros(len(scores), L)
    mask = torch.zeros(len(scores), L)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        rewards[i, n - 1] = s
        mask[i, :n] = 1
    return rewards, mask


# ---------------------------------------------------------------------------------------------
# Masked helpers and entropy
# ---------------------------------------------------------------------------------------------


def test_masked_sum_mean_var():
    values = T([[1, 2, 3], [4, 5, 6]])
    mask = T([[1, 1, 0], [1, 0, 0]])
    close(masked_sum(values, mask), 7.0)
    close(masked_mean(values, mask), 7 / 3)
    close(masked_mean(values, mask, axis=-1), [1.5, 4.0])
    close(masked_var(values, mask), statistics.variance([1, 2, 4]))
    close(masked_var(values, mask, unbiased=False), statistics.pvariance([1, 2, 4]))


def test_masked_sum_ignores_nan_outside_mask():
    values = T([[1.0, float("nan"), float("inf")]])
    mask = T([[1, 0, 0]])
    close(masked_sum(values, mask), 1.0)
    close(masked_mean(values, mask), 1.0)


def test_masked_var_needs_two_elements():
    with pytest.raises(ValueError):
        masked_var(T([[1, 2]]), T([[0, 0]]))
    with pytest.raises(ValueError):
        masked_var(T([[1, 2]]), T([[1, 0]]))


def test_masked_whiten_applies_to_masked_positions_too():
    values = T([[1, 2, 100]])
    mask = T([[1, 1, 0]])
    f = whiten_by_hand([1, 2])
    close(masked_whiten(values, mask), [[f(1), f(2), f(100)]], rtol=1e-5)


def test_entropy_from_logits():
    close(entropy_from_logits(torch.zeros(2, 4)), [math.log(4)] * 2)
    p = [0.25, 0.75]
    close(entropy_from_logits(T([[0.0, math.log(3)]])), [-(p[0] * math.log(p[0]) + p[1] * math.log(p[1]))])
    # A (near) one-hot distribution has ~0 entropy and stays finite.
    assert torch.isfinite(entropy_from_logits(T([[0.0, -1e4]]))).all()


# ---------------------------------------------------------------------------------------------
# Loss aggregation
# ---------------------------------------------------------------------------------------------

AGG_LOSS = T([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
AGG_MASK = T([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the third sequence is empty


@pytest.mark.parametrize("mode, kwargs, expected", [
    ("token-mean", {}, (1 + 2 + 4) / 3),
    ("token-mean", {"batch_num_tokens": 10}, 7 / 10),
    ("seq-mean-token-sum", {}, (3 + 4) / 2),  # the empty sequence does not count
    ("seq-mean-token-sum", {"global_batch_size": 4}, 7 / 4),
    ("seq-mean-token-mean", {}, (1.5 + 4) / 2),
    ("seq-mean-token-mean", {"global_batch_size": 4}, 5.5 / 4),
    ("seq-mean-token-sum-norm", {}, (3 + 4) / 2 / 3),  # / padded length L = 3
    ("seq-mean-token-sum-norm", {"loss_scale_factor": 5}, 3.5 / 5),
    ("seq-mean-token-sum-norm", {"global_batch_size": 7, "loss_scale_factor": 2}, 7 / 7 / 2),
])
def test_agg_loss_modes(mode, kwargs, expected):
    close(agg_loss(AGG_LOSS, AGG_MASK, mode, **kwargs), expected)


def test_agg_loss_unknown_mode_names_nearest_first():
    with pytest.raises(ValueError, match="token_mean") as info:
        agg_loss(AGG_LOSS, AGG_MASK, "token_mean")
    listing = str(info.value).split("nearest first):")[1]
    assert listing.strip().startswith("token-mean")
    assert all(m in listing for m in AGG_MODES)


# ---------------------------------------------------------------------------------------------
# KL estimators and controllers
# ---------------------------------------------------------------------------------------------

LOGP = T([[-1.0, -2.0]])
REF = T([[-1.5, -1.0]])


@pytest.mark.parametrize("kind, expected", [
    ("kl", [0.5, -1.0]), ("k1", [0.5, -1.0]),
    ("abs", [0.5, 1.0]),
    ("mse", [0.125, 0.5]), ("k2", [0.125, 0.5]),
    # k3 = exp(ref - logp) - (ref - logp) - 1
    ("low_var_kl", [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]),
    ("k3", [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]),
])
def test_kl_penalty_kinds(kind, expected):
    close(kl_penalty(LOGP, REF, kind), [expected])


def test_kl_kinds_constant():
    assert set(KL_KINDS) == {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"}


def test_k3_clamps():
    logp = T([[0.0, 0.0, 0.0, -1000.0]]).requires_grad_()
    ref = T([[5.0, -30.0, 1000.0, 0.0]])
    k3 = kl_penalty(logp, ref, "k3")
    # exp(5) - 6 = 142.4 -> clamped to 10; ref - logp = -30 -> clamped to -20 -> exp(-20) + 19 -> 10;
    # huge log-ratios stay finite thanks to the +-20 clamp, then hit the value clamp.
    close(k3, [[10.0, 10.0, 10.0, 10.0]])
    (grad,) = torch.autograd.grad(k3.sum(), logp)
    close(grad, torch.zeros(1, 4))  # a clamped value carries no gradient
    # Inside the clamps: exp(-1) + 1 - 1 = 0.3679 and its gradient d/dlogp = 1 - exp(ref - logp).
    logp2 = T([[0.0]]).requires_grad_()
    k3b = kl_penalty(logp2, T([[-1.0]]), "k3")
    close(k3b, [[math.exp(-1.0)]])
    (g,) = torch.autograd.grad(k3b.sum(), logp2)
    close(g, [[1 - math.exp(-1.0)]])


@pytest.mark.parametrize("kind", ["full", "k3+", "low_var_kl+", "k1+"])
def test_kl_kinds_veRL_cannot_compute_raise(kind):
    with pytest.raises(NotImplementedError, match="not supported"):
        kl_penalty(LOGP, REF, kind)
    with pytest.raises(ValueError):  # also a ValueError, like the other bad names
        kl_penalty(LOGP, REF, kind)


def test_kl_unknown_kind():
    with pytest.raises(ValueError, match="'k4'") as info:
        kl_penalty(LOGP, REF, "k4")
    assert "k3" in str(info.value) and "low_var_kl" in str(info.value)


def test_fixed_kl_controller():
    ctl = FixedKLController(0.05)
    ctl.update(10.0, 1000)
    assert ctl.value == 0.05


def test_adaptive_kl_controller():
    ctl = AdaptiveKLController(init_kl_coef=0.001, target_kl=0.1, horizon=10000)
    ctl.update(0.2, 256)  # error 1.0 clipped to +0.2
    expected = 0.001 * (1 + 0.2 * 256 / 10000)
    assert ctl.value == pytest.approx(expected, rel=1e-12)
    ctl.update(torch.tensor(0.05), 100)  # error -0.5 clipped to -0.2; tensors accepted
    expected *= 1 - 0.2 * 100 / 10000
    assert ctl.value == pytest.approx(expected, rel=1e-7)
    ctl.update(0.11, 1000)  # error +0.1, inside the clip
    expected *= 1 + 0.1 * 1000 / 10000
    assert ctl.value == pytest.approx(expected, rel=1e-7)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.001, 0.1, 0)


# ---------------------------------------------------------------------------------------------
# Advantage estimators
# ---------------------------------------------------------------------------------------------

# Group a: three responses scored 1, 0, 0; group b: a singleton scored 0.5; group c: equal scores.
SCORES = [1.0, 0.0, 0.0, 0.5, 1.0, 1.0]
LENGTHS = [2, 3, 1, 3, 2, 3]
INDEX = ["a", "a", "a", "b", "c", "c"]
L = 4


def per_sequence(adv, mask):
    """The scalar a_i of an outcome estimator: it must sit on every valid token and 0 elsewhere."""
    first = adv[:, 0]
    close(adv, first.unsqueeze(-1) * mask)
    return first


def test_grpo():
    rewards, mask = outcome_rewards(SCORES, LENGTHS, L)
    adv, ret = advantage("grpo", rewards, mask, index=INDEX)
    mean_a, std_a = 1 / 3, math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # unbiased (N-1)
    expected = [(1 - mean_a) / (std_a + EPS), (0 - mean_a) / (std_a + EPS), (0 - mean_a) / (std_a + EPS),
                0.5 / (1 + EPS),  # singleton: mean 0, std 1
                0.0, 0.0]  # equal scores: 0 / (0 + eps)
    close(per_sequence(adv, mask), expected)
    close(ret, adv)


def test_dr_grpo_no_std_normalisation():
    rewards, mask = outcome_rewards(SCORES, LENGTHS, L)
    adv, _ = advantage("grpo", rewards, mask, index=INDEX, norm_adv_by_std=False)
    close(per_sequence(adv, mask), [2 / 3, -1 / 3, -1 / 3, 0.5, 0.0, 0.0])


def test_grpo_epsilon_and_numpy_index():
    import numpy as np

    rewards, mask = outcome_rewards([2.0, 0.0], [1, 1], 1)
    adv, _ = advantage("grpo", rewards, mask, index=np.array(["u", "u"], dtype=object), epsilon=0.1)
    std = math.sqrt(2.0)  # unbiased std of {2, 0}
    close(per_sequence(adv, mask), [1 / (std + 0.1), -1 / (std + 0.1)])


def test_rloo():
    rewards, mask = outcome_rewards(SCORES, LENGTHS, L)
    adv, ret = advantage("rloo", rewards, mask, index=INDEX)
    # s_i - mean of the other responses; a singleton keeps its raw score.
    close(per_sequence(adv, mask), [1 - 0, 0 - 0.5, 0 - 0.5, 0.5, 0.0, 0.0])
    close(ret, adv)


def test_opo_length_weighted_baseline():
    scores, lengths = [1.0, 0.0, 2.0, 0.5], [2, 3, 1, 3]
    rewards, mask = outcome_rewards(scores, lengths, L)
    adv, _ = advantage("opo", rewards, mask, index=["a", "a", "a", "b"])
    baseline = (2 * 1.0 + 3 * 0.0 + 1 * 2.0) / (2 + 3 + 1)
    close(per_sequence(adv, mask), [1 - baseline, 0 - baseline, 2 - baseline, 0.5])


def test_gpg():
    rewards, mask = outcome_rewards(SCORES, LENGTHS, L)
    adv, _ = advantage("gpg", rewards, mask, index=INDEX)
    alpha = 6 / 4  # batch size / number of non-zero scores
    close(per_sequence(adv, mask), [alpha * (1 - 1 / 3), alpha * (-1 / 3), alpha * (-1 / 3), alpha * 0.5, 0, 0])
    # No rewarded response: alpha = bs / max(0, 1), advantages all 0.
    zero_adv, _ = advantage("gpg", torch.zeros(2, 2), torch.ones(2, 2), index=["a", "a"])
    close(zero_adv, torch.zeros(2, 2))


def test_grpo_passk():
    scores = [1.0, 0.0, 0.5, 1.0, 1.0, 0.0]
    rewards, mask = outcome_rewards(scores, [1, 2, 3, 1, 2, 3], L)
    index = ["a", "a", "a", "b", "b", "b"]
    adv, ret = advantage("grpo_passk", rewards, mask, index=index)
    std_a = statistics.stdev([1.0, 0.0, 0.5])
    # Only the best response of a gets r_max - r_second; group b ties for the max -> all 0.
    close(per_sequence(adv, mask), [(1.0 - 0.5) / (std_a + EPS), 0, 0, 0, 0, 0])
    close(ret, adv)
    adv_raw, _ = advantage("grpo_passk", rewards, mask, index=index, norm_adv_by_std=False)
    close(per_sequence(adv_raw, mask), [0.5, 0, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="at least 2"):
        advantage("grpo_passk", rewards, mask, index=["a", "a", "a", "b", "b", "c"])


def test_reinforce_plus_plus_baseline():
    rewards, mask = outcome_rewards(SCORES, LENGTHS, L)
    adv, ret = advantage("reinforce_plus_plus_baseline", rewards, mask, index=INDEX)
    centred = [1 - 1 / 3, -1 / 3, -1 / 3, 0.5, 0.0, 0.0]  # singleton: mean 0
    f = whiten_by_hand([c for c, n in zip(centred, LENGTHS) for _ in range(n)])
    expected = [[f(c) if t < n else 0.0 for t in range(L)] for c, n in zip(centred, LENGTHS)]
    close(adv, expected, rtol=1e-5, atol=1e-5)
    close(ret, adv)


def test_reinforce_plus_plus_with_hole():
    gamma = 0.5
    rewards = T([[1, 2, 3, 0], [0, 0, 4, 0]])
    mask = T([[1, 0, 1, 0], [1, 1, 1, 0]])
    adv, ret = advantage("reinforce_plus_plus", rewards, mask, gamma=gamma)
    # Row 0, reverse: t3 G=0 | t2 G=3 | t1 (hole) G=2+0.5*3=3.5, then reset to 0 | t0 G=1+0.5*0=1.
    # Row 1: t3 G=0 | t2 G=4 | t1 G=0+0.5*4=2 | t0 G=1.
    close(ret, [[1, 3.5, 3, 0], [1, 2, 4, 0]])
    f = whiten_by_hand([1, 3, 1, 2, 4])
    close(adv, [[f(1), 0, f(3), 0], [f(1), f(2), f(4), 0]], atol=1e-5)


def test_remax_with_hole():
    rewards = T([[0.5, 9.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    mask = T([[1, 0, 1, 0], [1, 1, 0, 0]])
    baselines = T([0.4, 1.5])
    adv, ret = advantage("remax", rewards, mask, reward_baselines=baselines)
    # returns = reverse cumsum of rewards*mask (the 9 at the hole is dropped)
    close(ret, [[1.5, 1.0, 1.0, 0.0], [2.0, 2.0, 0.0, 0.0]])
    # advantages subtract the baseline on valid tokens only: the hole keeps its return
    close(adv, [[1.1, 1.0, 0.6, 0.0], [0.5, 0.5, 0.0, 0.0]])


def test_gae_with_hole_and_padding():
    gamma, lam = 0.9, 0.8
    rewards = T([[0, 0, 0, 1], [0, 0, 2, 0]])
    values = T([[0.5, 0.4, 9.0, 0.7], [1.0, 1.0, 1.0, 5.0]])
    mask = T([[1, 1, 0, 1], [1, 1, 1, 0]])  # row 0: a tool-observation hole at t=2; row 1: padding
    adv, ret = advantage("gae", rewards, mask, values=values, gamma=gamma, lam=lam)
    gl = gamma * lam
    # Row 0, reverse: t3 delta = 1 - 0.7 = 0.3 -> A3 = 0.3; t2 is skipped: V and A carry (A2 = 0.3);
    # t1 delta = 0.9*0.7 - 0.4 = 0.23 -> A1 = 0.23 + gl*0.3; t0 delta = 0.9*0.4 - 0.5 -> A0.
    a3 = 0.3
    a1 = 0.9 * 0.7 - 0.4 + gl * a3
    a0 = 0.9 * 0.4 - 0.5 + gl * a1
    row0 = [a0, a1, a3, a3]
    # Row 1: t3 padding -> 0; t2 delta = 2 - 1 = 1; t1 delta = 0.9 - 1 = -0.1 -> -0.1 + gl; t0 likewise.
    b2 = 1.0
    b1 = -0.1 + gl * b2
    b0 = -0.1 + gl * b1
    row1 = [b0, b1, b2, 0.0]
    close(ret, [[r + v for r, v in zip(row0, values[0].tolist())], [r + v for r, v in zip(row1, values[1].tolist())]])
    f = whiten_by_hand([a0, a1, a3, b0, b1, b2])
    # Whitening is applied to every position, masked ones included (veRL does not re-mask).
    close(adv, [[f(x) for x in row0], [f(x) for x in row1]], atol=1e-5)


def test_estimator_input_errors():
    rewards, mask = outcome_rewards([1.0, 0.0], [1, 1], 2)
    for name in ("grpo", "rloo", "opo", "gpg", "grpo_passk", "reinforce_plus_plus_baseline"):
        with pytest.raises(ValueError, match="index"):
            advantage(name, rewards, mask)
    with pytest.raises(ValueError, match="index has 3"):
        advantage("grpo", rewards, mask, index=["a", "a", "b"])
    with pytest.raises(ValueError, match="values"):
        advantage("gae", rewards, mask)
    with pytest.raises(ValueError, match="reward_baselines"):
        advantage("remax", rewards, mask)
    with pytest.raises(ValueError, match="'grop'") as info:
        advantage("grop", rewards, mask, index=["a", "a"])
    assert str(info.value).split("nearest first):")[1].strip().startswith("grpo")


def test_estimators_do_not_mutate_inputs_and_carry_no_grad():
    rewards, mask = outcome_rewards(SCORES, LENGTHS, L)
    rewards.requires_grad_()
    values = torch.randn(6, L)
    baselines = torch.rand(6)
    snapshot = [x.detach().clone() for x in (rewards, mask, values, baselines)]
    index = ["a", "a", "b", "b", "c", "c"]
    # optimal_token_baseline's inputs (the old-logprob pass's log-probs and sum of squared probabilities).
    token_stats = dict(old_logprobs=-torch.rand(6, L), sum_pi_squared=torch.rand(6, L))
    for name in ESTIMATORS:
        adv, ret = advantage(name, rewards, mask, index=index, values=values, reward_baselines=baselines,
                             **token_stats)
        assert adv.shape == ret.shape == (6, L)
        assert not adv.requires_grad and not ret.requires_grad
        adv.add_(1.0)  # writing into a result must not touch the other result or the inputs
    for before, after in zip(snapshot, (rewards, mask, values, baselines)):
        assert torch.equal(before, after.detach())


def test_bool_and_int_masks_give_the_same_result():
    rewards, mask = outcome_rewards(SCORES, LENGTHS, L)
    for name in ("grpo", "reinforce_plus_plus", "gae"):
        kw = dict(index=INDEX, values=torch.ones(6, L) * 0.5)
        expected = advantage(name, rewards, mask, **kw)
        for m in (mask.bool(), mask.long()):
            got = advantage(name, rewards, m, **kw)
            close(got[0], expected[0])
            close(got[1], expected[1])


# ---------------------------------------------------------------------------------------------
# Policy losses
# ---------------------------------------------------------------------------------------------

# One sequence, five valid tokens plus one masked token; old log-prob 0 so ratio = exp(log_prob).
RATIOS = [1.1, 1.5, 0.5, 0.5, 4.0, 1.0]
ADVS = [1.0, 1.0, 1.0, -1.0, -1.0, 5.0]
PG_MASK = T([[1, 1, 1, 1, 1, 0]])


def pg_inputs():
    log_prob = torch.log(T([RATIOS])).requires_grad_()
    return torch.zeros(1, 6), log_prob, T([ADVS]), PG_MASK


def test_vanilla_ppo_with_dual_clip_hand_values():
    old, log_prob, adv, mask = pg_inputs()
    loss, metrics = policy_loss("vanilla", old, log_prob, adv, mask)
    # token: r=1.1,A=+1 -> -1.1 | r=1.5,A=+1 -> max(-1.5,-1.2) = -1.2 (clipped) | r=0.5,A=+1 -> -0.5
    #        r=0.5,A=-1 -> max(0.5,0.8) = 0.8 (clipped) | r=4,A=-1 -> min(3, max(4, 1.2)) = 3 (dual clip)
    close(loss, (-1.1 - 1.2 - 0.5 + 0.8 + 3.0) / 5)
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
    # Detached 0-d tensors on the loss's device: the update reads them all at once, at its end.
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in metrics.values())
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 5)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 5)
    assert metrics["actor/ppo_kl"] == pytest.approx(-sum(math.log(r) for r in RATIOS[:5]) / 5, rel=1e-5)
    # Gradient d/dlogp of -A*r is -A*r (unclipped tokens) and 0 where a clip is active.
    (grad,) = torch.autograd.grad(loss, log_prob)
    close(grad, [[-1.1 / 5, 0, -0.5 / 5, 0, 0, 0]])


def test_vanilla_clip_higher_dapo():
    old, log_prob, adv, mask = pg_inputs()
    loss, metrics = policy_loss("vanilla", old, log_prob, adv, mask,
                                clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0)
    # r=1.5,A=+1 now clips at 1.28; r=4,A=-1: min(10, 4) = 4 -> the dual clip is inactive.
    close(loss, (-1.1 - 1.28 - 0.5 + 0.8 + 4.0) / 5)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 5)
    assert metrics["actor/pg_clipfrac_lower"] == 0.0


def test_vanilla_clip_ratio_defaults_and_validation():
    old, log_prob, adv, mask = pg_inputs()
    loss, _ = policy_loss("vanilla", old, log_prob, adv, mask, clip_ratio=0.1)
    # eps 0.1: r=1.1 sits on the bound (-1.1); 1.5 -> -1.1; 0.5,A=+1 -> -0.5; 0.5,A=-1 -> 0.9; 4 -> 3
    close(loss, (-1.1 - 1.1 - 0.5 + 0.9 + 3.0) / 5)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss("vanilla", old, log_prob, adv, mask, clip_ratio_c=1.0)


def test_vanilla_log_ratio_is_clamped_at_20():
    old = T([[0.0, 0.0]])
    log_prob = T([[30.0, -30.0]])
    adv = T([[-1.0, 1.0]])
    loss, metrics = policy_loss("vanilla", old, log_prob, adv, torch.ones(1, 2))
    # ratio e^20 with A=-1: dual clip -> 3; ratio e^-20 with A=+1: max(-e^-20, -0.8) = -e^-20.
    close(loss, (3.0 - math.exp(-20)) / 2)
    assert metrics["actor/ppo_kl"] == pytest.approx((-20 + 20) / 2, abs=1e-6)
    _, m1 = policy_loss("vanilla", T([[0.0]]), T([[30.0]]), T([[1.0]]), torch.ones(1, 1))
    assert m1["actor/ppo_kl"] == pytest.approx(-20.0)


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", (-1.1 - 1.2 - 0.5 + 0.8 + 3.0) / 5),
    ("seq-mean-token-sum", (-1.1 - 1.2 - 0.5 + 0.8 + 3.0) / 1),
    ("seq-mean-token-mean", (-1.1 - 1.2 - 0.5 + 0.8 + 3.0) / 5),
    ("seq-mean-token-sum-norm", (-1.1 - 1.2 - 0.5 + 0.8 + 3.0) / 1 / 6),
])
def test_vanilla_each_agg_mode(mode, expected):
    old, log_prob, adv, mask = pg_inputs()
    loss, _ = policy_loss("vanilla", old, log_prob, adv, mask, loss_agg_mode=mode)
    close(loss, expected)


def test_vanilla_rollout_is_weights_and_global_batch_info():
    old, log_prob, adv, mask = pg_inputs()
    weights = T([[2, 1, 1, 1, 1, 1]])
    loss, _ = policy_loss("vanilla", old, log_prob, adv, mask, rollout_is_weights=weights, batch_num_tokens=10)
    close(loss, (-2.2 - 1.2 - 0.5 + 0.8 + 3.0) / 10)


def test_gspo_sequence_ratio_and_aggregation():
    old = torch.zeros(2, 2)
    log_prob = T([[0.1, 0.3], [-0.05, 0.5]]).requires_grad_()
    adv = T([[1.0, 1.0], [-1.0, -1.0]])
    mask = T([[1, 1], [1, 0]])
    s1 = math.exp((0.1 + 0.3) / 2)  # 1.2214 -> clipped to 1.2 for A > 0
    s2 = math.exp(-0.05)  # inside the clip range
    assert s1 > 1.2
    # veRL 0.9 (changed from 0.7.1, which forced seq-mean-token-mean): loss_agg_mode is honoured.
    loss, metrics = policy_loss("gspo", old, log_prob, adv, mask, loss_agg_mode="token-mean")
    close(loss, (-1.2 - 1.2 + s2) / 3)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 3)
    assert metrics["actor/ppo_kl"] == pytest.approx(-(0.1 + 0.3 - 0.05) / 3, rel=1e-5)
    assert metrics["actor/pg_clipfrac_lower"] == 0.0
    (grad,) = torch.autograd.grad(loss, log_prob)
    # Clipped sequence: no gradient. Sequence 2: d/dlogp(-A * s) = -A * s, / 3 valid tokens.
    close(grad, [[0.0, 0.0], [s2 / 3, 0.0]])
    # seq-mean-token-mean: mean over sequences of per-sequence token means (0.7.1's forced choice).
    loss, _ = policy_loss("gspo", old, log_prob, adv, mask, loss_agg_mode="seq-mean-token-mean")
    close(loss, ((-1.2 - 1.2) / 2 + s2 / 1) / 2)
    (grad,) = torch.autograd.grad(loss, log_prob)
    close(grad, [[0.0, 0.0], [s2 / 2, 0.0]])


def test_gspo_has_no_20_clamp_but_caps_log_ratio_at_10():
    old = torch.zeros(1, 2)
    log_prob = T([[30.0, 0.0]])
    _, metrics = policy_loss("gspo", old, log_prob, T([[1.0, 1.0]]), torch.ones(1, 2))
    assert metrics["actor/ppo_kl"] == pytest.approx(-15.0)  # unclamped mean of -30 and 0
    loss, _ = policy_loss("gspo", old, log_prob, T([[-1.0, -1.0]]), torch.ones(1, 2), clip_ratio=0.2)
    close(loss, math.exp(10.0), rtol=1e-5)  # seq log-ratio 15 is capped at 10; A<0 -> max(e^10, 1.2)


def test_gpg_loss():
    log_prob = T([[-1.0, -2.0], [-0.5, -3.0]]).requires_grad_()
    adv = T([[1.0, 1.0], [-2.0, -2.0]])
    mask = T([[1, 1], [1, 0]])
    loss, metrics = policy_loss("gpg", torch.zeros(2, 2), log_prob, adv, mask)
    close(loss, (1.0 + 2.0 - 1.0) / 3)
    assert metrics == {}
    (grad,) = torch.autograd.grad(loss, log_prob)
    close(grad, [[-1 / 3, -1 / 3], [2 / 3, 0.0]])
    loss_seq, _ = policy_loss("gpg", torch.zeros(2, 2), log_prob, adv, mask, loss_agg_mode="seq-mean-token-sum")
    close(loss_seq, (3.0 + -1.0) / 2)


def test_cispo_loss():
    log_prob = T([[-1.0, -2.0, -0.5]]).requires_grad_()
    ratios = [1.5, 0.5, 1.0]
    old = log_prob.detach() - torch.log(T([ratios]))
    adv = T([[1.0, 1.0, -1.0]])
    loss, metrics = policy_loss("cispo", old, log_prob, adv, torch.ones(1, 3))
    # -sg(clip(r)) * A * logp: clip(1.5) = 1.2, clip(0.5) = 0.8, clip(1.0) = 1.0
    close(loss, (-1.2 * 1 * -1.0 + -0.8 * 1 * -2.0 + -1.0 * -1 * -0.5) / 3)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 3)
    assert metrics["actor/ppo_kl"] == pytest.approx(-sum(math.log(r) for r in ratios) / 3, rel=1e-5)
    assert metrics["actor/pg_clipfrac_lower"] == 0.0
    (grad,) = torch.autograd.grad(loss, log_prob)
    # The weight is a constant (stop-gradient): every token keeps a gradient, even clipped ones.
    close(grad, [[-1.2 / 3, -0.8 / 3, 1.0 / 3]])


def test_policy_loss_unknown_mode():
    old, log_prob, adv, mask = pg_inputs()
    with pytest.raises(ValueError, match="'vanila'") as info:
        policy_loss("vanila", old, log_prob, adv, mask)
    assert str(info.value).split("nearest first):")[1].strip().startswith("vanilla")
    assert set(POLICY_LOSS_MODES) == {"vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov",
                                      "geo_mean", "dro", "cispo"}
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss("gspo", old, log_prob, adv, mask, loss_agg_mode="seq-mean")


def test_policy_losses_do_not_mutate_inputs():
    old, log_prob, adv, mask = pg_inputs()
    snapshot = [x.detach().clone() for x in (old, log_prob, adv, mask)]
    for mode in POLICY_LOSS_MODES:
        loss, _ = policy_loss(mode, old, log_prob, adv, mask, dro_beta=0.5, generator=0)
        loss.backward()
    for before, after in zip(snapshot, (old, log_prob, adv, mask)):
        assert torch.equal(before, after.detach())


# ---------------------------------------------------------------------------------------------
# Value loss
# ---------------------------------------------------------------------------------------------


def test_value_loss_hand_values():
    vpreds = T([[1.0, 0.2, -1.0, 1.0, 50.0]])
    values = T([[0.0, 0.0, 0.0, 0.0, 0.0]])
    returns = T([[2.0, 0.0, -2.0, 0.0, -50.0]])
    mask = T([[1, 1, 1, 1, 0]])
    vf_loss, vf_clipfrac = value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    # clipped preds 0.5, 0.2, -0.5, 0.5: errors max((v-R)^2, (vclip-R)^2) = 2.25, 0.04, 2.25, 1.0
    close(vf_loss, 0.5 * (2.25 + 0.04 + 2.25 + 1.0) / 4)
    close(vf_clipfrac, 2 / 4)
    vf_seq, _ = value_loss(vpreds, returns, values, mask, cliprange_value=0.5, loss_agg_mode="seq-mean-token-sum")
    close(vf_seq, 0.5 * (2.25 + 0.04 + 2.25 + 1.0))


# ---------------------------------------------------------------------------------------------
# Property tests
# ---------------------------------------------------------------------------------------------

PROPERTY_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def grouped_scores(draw):
    group_sizes = draw(st.lists(st.integers(2, 5), min_size=1, max_size=4))
    scores, index = [], []
    for g, n in enumerate(group_sizes):
        scores += draw(st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=n, max_size=n))
        index += [f"group-{g}"] * n
    lengths = draw(st.lists(st.integers(1, 4), min_size=len(scores), max_size=len(scores)))
    return scores, index, lengths


@PROPERTY_SETTINGS
@given(grouped_scores(), st.sampled_from(["grpo", "rloo"]))
def test_group_advantages_sum_to_zero(data, estimator):
    scores, index, lengths = data
    rewards, mask = outcome_rewards(scores, lengths, 4)
    adv, _ = advantage(estimator, rewards, mask, index=index, norm_adv_by_std=False)
    per_seq = adv[:, 0]
    # Centring <= 5 float32 scores and summing the results: within ~3 gamma(6) * 5 max|score| ~ 5e-6 max|score|.
    for g in set(index):
        members = [i for i, key in enumerate(index) if key == g]
        assert abs(per_seq[members].sum().item()) <= 1e-4 * max(1.0, max(abs(scores[i]) for i in members))


@st.composite
def policy_batch(draw):
    bs = draw(st.integers(1, 4))
    length = draw(st.integers(1, 5))
    mask = torch.tensor(draw(st.lists(st.lists(st.integers(0, 1), min_size=length, max_size=length),
                                      min_size=bs, max_size=bs)), dtype=F)
    mask[0, 0] = 1  # at least one valid token, so every aggregation is finite
    seed = draw(st.integers(0, 2**31 - 1))
    return mask, seed


@PROPERTY_SETTINGS
@given(policy_batch(), st.sampled_from(POLICY_LOSS_MODES), st.sampled_from(AGG_MODES))
def test_masked_positions_do_not_affect_loss_or_grads(batch, mode, agg_mode):
    mask, seed = batch
    gen = torch.Generator().manual_seed(seed)
    shape = mask.shape
    old = torch.randn(shape, generator=gen) - 1
    new = old + 0.3 * torch.randn(shape, generator=gen)
    adv = torch.randn(shape, generator=gen)
    junk = lambda x: torch.where(mask.bool(), x, 7.0 * torch.randn(shape, generator=gen) - 3)  # noqa: E731

    def run(o, n, a):
        n = n.clone().requires_grad_()
        loss, metrics = policy_loss(mode, o, n, a, mask, loss_agg_mode=agg_mode, clip_ratio_high=0.28,
                                    dro_beta=0.5, generator=seed)
        (grad,) = torch.autograd.grad(loss, n)
        return loss.detach(), grad, metrics

    loss1, grad1, metrics1 = run(old, new, adv)
    loss2, grad2, metrics2 = run(junk(old), junk(new), junk(adv))
    close(loss1, loss2, atol=1e-5)
    close(grad1, grad2, atol=1e-6)
    assert torch.all(grad1[~mask.bool()] == 0)
    for key in metrics1:
        assert float(metrics1[key]) == pytest.approx(float(metrics2[key]), abs=1e-5)


@PROPERTY_SETTINGS
@given(policy_batch(), st.sampled_from(AGG_MODES), st.floats(0.05, 0.3))
def test_vanilla_without_clipping_is_minus_advantage_times_ratio(batch, agg_mode, eps):
    mask, seed = batch
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(mask.shape, generator=gen) - 1
    # log-ratios strictly inside [log(1-eps), log(1+eps)]: neither the clip nor the dual clip acts
    u = torch.rand(mask.shape, generator=gen)
    lo, hi = math.log(1 - eps) * 0.99, math.log(1 + eps) * 0.99
    new = old + lo + (hi - lo) * u
    adv = torch.randn(mask.shape, generator=gen)
    loss, metrics = policy_loss("vanilla", old, new, adv, mask, loss_agg_mode=agg_mode, clip_ratio=eps)
    per_token = (-adv * torch.exp(new - old)).tolist()
    m = mask.tolist()
    rows = [[x for x, k in zip(r, mr) if k] for r, mr in zip(per_token, m)]

    def aggregate(rows):
        non_empty = [r for r in rows if r]
        if agg_mode == "token-mean":
            return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
        if agg_mode == "token-sum":
            return sum(sum(r) for r in rows)
        if agg_mode == "seq-mean-token-mean":
            return sum(sum(r) / len(r) for r in non_empty) / len(non_empty)
        value = sum(sum(r) for r in non_empty) / len(non_empty)
        return value / mask.shape[-1] if agg_mode == "seq-mean-token-sum-norm" else value

    expected = aggregate(rows)  # exact (float64) aggregation of the float32 per-token terms
    # The loss aggregates the same float32 terms (n <= 20 of them) in float32: within
    # gamma(n + 4) * (the same aggregation of |terms|) of the exact value (tests/numerics.py), the +4
    # for the divisions and the per-token products.
    n = sum(len(r) for r in rows)
    bound = gamma(n + 4) * aggregate([[abs(x) for x in r] for r in rows])
    assert abs(float(loss) - expected) <= bound, (float(loss), expected, bound)
    assert metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["actor/pg_clipfrac_lower"] == 0.0


@PROPERTY_SETTINGS
@given(policy_batch(), st.sampled_from(["vanilla", "gspo", "cispo"]), st.floats(0.0, 3.0))
def test_clip_fractions_are_fractions(batch, mode, spread):
    mask, seed = batch
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(mask.shape, generator=gen)
    new = old + spread * torch.randn(mask.shape, generator=gen)
    adv = torch.randn(mask.shape, generator=gen)
    _, metrics = policy_loss(mode, old, new, adv, mask)
    for key in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower"):
        assert 0.0 <= metrics[key] <= 1.0
    _, vf_clipfrac = value_loss(new, adv, old, mask, cliprange_value=0.2)
    assert 0.0 <= float(vf_clipfrac) <= 1.0


# ---------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU): same numbers as on CPU.
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    rewards, mask = outcome_rewards(SCORES, LENGTHS, L)
    values, baselines = torch.randn(6, L), torch.rand(6)
    index = ["a", "a", "b", "b", "c", "c"]
    old_logprobs, sum_pi_squared = -torch.rand(6, L), torch.rand(6, L)
    for name in ESTIMATORS:
        cpu = advantage(name, rewards, mask, index=index, values=values, reward_baselines=baselines,
                        old_logprobs=old_logprobs, sum_pi_squared=sum_pi_squared)
        gpu = advantage(name, rewards.cuda(), mask.cuda(), index=index, values=values.cuda(),
                        reward_baselines=baselines.cuda(), old_logprobs=old_logprobs.cuda(),
                        sum_pi_squared=sum_pi_squared.cuda())
        close(gpu[0].cpu(), cpu[0], atol=1e-5)
        close(gpu[1].cpu(), cpu[1], atol=1e-5)
    old, log_prob, adv, pmask = pg_inputs()
    for mode in POLICY_LOSS_MODES:
        for agg_mode in AGG_MODES:
            cpu_loss, cpu_metrics = policy_loss(mode, old, log_prob, adv, pmask, loss_agg_mode=agg_mode,
                                                dro_beta=0.5, generator=0)
            gpu_loss, gpu_metrics = policy_loss(mode, old.cuda(), log_prob.detach().cuda(), adv.cuda(), pmask.cuda(),
                                                loss_agg_mode=agg_mode, dro_beta=0.5, generator=0)
            close(gpu_loss.cpu(), cpu_loss.detach(), atol=1e-5)
            assert gpu_metrics.keys() == cpu_metrics.keys()
    for kind in KL_KINDS:
        close(kl_penalty(LOGP.cuda(), REF.cuda(), kind).cpu(), kl_penalty(LOGP, REF, kind))


def test_group_filter_keeps_groups_with_spread_and_singletons():
    from kfrl.algos.shaping import kept_groups

    values = np.array([1, 1, 0, 1, 0, 0, 1, 1])
    assert kept_groups(values, 2) == [1]
    assert kept_groups(np.array([1.0, 1.0]), 1) == [0, 1]


def test_explained_variance_matches_verl_formula():
    from kfrl.algos.shaping import explained_variance

    returns = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 9.0]])
    values = torch.tensor([[1.5, 2.0, 0.0], [2.0, 4.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    r = torch.tensor([1.0, 2.0, 3.0, 4.0])
    v = torch.tensor([1.5, 2.0, 2.0, 4.5])
    assert explained_variance(returns, values, mask) == pytest.approx(float(1 - (r - v).var() / (r.var() + 1e-5)))


def test_outcome_rewards_put_the_score_on_the_last_response_token():
    from kfrl.algos.shaping import outcome_rewards

    rewards = outcome_rewards([1.0, 0.5, 2.0], [3, 1, 0], 4)
    assert rewards.tolist() == [[0, 0, 1.0, 0], [0.5, 0, 0, 0], [2.0, 0, 0, 0]]


def test_actor_loss_composes_policy_entropy_and_kl_terms():
    from kfrl.algos import actor_loss

    torch.manual_seed(0)
    log_prob, old, ref, adv, ent = (torch.randn(3, 5) for _ in range(5))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    knobs = dict(loss_mode="vanilla", loss_agg_mode="token-mean", clip_ratio=0.2, clip_ratio_c=3.0)
    pg, pg_stats = policy_loss("vanilla", old, log_prob, adv, mask, loss_agg_mode="token-mean", clip_ratio=0.2,
                               clip_ratio_c=3.0)
    loss, stats = actor_loss(log_prob, old, adv, mask, entropy=ent, entropy_coeff=0.01, ref_log_prob=ref,
                             kl_loss_type="low_var_kl", kl_loss_coef=0.1, **knobs)
    kl = agg_loss(kl_penalty(log_prob, ref, "low_var_kl"), mask, "token-mean")
    assert torch.allclose(loss, pg - 0.01 * agg_loss(ent, mask, "token-mean") + 0.1 * kl)
    assert stats["actor/pg_loss"] == pytest.approx(float(pg)) and stats["actor/kl_loss"] == pytest.approx(float(kl))
    assert stats["actor/kl_coef"] == 0.1 and {k: stats[k] for k in pg_stats} == pg_stats
    assert stats["actor/entropy"] == pytest.approx(float((ent * mask).sum() / mask.sum()))
    plain, plain_stats = actor_loss(log_prob, old, adv, mask, **knobs)
    assert torch.allclose(plain, pg) and "actor/kl_loss" not in plain_stats and "actor/entropy" not in plain_stats
