"""Error models for tests that compare two computations of the same numbers, stated once.

Two evaluations of one expression that take different kernel paths (another batch composition or
padding, chunking, a prefill instead of a decode step, another thread count, a CPU whose torch picks
other SIMD kernels) round differently. A test that compares them either computes in float64, where
the point is the algorithm and not the kernel, or takes its tolerance from the bounds below, never
from the last green run:

* Summation (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.1/§4.2): a sum of
  n terms computed in any order is within gamma(n) * sum|terms| of the exact sum, with
  gamma(n) = n*u / (1 - n*u) and u the unit roundoff (2^-24 float32, 2^-53 float64). Two orders
  differ by at most twice that. A dot product, a matrix product's element and a gradient element
  summed over positions are such sums.
* Log-probs in float32 from the same float32 scores x (V of them): ``log_softmax(x)[t]`` and
  ``x[t] - logsumexp(x)`` each subtract the max (exact: Sterbenz), sum V exponentials (relative error
  <= gamma(V + 1), each exp carrying ~1 ulp), take a log (absolute error ~ that relative error) and
  subtract, which rounds at u * (|x[t]| + |lse|). So two routines differ by at most
  2 * (gamma(V + 2) + 4 u (max|x| + |lse|)): ``logprob_tolerance``.
* Greedy decoding: two paths whose logits differ by at most delta choose the same token wherever the
  top-2 margin exceeds 2 delta. Where it does not (a near-tie), either token is right and the two
  continuations legitimately part: ``assert_greedy_agree`` checks equality up to such a tie.
* Sampling: the total-variation distance between n i.i.d. draws' empirical distribution and the
  true p has E[TV] <= 1/2 sum_i sqrt(p_i (1 - p_i) / n) (Jensen), and TV changes by at most 1/n per
  draw, so P(TV > E[TV] + t) <= exp(-2 n t^2) (McDiarmid): ``tv_acceptance``.
"""
from __future__ import annotations

import math

import torch

U32 = 2.0 ** -24  # float32 unit roundoff
U64 = 2.0 ** -53  # float64 unit roundoff


def gamma(n: int, u: float = U32) -> float:
    """Higham's gamma_n: the relative error bound of an n-term floating-point sum."""
    return n * u / (1.0 - n * u)


def float64_sum_tolerance(n_terms: int) -> float:
    """Two float64 summation orders of at most ``n_terms`` terms differ by at most this times
    sum|terms|; used as both atol (terms summing to ~1 or less) and rtol."""
    return 2.0 * gamma(n_terms, U64)


def ulp32(magnitude: float) -> float:
    """The spacing of float32 numbers at ``magnitude`` (at least that of 1.0 * 2^-23 scaled)."""
    return float(torch.finfo(torch.float32).eps) * 2.0 ** math.floor(math.log2(max(magnitude, 2.0 ** -126)))


def logprob_tolerance(max_abs_score: float, vocab: int) -> float:
    """How far two float32 log-prob routines may part on the same float32 scores (module docstring);
    the scores themselves may also round differently by one ulp (a float64 logit cast to float32 on
    either side of a rounding boundary), which adds 2 u max|x|."""
    lse = max_abs_score + math.log(vocab)
    return 2.0 * (gamma(vocab + 2) + 4.0 * U32 * (max_abs_score + lse)) + 2.0 * U32 * max_abs_score


def tv_acceptance(expected: torch.Tensor, n: int, failure: float = 1e-6) -> float:
    """A bound the empirical distribution of ``n`` draws from ``expected`` stays within, in total
    variation, except with probability ``failure`` (module docstring)."""
    p = expected.double().flatten()
    mean_bound = 0.5 * float(torch.sqrt(p * (1 - p) / n).sum())
    return mean_bound + math.sqrt(math.log(1.0 / failure) / (2.0 * n))


def top2_margins(logits: torch.Tensor) -> torch.Tensor:
    """top-1 minus top-2 logit along the last axis (float64)."""
    top = logits.double().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


@torch.no_grad()
def teacher_forced_margins(model, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
    """For each (prompt, response), the top-2 margin of the logits that predict each response token,
    from one unpadded forward pass per sequence."""
    out = []
    for prompt, response in zip(prompts, responses):
        if not response:
            out.append([])
            continue
        ids = torch.tensor([prompt + response], device=next(model.parameters()).device)
        logits = model(ids).logits[0, len(prompt) - 1:len(prompt) - 1 + len(response)]
        out.append(top2_margins(logits).tolist())
    return out


def assert_greedy_agree(ours: list[list[int]], reference: list[list[int]], margins: list[list[float]],
                        tie: float, *, min_compared: float = 0.9) -> list[int]:
    """Greedy token sequences of two computations of one model: equal up to the first position where
    the reference's top-2 margin is <= ``tie`` (where rounding may pick either token); after such a
    near-tie a pair is no longer compared. Fails on any difference at a clear margin, and when less
    than ``min_compared`` of the reference's tokens could be compared (so ties cannot hide a bug).
    Returns, per sequence, how many leading tokens were compared (and are equal)."""
    assert len(ours) == len(reference) == len(margins)
    compared = []
    for row, (a, b, m) in enumerate(zip(ours, reference, margins)):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        if k < max(len(a), len(b)):  # they part at k (a token differs, or one ended)
            assert k < len(b) and m[k] <= tie, (
                f"sequence {row} parts from the reference at token {k} although the reference's top-2 "
                f"margin there is {m[k] if k < len(m) else 'n/a'} > {tie} (not a near-tie): ours {a}, reference {b}")
        compared.append(k)
    total = sum(len(b) for b in reference)
    assert sum(compared) >= min_compared * total, (sum(compared), total)
    return compared
