"""Policy losses veRL added after 0.7.1 (0.9.1 semantics, one process), token-sum aggregation and
GSPO's loss_agg_mode. Expected numbers are derived by hand / numpy from the formulas, not from veRL."""
import copy
import math

import numpy as np
import pytest
import torch

from kfrl.algos import AGG_MODES, POLICY_LOSS_MODES, actor_loss, agg_loss, policy_loss
from kfrl.config import ActorConfig, ConfigError, load_config

F = torch.float32
T = lambda x: torch.tensor(x, dtype=F)  # noqa: E731

# float32 results against exact values (close()), and end-to-end runs of the builtin model: also run under make test-portability.
pytestmark = pytest.mark.numerics


def close(actual, expected, atol=1e-6, rtol=1e-5):
    """A float32 result against its exact (hand / numpy float64) value; the error model of
    test_algos.close: inputs of at most ~20 elements, float32 within gamma(20) ~ 1.2e-6 of exact
    relative to the sum of |terms|, a few |expected| here (rtol), below ~0.5 where a result is ~0 (atol)."""
    torch.testing.assert_close(torch.as_tensor(actual, dtype=F), torch.as_tensor(expected, dtype=F),
                               atol=atol, rtol=rtol)


def grad_of(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


# ---------------------------------------------------------------------------------------------
# token-sum and GSPO's aggregation
# ---------------------------------------------------------------------------------------------


def test_token_sum_aggregation():
    assert "token-sum" in AGG_MODES
    loss_mat = T([[1.0, 2.0, 30.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = T([[1, 1, 0], [0, 1, 1], [0, 0, 0]])
    close(agg_loss(loss_mat, mask, "token-sum"), 1 + 2 + 5 + 6)
    # One process: the global-batch overrides do not rescale a plain sum (veRL: dp_size = 1).
    close(agg_loss(loss_mat, mask, "token-sum", batch_num_tokens=100, global_batch_size=7), 14.0)
    # A NaN in a hole does not leak.
    holed = loss_mat.clone()
    holed[2, 0] = float("nan")
    close(agg_loss(holed, mask, "token-sum"), 14.0)
    # Through a policy loss: gpg with token-sum has gradient -A on every valid token.
    log_prob = T([[-1.0, -2.0], [-0.5, -3.0]]).requires_grad_()
    adv = T([[1.0, 2.0], [-2.0, 5.0]])
    m = T([[1, 1], [1, 0]])
    loss, _ = policy_loss("gpg", torch.zeros(2, 2), log_prob, adv, m, loss_agg_mode="token-sum")
    close(loss, 1.0 * 1 + 2.0 * 2 + -2.0 * 0.5)
    close(grad_of(loss, log_prob), [[-1.0, -2.0], [2.0, 0.0]])


def test_gspo_honours_loss_agg_mode():
    # Sequence 1: 3 tokens, s = exp(mean(0.3, 0.3, 0.3)) = e^0.3 = 1.35 > 1.2: clipped (A > 0).
    # Sequence 2: 1 token (and a hole), s = e^-0.1, inside [0.8, 1.2], A = -2.
    old = torch.zeros(2, 3)
    log_prob = T([[0.3, 0.3, 0.3], [-0.1, 9.0, 9.0]]).requires_grad_()
    adv = T([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    mask = T([[1, 1, 1], [1, 0, 0]])
    s2 = math.exp(-0.1)
    per_token_1, per_token_2 = -1.0 * 1.2, 2.0 * s2
    expected = {
        "token-mean": (3 * per_token_1 + per_token_2) / 4,
        "token-sum": 3 * per_token_1 + per_token_2,
        "seq-mean-token-mean": (per_token_1 + per_token_2) / 2,
        "seq-mean-token-sum": (3 * per_token_1 + per_token_2) / 2,
    }
    for agg, value in expected.items():
        loss, metrics = policy_loss("gspo", old, log_prob, adv, mask, loss_agg_mode=agg)
        close(loss, value)
        assert metrics["actor/pg_clipfrac"] == pytest.approx(3 / 4)
    # Gradient of the unclipped token: d(-A s)/dlog pi = -A s = 2 s2; token-mean divides by 4 tokens.
    loss, _ = policy_loss("gspo", old, log_prob, adv, mask, loss_agg_mode="token-mean")
    close(grad_of(loss, log_prob), [[0.0, 0.0, 0.0], [2 * s2 / 4, 0.0, 0.0]])
    loss, _ = policy_loss("gspo", old, log_prob, adv, mask, loss_agg_mode="seq-mean-token-mean")
    close(grad_of(loss, log_prob), [[0.0, 0.0, 0.0], [2 * s2 / 2, 0.0, 0.0]])


# ---------------------------------------------------------------------------------------------
# DPPO
# ---------------------------------------------------------------------------------------------


def _dppo_inputs():
    # (p_old, p, A) per token; the last column of row 1 is a hole with junk.
    p_old = [[0.5, 0.5, 0.5, 0.5], [0.01, 0.5, 0.5, 0.3]]
    p = [[0.8, 0.6, 0.2, 0.45], [0.05, 0.1, 0.9, 0.99]]
    adv = [[1.0, 1.0, -1.0, -1.0], [2.0, 1.0, -1.0, 50.0]]
    mask = [[1, 1, 1, 1], [1, 1, 1, 0]]
    return p_old, p, adv, mask


def _dppo_expected(keep, p_old, p, adv, mask, c=3.0):
    p_old, p, adv, mask = (np.array(x, dtype=np.float64) for x in (p_old, p, adv, mask))
    ratio = p / p_old
    truncated = np.minimum(ratio, c)
    per_token = -adv * truncated * np.log(p) * keep * mask
    n = mask.sum()
    loss = per_token.sum() / n
    grad = -adv * truncated * keep * mask / n
    clipfrac = ((1 - keep) * mask).sum() / n
    clipfrac_lower = ((ratio > c) * keep * mask).sum() / n
    ppo_kl = (-(np.log(p) - np.log(p_old)) * mask).sum() / n
    return loss, grad, clipfrac, clipfrac_lower, ppo_kl


def test_dppo_tv():
    p_old, p, adv, mask = _dppo_inputs()
    # p - p_old: [[.3, .1, -.3, -.05], [.04, -.4, .4, hole]]; eps = 0.2.
    # A > 0 keeps diff <= 0.2; A <= 0 keeps diff >= -0.2.
    keep = np.array([[0, 1, 0, 1], [1, 1, 1, 0]], dtype=np.float64)
    old_lp, lp = torch.log(T(p_old)), torch.log(T(p)).requires_grad_()
    loss, metrics = policy_loss("dppo_tv", old_lp, lp, T(adv), T(mask), clip_ratio=0.2)
    e_loss, e_grad, e_clip, e_lower, e_kl = _dppo_expected(keep, p_old, p, adv, mask)
    close(loss, e_loss)
    close(grad_of(loss, lp), e_grad)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(e_clip)  # 2 of 7 outside
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(e_lower)  # r = 5 > c = 3, kept
    assert e_lower == pytest.approx(1 / 7)
    assert metrics["actor/ppo_kl"] == pytest.approx(e_kl, rel=1e-5)
    # Asymmetric thresholds: clip_ratio_high = 0.35 also keeps the first token.
    keep_hi = keep.copy()
    keep_hi[0, 0] = 1
    loss, _ = policy_loss("dppo_tv", old_lp, lp, T(adv), T(mask), clip_ratio=0.2, clip_ratio_high=0.35)
    close(loss, _dppo_expected(keep_hi, p_old, p, adv, mask)[0])
    # clip_ratio_c is the truncation of the ratio here.
    loss, metrics = policy_loss("dppo_tv", old_lp, lp, T(adv), T(mask), clip_ratio=0.2, clip_ratio_c=10.0)
    close(loss, _dppo_expected(keep, p_old, p, adv, mask, c=10.0)[0])
    assert metrics["actor/pg_clipfrac_lower"] == 0.0


def test_dppo_kl():
    p_old, p, adv, mask = _dppo_inputs()
    # A token that only the (1 - p_old) term pushes out of the region (A > 0, p 0.1 -> 0.25):
    # D = 0.1 ln(0.1/0.25) + 0.9 ln(0.9/0.75) = -0.0916 + 0.1641 = 0.0725 > 0.05.
    p_old[0][1], p[0][1] = 0.1, 0.25
    po, pn = np.array(p_old), np.array(p)
    divergence = po * np.log(po / pn) + (1 - po) * np.log((1 - po + 1e-8) / (1 - pn + 1e-8))
    eps = 0.05
    a = np.array(adv)
    keep = np.where(a > 0, (divergence <= eps) | (pn <= po), (divergence <= eps) | (pn >= po)).astype(np.float64)
    # The cases the test is about: a large move in the advantage's direction is cut, the opposite move
    # is free whatever its size.
    assert divergence[0, 0] > eps and keep[0, 0] == 0  # A > 0, p up 0.5 -> 0.8
    assert divergence[1, 1] > eps and keep[1, 1] == 1  # A > 0, p down 0.5 -> 0.1: free
    assert divergence[0, 2] > eps and keep[0, 2] == 0  # A < 0, p down 0.5 -> 0.2
    assert divergence[1, 2] > eps and keep[1, 2] == 1  # A < 0, p up 0.5 -> 0.9: free
    assert divergence[0, 1] == pytest.approx(0.1 * math.log(0.4) + 0.9 * math.log(0.9 / 0.75)) and keep[0, 1] == 0
    assert divergence[0, 3] <= eps and keep[0, 3] == 1  # A < 0, p 0.5 -> 0.45: a small step is kept
    old_lp, lp = torch.log(T(p_old)), torch.log(T(p)).requires_grad_()
    loss, metrics = policy_loss("dppo_kl", old_lp, lp, T(adv), T(mask), clip_ratio=eps)
    e_loss, e_grad, e_clip, e_lower, _ = _dppo_expected(keep * np.array(mask), p_old, p, adv, mask)
    close(loss, e_loss)
    close(grad_of(loss, lp), e_grad)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(e_clip)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(e_lower)


# ---------------------------------------------------------------------------------------------
# SAPO
# ---------------------------------------------------------------------------------------------


def test_sapo_gate_values_and_gradients():
    ratios = [[1.0, 1.5, 0.5], [2.0, 1.0, 3.0]]
    adv = [[1.0, 1.0, -1.0], [-2.0, 0.0, 9.0]]
    mask = [[1, 1, 1], [1, 1, 0]]
    old = T([[-1.0, -2.0, -0.5], [-1.5, -0.7, -0.2]])
    log_prob = (old + torch.log(T(ratios))).requires_grad_()
    tau_pos, tau_neg = 1.0, 3.0

    def tau(a):
        return tau_pos if a > 0 else tau_neg

    def gate(r, t):
        return sigmoid(t * (r - 1)) * 4 / t

    def dgate_dlogp(r, t):  # d f(r) / d log pi = f'(r) * r = 4 s (1 - s) r
        s = sigmoid(t * (r - 1))
        return 4 * s * (1 - s) * r

    rows_loss, grads = [], [[0.0] * 3 for _ in range(2)]
    for i in range(2):
        valid = [j for j in range(3) if mask[i][j]]
        rows_loss.append(sum(-adv[i][j] * gate(ratios[i][j], tau(adv[i][j])) for j in valid) / len(valid))
        for j in valid:
            grads[i][j] = -adv[i][j] * dgate_dlogp(ratios[i][j], tau(adv[i][j])) / len(valid) / 2
    for agg in ("token-mean", "seq-mean-token-sum"):  # ignored: always seq-mean-token-mean
        loss, metrics = policy_loss("sapo", old, log_prob, T(adv), T(mask), loss_agg_mode=agg,
                                    tau_pos=tau_pos, tau_neg=tau_neg)
        close(loss, sum(rows_loss) / 2)
        close(grad_of(loss, log_prob), grads)
    assert metrics["actor/pg_clipfrac"] == 0.0 and metrics["actor/pg_clipfrac_lower"] == 0.0
    # On-policy the gate's slope is 1: the gradient is the plain policy gradient -A / n.
    assert grads[0][0] == pytest.approx(-1.0 / 3 / 2)
    # Far off-policy the gradient fades (r = 3 with A > 0 would be a hard zero under PPO; here small).
    assert abs(grads[1][0]) < 2 * 1 / 2 / 2  # A = -2, r = 2, tau_neg = 3: damped below the PG's 0.5
    # veRL's defaults: tau_pos = 1.0, tau_neg = 1.05.
    loss, _ = policy_loss("sapo", old, log_prob, T(adv), T(mask))
    tau_pos, tau_neg = 1.0, 1.05
    expected = sum(sum(-adv[i][j] * gate(ratios[i][j], tau(adv[i][j])) for j in range(3) if mask[i][j])
                   / sum(mask[i]) for i in range(2)) / 2
    close(loss, expected)


# ---------------------------------------------------------------------------------------------
# Clip-Cov
# ---------------------------------------------------------------------------------------------


def _clip_cov_case():
    # On-policy except token (0, 4): r = 1.5 with A > 0 is clipped by PPO and so never a candidate.
    adv = T([[2.0, -2.0, 2.0, -2.0, 2.0, 5.0], [2.0, -2.0, 0.0, 0.0, 0.0, 0.0]])
    log_prob = T([[-0.1, -3.0, -0.1, -3.0, -0.1, -0.1], [-0.2, -2.9, -1.0, -1.0, -1.0, -1.0]])
    old = log_prob.clone()
    old[0, 4] = -0.1 - math.log(1.5)
    mask = T([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    return old, log_prob, adv, mask


def _ppo_clipped(old, log_prob, adv, eps=0.2):
    r = torch.exp(log_prob - old)
    return -adv * torch.clamp(r, 1 - eps, 1 + eps) > -adv * r


def _cov_zeroed(grad, old, log_prob, adv, mask):
    """Tokens whose gradient the covariance clip removed: valid, A != 0, not clipped by PPO, no gradient."""
    return (grad == 0) & (mask > 0) & (adv != 0) & ~_ppo_clipped(old, log_prob, adv)


def _clip_cov_candidates(old, log_prob, adv, mask, lb, ub, eps=0.2):
    a, lp, o, m = (x.double().numpy() for x in (adv, log_prob, old, mask))
    mean_a = (a * m).sum() / m.sum()
    mean_lp = (lp * m).sum() / m.sum()
    cov = (a - mean_a) * (lp - mean_lp)
    r = np.exp(lp - o)
    ppo_clipped = -a * np.clip(r, 1 - eps, 1 + eps) > -a * r
    return (m > 0) & ~ppo_clipped & (cov > lb) & (cov < ub), cov


def test_clip_cov_clips_random_candidates_reproducibly():
    old, log_prob, adv, mask = _clip_cov_case()
    lb, ub = 1.0, 5.0
    candidates, cov = _clip_cov_candidates(old, log_prob, adv, mask, lb, ub)
    assert cov[0, 4] > lb and not candidates[0, 4]  # large covariance but PPO-clipped
    assert cov[0, 5] > lb and not candidates[0, 5]  # a hole
    n_candidates = int(candidates.sum())
    assert n_candidates >= 5
    ratio = 0.3  # int(0.3 * 11 valid tokens) = 3 tokens clipped
    n_clip = 3

    def run(generator):
        lp = log_prob.clone().requires_grad_()
        loss, metrics = policy_loss("clip_cov", old, lp, adv, mask, clip_cov_ratio=ratio, clip_cov_lb=lb,
                                    clip_cov_ub=ub, generator=generator)
        return loss.detach(), grad_of(loss, lp), metrics

    ppo_per_token = torch.maximum(-adv * torch.exp(log_prob - old),
                                  -adv * torch.clamp(torch.exp(log_prob - old), 0.8, 1.2))
    patterns = set()
    for seed in range(8):
        loss, grad, metrics = run(torch.Generator().manual_seed(seed))
        # The zeroed tokens are the valid non-zero-advantage tokens without gradient.
        zeroed = _cov_zeroed(grad, old, log_prob, adv, mask)
        assert int(zeroed.sum()) == n_clip
        assert bool(torch.all(torch.from_numpy(candidates)[zeroed]))
        keep = (~zeroed).float()
        close(loss, (ppo_per_token * keep * mask).sum() / mask.sum())
        assert metrics == {"actor/pg_clipfrac": pytest.approx(n_clip / 11),
                           "actor/ppo_kl": pytest.approx(-math.log(1.5) / 11, rel=1e-5)}
        again, grad_again, _ = run(torch.Generator().manual_seed(seed))  # a retried stage
        assert torch.equal(loss, again) and torch.equal(grad, grad_again)
        same_int_seed, _, _ = run(seed)  # an int is a seed
        assert torch.equal(loss, same_int_seed)
        patterns.add(tuple(zeroed.flatten().tolist()))
    assert len(patterns) > 1  # other seeds pick other tokens


def test_clip_cov_with_fewer_candidates_than_clips_is_deterministic():
    old, log_prob, adv, mask = _clip_cov_case()
    # A narrow band: only the 3 tokens with 3 < cov < 4 are candidates; 9 would be clipped.
    candidates, _ = _clip_cov_candidates(old, log_prob, adv, mask, 3.0, 4.0)
    assert candidates.sum() == 3
    losses = set()
    for seed in range(4):
        lp = log_prob.clone().requires_grad_()
        loss, metrics = policy_loss("clip_cov", old, lp, adv, mask, clip_cov_ratio=0.9, clip_cov_lb=3.0,
                                    clip_cov_ub=4.0, generator=seed)
        grad = grad_of(loss, lp)
        assert torch.equal(_cov_zeroed(grad, old, log_prob, adv, mask), torch.from_numpy(candidates))
        losses.add(float(loss.detach()))
        assert metrics["actor/pg_clipfrac"] == pytest.approx(candidates.sum() / 11)
    assert len(losses) == 1


def test_clip_cov_with_all_equal_advantages_is_ppo_clip():
    old, log_prob, _, mask = _clip_cov_case()
    adv = torch.full_like(old, 0.5)  # zero covariance: no candidate within (1, 5)
    loss, metrics = policy_loss("clip_cov", old, log_prob, adv, mask)
    ratio = torch.exp(log_prob - old)
    expected = (torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2)) * mask).sum() / mask.sum()
    close(loss, expected)
    assert metrics["actor/pg_clipfrac"] == 0.0
    with pytest.raises(ValueError, match="clip_cov_ratio"):
        policy_loss("clip_cov", old, log_prob, adv, mask, clip_cov_ratio=0.0)


# ---------------------------------------------------------------------------------------------
# KL-Cov
# ---------------------------------------------------------------------------------------------


def test_kl_cov_penalises_top_covariance_tokens():
    adv = T([[1.0, -1.0, 2.0, 0.5, 7.0], [-2.0, 1.0, 0.0, 3.0, 7.0]])
    log_prob = T([[-0.5, -2.0, -0.2, -1.0, -0.1], [-0.3, -1.5, -0.8, -0.4, -0.1]])
    old = log_prob - T([[0.1, -0.2, 0.3, 0.05, 0.4], [-0.1, 0.2, 0.0, -0.3, 0.0]])
    mask = T([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0]])
    coef, kl_ratio = 0.7, 0.3  # int(8 valid * 0.3) = 2 tokens penalised

    a, lp, o, m = (x.double().numpy() for x in (adv, log_prob, old, mask))
    valid = m > 0
    cov = np.full(a.shape, -np.inf)
    cov[valid] = (a[valid] - a[valid].mean()) * (lp[valid] - lp[valid].mean())
    top = np.zeros_like(valid)
    top.flat[np.argsort(-cov, axis=None)[:2]] = True
    log_ratio = lp - o
    per_token = -a * np.exp(log_ratio) + coef * np.abs(log_ratio) * top
    n = m.sum()

    lp_t = log_prob.clone().requires_grad_()
    loss, metrics = policy_loss("kl_cov", old, lp_t, adv, mask, kl_cov_ratio=kl_ratio, ppo_kl_coef=coef)
    close(loss, (per_token * m).sum() / n)
    expected_grad = (-a * np.exp(log_ratio) + coef * np.sign(log_ratio) * top) * m / n
    close(grad_of(loss, lp_t), expected_grad)
    # ppo_kl is the mean |log-ratio| in this mode; no clip fractions.
    assert metrics == {"actor/ppo_kl": pytest.approx((np.abs(log_ratio) * m).sum() / n, rel=1e-5)}
    # veRL's default ppo_kl_coef is 0.1 (ActorConfig.policy_loss.ppo_kl_coef).
    loss_default, _ = policy_loss("kl_cov", old, log_prob, adv, mask, kl_cov_ratio=kl_ratio)
    per_token_default = -a * np.exp(log_ratio) + 0.1 * np.abs(log_ratio) * top
    close(loss_default, (per_token_default * m).sum() / n)
    # With the default ratio at least one token is penalised.
    loss_min, _ = policy_loss("kl_cov", old, log_prob, adv, mask, ppo_kl_coef=coef)
    one = np.zeros_like(valid)
    one.flat[np.argmax(cov)] = True
    close(loss_min, ((-a * np.exp(log_ratio) + coef * np.abs(log_ratio) * one) * m).sum() / n)


def test_kl_cov_all_equal_advantages_on_policy_is_minus_advantage():
    log_prob = T([[-0.5, -2.0, -0.2], [-0.3, -1.5, -0.8]])
    adv = torch.full_like(log_prob, 0.75)
    loss, metrics = policy_loss("kl_cov", log_prob, log_prob, adv, torch.ones(2, 3), kl_cov_ratio=0.5)
    close(loss, -0.75)
    assert metrics["actor/ppo_kl"] == 0.0


# ---------------------------------------------------------------------------------------------
# GMPO (geo_mean)
# ---------------------------------------------------------------------------------------------


def test_geo_mean():
    # Row 0: A = +1, log-ratios [0.5, -0.5, 0.1]: clip to [-0.2, 0.2] only where it lowers the
    #   objective's ratio for A > 0: 0.5 -> 0.2 (upper clip acts), -0.5 stays (min picks it), 0.1 stays.
    # Row 1: A = -1, log-ratios [0.5, -0.5, hole]: 0.5 stays, -0.5 -> -0.2.
    # Row 2: empty, counts in the mean with loss 0.
    log_ratio = T([[0.5, -0.5, 0.1], [0.5, -0.5, 4.0], [0.3, 0.3, 0.3]])
    adv = T([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0], [5.0, 5.0, 5.0]])
    mask = T([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    old = T([[-1.0, -2.0, -0.5], [-0.7, -1.2, -3.0], [-1.0, -1.0, -1.0]])
    log_prob = (old + log_ratio).requires_grad_()
    r0 = math.exp((0.2 - 0.5 + 0.1) / 3)
    r1 = math.exp((0.5 - 0.2) / 2)
    expected = (-1.0 * r0 + 1.0 * r1 + 0.0) / 3
    for agg in ("token-mean", "seq-mean-token-sum"):  # ignored
        loss, metrics = policy_loss("geo_mean", old, log_prob, adv, mask, loss_agg_mode=agg, clip_ratio=0.2)
        close(loss, expected)
    # Gradient: only unclipped tokens move the geometric mean; d r_i / d log pi_t = r_i / n_i.
    close(grad_of(loss, log_prob), [[0.0, -r0 / 3 / 3, -r0 / 3 / 3], [r1 / 2 / 3, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # Outside [-0.2, 0.2]: (0,0), (0,1) with A > 0; (1,0), (1,1) with A < 0; of 5 valid tokens.
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 5)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(2 / 5)
    assert metrics["actor/ppo_kl"] == pytest.approx(-(0.5 - 0.5 + 0.1 + 0.5 - 0.5) / 5, abs=1e-6)
    # Rollout IS weights enter as their per-sequence geometric mean.
    w = T([[1.0, 4.0, 2.0], [0.5, 2.0, 100.0], [3.0, 3.0, 3.0]])
    loss_w, _ = policy_loss("geo_mean", old, log_prob, adv, mask, clip_ratio=0.2, rollout_is_weights=w)
    close(loss_w, (-r0 * 8 ** (1 / 3) + r1 * 1.0) / 3, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# DRO
# ---------------------------------------------------------------------------------------------


def test_dro_value_and_quadratic_penalty_gradient():
    old = T([[-1.0, -2.0, -0.5], [-0.7, -1.2, -3.0]])
    log_ratio = T([[0.4, -0.3, 0.0], [1.0, -2.0, 7.0]])
    log_prob = (old + log_ratio).requires_grad_()
    adv = T([[1.0, -1.0, 2.0], [0.5, 0.5, 9.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    beta = 0.8
    lp, lr, a, m = (x.detach().double().numpy() for x in (log_prob, log_ratio, adv, mask))
    per_token = -(lp * a - 0.5 * beta * lr ** 2)
    loss, metrics = policy_loss("dro", old, log_prob, adv, mask, dro_beta=beta)
    close(loss, (per_token * m).sum() / 5)
    # d/dlog pi: -A + beta * (log pi - log pi_old): the penalty pulls back towards the old policy.
    close(grad_of(loss, log_prob), (-a + beta * lr) * m / 5)
    assert metrics == {"actor/ppo_kl": pytest.approx(-(lr * m).sum() / 5, rel=1e-5)}
    loss_sum, _ = policy_loss("dro", old, log_prob, adv, mask, dro_beta=beta, loss_agg_mode="token-sum")
    close(loss_sum, (per_token * m).sum())


@pytest.mark.parametrize("beta", [None, 0.0, -1.0])
def test_dro_needs_positive_beta(beta):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="dro_beta"):
        policy_loss("dro", x, x, x, torch.ones(1, 2), dro_beta=beta)


def test_dro_config_needs_positive_beta():
    for overrides in (["actor.loss_mode=dro"], ["actor.loss_mode=dro", "actor.dro_beta=0"]):
        with pytest.raises(ConfigError, match=r"actor\.dro_beta"):
            load_config(None, overrides)
    cfg = load_config(None, ["actor.loss_mode=dro", "actor.dro_beta=0.05"])
    assert cfg.actor.dro_beta == 0.05
    with pytest.raises(ConfigError, match="dro_beta"):
        load_config(None, ["actor_rollout_ref.actor.policy_loss.loss_mode=dro"])


# ---------------------------------------------------------------------------------------------
# Registry, config, veRL keys, the actor update
# ---------------------------------------------------------------------------------------------


def test_registry_and_unknown_mode():
    assert POLICY_LOSS_MODES == ("vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov",
                                 "geo_mean", "dro", "cispo")
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="Did you mean 'clip_cov'") as info:
        policy_loss("clipcov", x, x, x, torch.ones(1, 2))
    assert str(info.value).split("nearest first):")[1].strip().startswith("clip_cov")
    assert set(ActorConfig.model_fields["loss_mode"].annotation.__args__) == set(POLICY_LOSS_MODES)
    assert set(ActorConfig.model_fields["loss_agg_mode"].annotation.__args__) == set(AGG_MODES)


def test_config_defaults_and_verl_keys():
    cfg = ActorConfig()
    assert (cfg.tau_pos, cfg.tau_neg, cfg.clip_cov_ratio, cfg.clip_cov_lb, cfg.clip_cov_ub, cfg.kl_cov_ratio,
            cfg.ppo_kl_coef, cfg.dro_beta) == (1.0, 1.05, 0.0002, 1.0, 5.0, 0.0002, 0.1, None)
    notices: list[str] = []
    cfg = load_config(None, [
        "actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov", "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.01",
        "actor_rollout_ref.actor.policy_loss.clip_cov_lb=0.5", "actor_rollout_ref.actor.policy_loss.clip_cov_ub=4",
        "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.02", "actor_rollout_ref.actor.policy_loss.ppo_kl_coef=2",
        "actor_rollout_ref.actor.policy_loss.dro_beta=0.3", "actor_rollout_ref.actor.tau_pos=2",
        "actor_rollout_ref.actor.tau_neg=3", "actor_rollout_ref.actor.loss_agg_mode=token-sum"], notices)
    a = cfg.actor
    assert (a.loss_mode, a.clip_cov_ratio, a.clip_cov_lb, a.clip_cov_ub, a.kl_cov_ratio, a.ppo_kl_coef, a.dro_beta,
            a.tau_pos, a.tau_neg, a.loss_agg_mode) == ("clip_cov", 0.01, 0.5, 4.0, 0.02, 2.0, 0.3, 2.0, 3.0, "token-sum")
    assert not [n for n in notices if "no effect" in n]
    load_config(None, ["actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is=token"], notices)
    assert any("rollout correction" in n for n in notices)


def test_actor_loss_forwards_knobs():
    old = T([[-1.0, -2.0]])
    log_prob = T([[-0.5, -2.5]])
    adv = T([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    loss, stats = actor_loss(log_prob, old, adv, mask, loss_mode="dro", dro_beta=0.5)
    expected, _ = policy_loss("dro", old, log_prob, adv, mask, dro_beta=0.5)
    close(loss, expected)
    assert set(stats) == {"actor/pg_loss", "actor/ppo_kl"}
    with pytest.raises(TypeError):
        actor_loss(log_prob, old, adv, mask, loss_mode="dro", dro_bta=0.5)


@pytest.fixture(scope="module")
def tiny():
    from kfrl.data.synthetic import make_arith_rows
    from kfrl.models.tiny import arith_corpus, build_tiny_model, build_tokenizer

    rows = make_arith_rows(16, seed=0, split="train")
    tokenizer = build_tokenizer(arith_corpus(rows))
    model = build_tiny_model(tokenizer, seed=0)
    prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True) for r in rows[:4]]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    return model.eval(), prompts


def test_update_actor_clip_cov_is_reproducible_per_seed(tiny):
    from kfrl.engines.actor import update_actor
    from kfrl.trajectory import Trajectories

    model, prompts = tiny
    data = Trajectories.from_lists(prompts, [[7, 8, 9, 10]] * 4, [[1] * 4] * 4, pad_id=0, fields={
        "advantages": [[a] * 4 for a in (1.0, -1.0, 2.0, -0.5)]})
    # Every token a candidate, half of them clipped at random.
    cfg = ActorConfig(loss_mode="clip_cov", clip_cov_ratio=0.5, clip_cov_lb=-1e9, clip_cov_ub=1e9,
                      ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=4, lr=1e-3)

    def grads(seed):
        m = copy.deepcopy(model)
        captured = {}

        class Capture(torch.optim.SGD):
            def step(self, closure=None):
                captured.update({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})

        update_actor(m, Capture(m.parameters(), lr=0.0), data, cfg, mini_batch_size=4, temperature=1.0, seed=seed)
        return captured

    first, retried, other = grads(11), grads(11), grads(12)
    assert all(torch.equal(first[n], retried[n]) for n in first)
    assert any(not torch.allclose(first[n], other[n]) for n in first)


# --- end to end: each new mode trains the demo model, and its stored metrics are what kfrl.algos gives
# on the stored batch ------------------------------------------------------------------------------

E2E_MODES = {"dppo_tv": [], "dppo_kl": [], "sapo": [], "clip_cov": ["actor.clip_cov_ratio=0.2"],
             "kl_cov": ["actor.kl_cov_ratio=0.2"], "geo_mean": [], "dro": ["actor.dro_beta=0.5"]}


@pytest.mark.parametrize("mode", sorted(E2E_MODES))
def test_each_new_mode_trains_end_to_end_and_its_stored_loss_is_recomputable(tmp_path, mode):
    from pathlib import Path

    from kfrl.algos import policy_loss as recompute
    from kfrl.config import load_config
    from kfrl.driver.controller import train
    from kfrl.engines.actor import LOSS_GENERATOR_SEED_OFFSET
    from kfrl.run import Run
    from kfrl.stages.context import StageContext
    from kfrl.trajectory import Trajectories

    # lr 1e-30 (below every weight's ulp: nothing moves) and two mini-batches: the old-logprob pass
    # runs, and in micro-batches of the update's 8 rows (the same rows, same shapes: the same float32
    # computation) so every micro-batch's log-probs equal the stored old ones and the update's loss can
    # be recomputed from the stored batch alone, with the same inputs to the same function: abs 1e-5 is
    # slack for the metrics' float32 means, not for differing log-probs.
    config = load_config(Path("configs/demo.yaml"), [
        "data.train_batch_size=4", "rollout.n=4", "data.max_response_length=16", "actor.ppo_mini_batch_size=2",
        "rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor.ppo_micro_batch_size_per_gpu=8", "actor.shuffle=false", "actor.lr=1e-30", "trainer.log_generations=0",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "pipeline.runner=inline",
        f"actor.loss_mode={mode}", f"store.uri={tmp_path / 'store'}", f"tracking.uri=sqlite:///{tmp_path}/m.db",
        *E2E_MODES[mode]])
    summary = train(config, run_id=mode, iterations=2)
    ctx = StageContext.open(summary.run_uri, 2)
    stored = Run.at(summary.run_uri).manifest("update_actor", 2).metrics
    table = ctx.read_groups("rollout", "advantage", "old_logprob")
    batch = Trajectories.from_table(table, pad_id=0, fields=("advantages", "old_logprobs"))
    actor = config.actor
    generator = torch.Generator().manual_seed((ctx.seed("update_actor") + LOSS_GENERATOR_SEED_OFFSET) % 2**63)
    losses, metrics = [], {}
    for start in range(0, len(batch), 8):  # the two mini-batches, one micro-batch each, in order
        part = batch.select(slice(start, start + 8))
        old = part.get("old_logprobs")
        loss, stats = recompute(mode, old, old.clone(), part.get("advantages"), part.response_mask,
                                loss_agg_mode=actor.loss_agg_mode, clip_ratio=actor.clip_ratio,
                                clip_ratio_low=actor.clip_ratio_low, clip_ratio_high=actor.clip_ratio_high,
                                clip_ratio_c=actor.clip_ratio_c, tau_pos=actor.tau_pos, tau_neg=actor.tau_neg,
                                clip_cov_ratio=actor.clip_cov_ratio, clip_cov_lb=actor.clip_cov_lb,
                                clip_cov_ub=actor.clip_cov_ub, kl_cov_ratio=actor.kl_cov_ratio,
                                ppo_kl_coef=actor.ppo_kl_coef, dro_beta=actor.dro_beta, generator=generator)
        losses.append(float(loss))
        for key, value in stats.items():
            metrics.setdefault(key, []).append(float(value))
    assert stored["actor/pg_loss"] == pytest.approx(sum(losses) / len(losses), abs=1e-5)
    for key, values in metrics.items():
        assert stored[key] == pytest.approx(sum(values) / len(values), abs=1e-5), key
    assert any(abs(v) > 0 for v in losses) or mode in ("clip_cov",)  # the batch carried a learning signal
