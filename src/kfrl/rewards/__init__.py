"""Rule rewards (GSM8K, MATH boxed answers) and the reward registry keyed by each row's data_source."""
from kfrl.rewards import gsm8k, math
from kfrl.rewards.registry import (
    UnknownDataSourceError,
    compute_score,
    get_scorer,
    load_custom_reward,
    normalize_score,
    register,
    registered_data_sources,
)

__all__ = [
    "compute_score",
    "register",
    "get_scorer",
    "load_custom_reward",
    "UnknownDataSourceError",
    "normalize_score",
    "registered_data_sources",
    "gsm8k",
    "math",
]
