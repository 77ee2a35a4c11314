"""Shared building blocks of the RL math: masked statistics, loss aggregation, KL estimators,
entropy and the KL-coefficient controllers.

Everything here is a pure torch function over tensors of shape (batch, response_length) that
never mutates its inputs. Numbers match veRL v0.7.1 (`verl/utils/torch_functional.py` and
`verl/trainer/ppo/core_algos.py`), including its quirks, which are called out where they occur.
"""
from __future__ import annotations

import difflib
from collections.abc import Sequence

import torch

# ---------------------------------------------------------------------------------------------
# Names accepted by the string-dispatched functions.
# ---------------------------------------------------------------------------------------------

AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

# Aliases are listed as veRL accepts them: "kl" == "k1", "mse" == "k2", "low_var_kl" == "k3".
KL_KINDS: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")

# veRL v0.7.1 names these but cannot compute them (it raises NotImplementedError):
# "full" needs whole-vocabulary logits, and the "+" (straight-through k2 gradient) suffix is never
# stripped before dispatch in 0.7.1 (fixed in v0.9.0).
_KL_KINDS_VERL_CANNOT_COMPUTE = ("full",)

# Stability clamps used by veRL's k3 ("low_var_kl") estimator.
K3_LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0

# Added to denominators by veRL's masked_mean / seq-mean-token-mean / masked_whiten.
MASKED_MEAN_EPS = 1e-8
WHITEN_EPS = 1e-8


class UnsupportedKLKindError(NotImplementedError, ValueError):
    """A KL kind that veRL v0.7.1 names but does not compute ("full", "k3+", ...).

    A NotImplementedError like veRL's, and a ValueError like every other bad-name error here.
    """


def resolve_choice(name: object, valid: Sequence[str], what: str) -> str:
    """Return `name` if it is one of `valid`; otherwise raise a ValueError that names it and lists
    the valid choices, nearest match first (difflib), so a typo in a config is easy to fix."""
    # Enum members (e.g. veRL's AdvantageEstimator, a str-Enum) dispatch by their value.
    value = getattr(name, "value", name)
    if isinstance(value, str) and value in valid:
        return value
    ranked = difflib.get_close_matches(str(value), list(valid), n=len(valid), cutoff=0.0)
    ranked += [v for v in valid if v not in ranked]
    close = difflib.get_close_matches(str(value), list(valid), n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"Unknown {what} {value!r}.{hint} Valid {what}s (nearest first): {', '.join(ranked)}")


