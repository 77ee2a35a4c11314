"""Stage ``score``: each trajectory's reward, written as the score column group.

``score_rows`` is the one way kfrl turns responses into rewards (rule functions by data_source, a
custom function, or a reward model; then DAPO's overlong shaping); the score stage, DAPO's
dynamic-sampling filter, ReMax's greedy baseline and validation all call it.
"""
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


def score_rows(ctx: StageContext, tokenizer, response_ids: list[list[int]], data_sources: list[str],
               ground_truths: list[str], extra_infos: list, raw_prompts: list[str]):
    """ScoredResponse per response (see kfrl.rewards.manager)."""
    from kfrl.rewards.manager import rule_reward_fn, score_responses

    cfg = ctx.config
    texts = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    model_scores = None
    if cfg.reward.name == "model":
        from kfrl.engines.reward_model import reward_model_scores

        model, rm_tokenizer = ctx.load_reward_model()
        conversations = [json.loads(p) + [{"role": "assistant", "content": t}] for p, t in zip(raw_prompts, texts)]
        model_scores = reward_model_scores(model, rm_tokenizer, conversations,
                                           micro_batch_size=cfg.reward.micro_batch_size,
                                           autocast_dtype=ctx.compute_dtype)
    return score_responses(
        texts, data_sources, ground_truths, extra_infos, [len(r) for r in response_ids],
        max_response_length=cfg.data.max_response_length, overlong_buffer=cfg.reward.overlong_buffer,
        reward_fn=rule_reward_fn(cfg.reward.custom_function_path, cfg.reward.custom_function_name),
        raw_prompts=raw_prompts if cfg.data.return_raw_chat else None, model_scores=model_scores)


def score(ctx: StageContext, table, attempt) -> tuple[dict, dict[str, float]]:
    tokenizer = ctx.load_tokenizer(ctx.policy_manifest(ctx.iteration - 1))
    scored = score_rows(ctx, tokenizer, table.column("response_ids").to_pylist(),
                        table.column("data_source").to_pylist(), table.column("ground_truth").to_pylist(),
                        table.column("extra_info").to_pylist(), table.column("raw_prompt").to_pylist())
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
