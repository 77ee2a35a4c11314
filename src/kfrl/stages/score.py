"""Stage ``score``: rule rewards by data_source (kfrl.rewards); writes the score column group."""
from __future__ import annotations

import json

import numpy as np

from kfrl.stages.context import StageContext


def score(ctx: StageContext, attempt) -> dict[str, float]:
    from kfrl import batch
    from kfrl.rewards import compute_score

    table = ctx.read_groups("rollout")
    tokenizer = ctx.load_tokenizer(ctx.policy_manifest(ctx.iteration - 1))
    responses = tokenizer.batch_decode(table.column("response_ids").to_pylist(), skip_special_tokens=True)
    columns: dict[str, list] = {"sample_id": [], "score": [], "acc": [], "reward_extra": []}
    for sample_id, text, source, truth, extra in zip(
        table.column("sample_id").to_pylist(), responses, table.column("data_source").to_pylist(),
        table.column("ground_truth").to_pylist(), table.column("extra_info").to_pylist(),
    ):
        result = compute_score(source, text, truth, extra_info=json.loads(extra) if extra else None)
        if isinstance(result, dict):
            value = float(result["score"])
            extra_out = {k: v for k, v in result.items() if k != "score"}
        else:
            value, extra_out = float(result), {}
        columns["sample_id"].append(sample_id)
        columns["score"].append(value)
        columns["acc"].append(float(extra_out.get("acc", value > 0)))
        columns["reward_extra"].append(json.dumps(extra_out, default=str))
    batch.write_group(attempt, "score", batch.make_table("score", columns))
    scores = np.array(columns["score"], dtype=np.float64)
    return {
        "critic/score/mean": float(scores.mean()),
        "critic/score/max": float(scores.max()),
        "critic/score/min": float(scores.min()),
        "critic/acc/mean": float(np.mean(columns["acc"])),
    }