# ---------------------------------------------------------------------------------------------
# Masked statistics (veRL's torch_functional semantics).
# ---------------------------------------------------------------------------------------------


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is non-zero (weighted by `mask`).

    Values outside the mask are replaced by 0 *before* multiplying, so a NaN/inf at a padded
    position cannot leak into the sum (0 * nan would be nan) nor into the gradient.
    """
    valid_values = torch.where(mask.bool(), values, torch.zeros_like(values))
    weighted = valid_values * mask
    return weighted.sum() if axis is None else weighted.sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean over the masked elements; the 1e-8 keeps an all-zero mask at 0 instead of NaN."""
    token_count = mask.sum() if axis is None else mask.sum(dim=axis)
    return masked_sum(values, mask, axis) / (token_count + MASKED_MEAN_EPS)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the masked elements of the whole tensor (Bessel-corrected if `unbiased`)."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        token_count = mask.sum()
        # The N/(N-1) correction is undefined for N <= 1; veRL raises rather than return inf/NaN.
        if token_count == 0:
            raise ValueError("masked_var: the mask selects no element; at least two are needed.")
        if token_count == 1:
            raise ValueError("masked_var: the mask selects one element; the unbiased variance needs two.")
        variance = variance * (token_count / (token_count - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / std with mean and (unbiased) variance over the masked elements of the
    whole batch.

    Like veRL, the transform is applied to *every* element: masked-out positions come back
    shifted and scaled, not zeroed. Callers that need zeros there multiply by the mask.
    """
    mean = masked_mean(values, mask)
    variance = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(variance + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last axis: H = logsumexp(z) - sum(softmax(z) * z).

    This form needs no log(p), so it stays finite when some probabilities underflow to 0.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


# ---------------------------------------------------------------------------------------------
# Loss aggregation.
# ---------------------------------------------------------------------------------------------


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_batch_size: int | float | torch.Tensor | None = None,
    batch_num_tokens: int | float | torch.Tensor | None = None,
    loss_scale_factor: int | float | None = None,
) -> torch.Tensor:
    """Reduce a (bs, L) per-token loss to a scalar, veRL's `agg_loss` with dp_size = 1.

    - "token-mean": sum over valid tokens / number of valid tokens (every token weighs the same).
    - "token-sum": sum over valid tokens, not normalised (veRL >= 0.9; with dp_size = 1 its
      dp_size factor is 1, and batch_num_tokens / global_batch_size do not apply).
    - "seq-mean-token-sum": per-sequence token sums, averaged over non-empty sequences.
    - "seq-mean-token-mean": per-sequence token means, averaged over non-empty sequences
      (every sequence weighs the same, whatever its length).
    - "seq-mean-token-sum-norm": seq-mean-token-sum / loss_scale_factor (default: the padded
      response length L), Dr.GRPO's length-unbiased constant normaliser.

    `batch_num_tokens` / `global_batch_size` replace the local token / sequence counts when a
    micro-batch must be normalised by its whole mini-batch (veRL's new engine path); None keeps
    the local count (veRL's legacy FSDP worker path).
    """
    mode = resolve_choice(mode, AGG_MODES, "loss aggregation mode")

    if mode == "token-mean":
        denominator = mask.sum() if batch_num_tokens is None else batch_num_tokens
        return masked_sum(loss_mat, mask) / denominator
    if mode == "token-sum":
        return masked_sum(loss_mat, mask)

    tokens_per_sequence = mask.sum(dim=-1)
    # Sequences with no valid token (e.g. fully masked tool turns) do not count in the mean.
    non_empty_sequence = (tokens_per_sequence > 0).to(loss_mat.dtype)
    if global_batch_size is None:
        global_batch_size = non_empty_sequence.sum()

    if mode == "seq-mean-token-mean":
        sequence_losses = masked_sum(loss_mat, mask, axis=-1) / (tokens_per_sequence + MASKED_MEAN_EPS)
        return masked_sum(sequence_losses, non_empty_sequence) / global_batch_size

    # seq-mean-token-sum and seq-mean-token-sum-norm
    sequence_losses = masked_sum(loss_mat, mask, axis=-1)
    loss = masked_sum(sequence_losses, non_empty_sequence) / global_batch_size
    if mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None:
            loss_scale_factor = mask.shape[-1]
        loss = loss / loss_scale_factor
    return loss


# ---------------------------------------------------------------------------------------------
# KL estimators (http://joschu.net/blog/kl-approx.html), per token.
# ---------------------------------------------------------------------------------------------


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs.

    - "kl"/"k1": log p - log p_ref (unbiased, high variance, can be negative)
    - "abs": |log p - log p_ref|
    - "mse"/"k2": 0.5 * (log p - log p_ref)^2
    - "low_var_kl"/"k3": r - log r - 1 with r = p_ref / p (unbiased, always >= 0); the log-ratio
      is clamped to [-20, 20] and the result to [-10, 10] for stability, as in veRL.
    """
    name = getattr(kind, "value", kind)
    if isinstance(name, str) and (name in _KL_KINDS_VERL_CANNOT_COMPUTE or name.endswith("+")):
        raise UnsupportedKLKindError(
            f"KL kind {name!r} is not supported: veRL v0.7.1 raises NotImplementedError for 'full' "
            f"(needs whole-vocabulary logits) and for '+'-suffixed straight-through kinds. "
            f"Supported kinds: {', '.join(KL_KINDS)}"
        )
    name = resolve_choice(kind, KL_KINDS, "KL kind")

    log_ratio = log_prob - ref_log_prob
    if name in ("kl", "k1"):
        return log_ratio
    if name == "abs":
        return log_ratio.abs()
    if name in ("mse", "k2"):
        return 0.5 * log_ratio.square()
    # k3: with log r = log p_ref - log p, r - log r - 1 >= 0 with equality iff p == p_ref.
    ref_over_policy_log_ratio = torch.clamp(ref_log_prob - log_prob, min=-K3_LOG_RATIO_CLAMP, max=K3_LOG_RATIO_CLAMP)
    k3 = torch.exp(ref_over_policy_log_ratio) - ref_over_policy_log_ratio - 1
    return torch.clamp(k3, min=-K3_VALUE_CLAMP, max=K3_VALUE_CLAMP)


# ---------------------------------------------------------------------------------------------
# KL coefficient controllers (used for the in-reward KL penalty).
# ---------------------------------------------------------------------------------------------


class FixedKLController:
    """A constant KL coefficient; `update` is a no-op."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        del current_kl, n_steps  # a fixed coefficient ignores feedback


class AdaptiveKLController:
    """Proportional controller of Ziegler et al. 2019 (arXiv:1909.08593).

    Nudges the coefficient so the measured KL approaches `target_kl`: the relative error
    current/target - 1 is clipped to +-0.2 and applied at a rate of n_steps / horizon.
    """

    MAX_PROPORTIONAL_ERROR = 0.2

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if not horizon > 0:
            raise ValueError(f"AdaptiveKLController: horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    @property
    def target_kl(self) -> float:
        return self.target

    def update(self, current_kl: float, n_steps: int) -> None:
        error = float(current_kl) / self.target - 1
        error = min(max(error, -self.MAX_PROPORTIONAL_ERROR), self.MAX_PROPORTIONAL_ERROR)
        self.value *= 1 + error * n_steps / self.horizon


KL_CONTROLLER_TYPES: tuple[str, ...] = ("fixed", "adaptive")


def get_kl_controller(
    controller_type: str, *, kl_coef: float, target_kl: float = 0.1, horizon: float = 10000
) -> FixedKLController | AdaptiveKLController:
    """veRL's `algorithm.kl_ctrl` factory: type "fixed" or "adaptive" (defaults as in veRL)."""
    controller_type = resolve_choice(controller_type, KL_CONTROLLER_TYPES, "KL controller type")
    if controller_type == "fixed":
        return FixedKLController(kl_coef)
    return AdaptiveKLController(kl_coef, target_kl, horizon)
