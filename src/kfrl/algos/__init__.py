"""Pure torch RL math with veRL v0.7.1 semantics: advantage estimators, policy/value losses,
loss aggregation, KL estimators and controllers, masked statistics."""
from kfrl.algos.advantages import ESTIMATORS, advantage
from kfrl.algos.core import (
    AGG_MODES,
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    UnsupportedKLKindError,
    agg_loss,
    entropy_from_logits,
    get_kl_controller,
    kl_penalty,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from kfrl.algos.losses import POLICY_LOSS_MODES, actor_loss, policy_loss, value_loss

__all__ = [
    "advantage",
    "actor_loss",
    "policy_loss",
    "value_loss",
    "agg_loss",
    "kl_penalty",
    "entropy_from_logits",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "AdaptiveKLController",
    "FixedKLController",
    "get_kl_controller",
    "UnsupportedKLKindError",
    "ESTIMATORS",
    "POLICY_LOSS_MODES",
    "AGG_MODES",
    "KL_KINDS",
]
