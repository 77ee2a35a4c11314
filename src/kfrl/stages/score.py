"""Stage ``score``: each trajectory's reward (``ctx.rewards``, the run's one reward), written as the
score column group."""
from __future__ import annotations

import json

import numpy as np

from kfrl.stages.context import StageContext


def extra_metrics(extras: list[dict], prefix: str = "reward_extra") -> dict[str, float]:
    """Means of the numeric extra keys a scorer returned (``reward_extra/<key>/mean``)."""
    sums: dict[str, list[float]] = {}
    for extra in extras:
        for key, value in extra.items():
            if isinstance(value, (bool, int, float)):
                sums.setdefault(key, []).append(float(value))
    return {f"{prefix}/{key}/mean": float(np.mean(values)) for key, values in sums.items()}


def score(ctx: StageContext, table, attempt) -> tuple[dict, dict[str, float]]:
    tokenizer = ctx.load_tokenizer(ctx.policy_manifest(ctx.iteration - 1))
    scored = ctx.rewards(tokenizer).score(
        table.column("response_ids").to_pylist(), table.column("data_source").to_pylist(),
        table.column("ground_truth").to_pylist(), table.column("extra_info").to_pylist(),
        table.column("raw_prompt").to_pylist(), sample_ids=table.column("sample_id").to_pylist(),
        num_turns=table.column("num_turns").to_pylist() if "num_turns" in table.column_names else None)
    columns = {"sample_id": table.column("sample_id").to_pylist(), "score": [s.score for s in scored],
               "acc": [s.acc for s in scored], "reward_extra": [json.dumps(s.extra, default=str) for s in scored]}
    scores = np.array([s.score for s in scored], dtype=np.float64)
    metrics = {
        "critic/score/mean": float(scores.mean()),
        "critic/score/max": float(scores.max()),
        "critic/score/min": float(scores.min()),
        "critic/acc/mean": float(np.mean([s.acc for s in scored])),
    }
    metrics.update(extra_metrics([s.extra for s in scored]))
    return columns, metrics
