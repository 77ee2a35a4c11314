"""From decoded responses to per-trajectory rewards: veRL's reward managers (``naive`` and DAPO's).

``score_responses`` is what the score stage, DAPO's dynamic-sampling filter and ReMax's greedy
baseline all call, so the three can never disagree on a reward.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ScoredResponse:
    score: float             # the reward placed at the last response token (after overlong shaping)
    raw_score: float         # the scorer's own value, before shaping
    acc: float               # correctness (the scorer's "acc", else its score), DAPO's filter metric
    extra: dict[str, Any] = field(default_factory=dict)  # the scorer's other keys (+ overlong_* when logged)


def overlong_penalty(response_length: int, max_response_length: int, buffer_len: int, penalty_factor: float) -> float:
    """DAPO's overlong reward shaping: 0 up to ``max - buffer_len`` tokens, then linear down to
    ``-penalty_factor`` at ``max_response_length`` (and below, for longer responses)."""
    expected = max_response_length - buffer_len
    exceed = response_length - expected
    return min(-exceed / buffer_len * penalty_factor, 0.0)


def score_responses(texts: list[str], data_sources: list[str], ground_truths: list[str],
                    extra_infos: list[str | dict | None], response_lengths: list[int], *,
                    max_response_length: int, overlong_buffer=None) -> list[ScoredResponse]:
    """Score each decoded response with the scorer registered for its data_source."""
    from kfrl.rewards import compute_score

    shaping = overlong_buffer if overlong_buffer is not None and overlong_buffer.enable else None
    out: list[ScoredResponse] = []
    for text, source, truth, extra, length in zip(texts, data_sources, ground_truths, extra_infos, response_lengths):
        info = json.loads(extra) if isinstance(extra, str) and extra else (extra or None)
        result = compute_score(source, text, truth, extra_info=info)
        if isinstance(result, dict):
            value = float(result["score"])
            extras = {k: v for k, v in result.items() if k != "score"}
            acc = float(extras.get("acc", value))
        else:
            value, extras, acc = float(result), {}, float(result)
        shaped = value
        if shaping is not None:
            penalty = overlong_penalty(length, max_response_length, shaping.len, shaping.penalty_factor)
            if shaping.log:
                extras["overlong_reward"] = penalty
                extras["overlong"] = penalty < 0
            shaped += penalty
        out.append(ScoredResponse(score=shaped, raw_score=value, acc=acc, extra=extras))
    return out
