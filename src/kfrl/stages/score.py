"""Stage ``score``: rule rewards by data_source (kfrl.rewards), with DAPO's overlong shaping when
configured; writes the score column group."""
from __future__ import annotations

import json

import numpy as np

from kfrl.stages.context import StageContext


def extra_metrics(extras: list[dict]) -> dict[str, float]:
    """Means of the numeric extra keys a scorer returned (``reward_extra/<key>/mean``)."""
    sums: dict[str, list[float]] = {}
    for extra in extras:
        for key, value in extra.items():
            if isinstance(value, (bool, int, float)):
                sums.setdefault(key, []).append(float(value))
    return {f"reward_extra/{key}/mean": float(np.mean(values)) for key, values in sums.items()}


def score(ctx: StageContext, attempt) -> dict[str, float]:
    from kfrl import batch
    from kfrl.rewards.manager import score_responses

    cfg = ctx.config
    table = ctx.read_groups("rollout")
    tokenizer = ctx.load_tokenizer(ctx.policy_manifest(ctx.iteration - 1))
    response_ids = table.column("response_ids").to_pylist()
    scored = score_responses(
        tokenizer.batch_decode(response_ids, skip_special_tokens=True), table.column("data_source").to_pylist(),
        table.column("ground_truth").to_pylist(), table.column("extra_info").to_pylist(),
        [len(r) for r in response_ids], max_response_length=cfg.data.max_response_length,
        overlong_buffer=cfg.reward.overlong_buffer)
    batch.write_group(attempt, "score", batch.make_table("score", {
        "sample_id": table.column("sample_id").to_pylist(), "score": [s.score for s in scored],
        "acc": [s.acc for s in scored], "reward_extra": [json.dumps(s.extra, default=str) for s in scored]}))
    scores = np.array([s.score for s in scored], dtype=np.float64)
    metrics = {
        "critic/score/mean": float(scores.mean()),
        "critic/score/max": float(scores.max()),
        "critic/score/min": float(scores.min()),
        "critic/acc/mean": float(np.mean([s.acc for s in scored])),
    }
    metrics.update(extra_metrics([s.extra for s in scored]))
    return metrics
