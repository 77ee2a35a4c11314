"""From responses to per-trajectory rewards: veRL's reward managers (``naive`` and DAPO's).

``Rewards`` is the run's reward, built once from the config: the rollout (DAPO's dynamic-sampling
filter, ReMax's greedy baseline), score and validate stages all score through it, so they can never
disagree on a reward.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


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


RewardFn = Callable[[str, str, str, Optional[dict]], Any]


class RewardError(ValueError):
    """A reward function failed or returned something unusable; names the function and the sample."""


def reward_function_name(reward_fn: RewardFn, data_source: str) -> str:
    """Who produced a score, for error messages: the user's function, or the registry's scorer."""
    described = getattr(reward_fn, "description", None)
    if described:
        return described
    from kfrl.rewards.registry import scorer_name

    return scorer_name(data_source)


def _parse_result(result: Any) -> tuple[float, dict, float]:
    """(score, extra keys, acc) of a normalised reward result."""
    if isinstance(result, dict):
        value = float(result["score"])
        extras = {k: v for k, v in result.items() if k != "score"}
        return value, extras, float(extras.get("acc", value))
    return float(result), {}, float(result)


def rule_reward_fn(custom_function_path: str = "", custom_function_name: str = "compute_score") -> RewardFn:
    """``fn(data_source, solution_str, ground_truth, extra_info)``: the registry by data_source, or a
    user's function (veRL's custom_reward_function), called with veRL's keyword signature."""
    from kfrl.rewards import compute_score, load_custom_reward, normalize_score

    if not custom_function_path:
        return compute_score
    custom = load_custom_reward(custom_function_path, custom_function_name)

    def call(data_source: str, solution_str: str, ground_truth: str, extra_info: Optional[dict]) -> Any:
        return normalize_score(custom(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                                      extra_info=extra_info))
    call.description = f"{custom_function_name} in {custom_function_path} (reward.custom_function_path)"
    return call


def score_responses(texts: list[str], data_sources: list[str], ground_truths: list[str],
                    extra_infos: list[str | dict | None], response_lengths: list[int], *,
                    max_response_length: int, overlong_buffer=None, reward_fn: RewardFn | None = None,
                    raw_prompts: list[str | list] | None = None,
                    model_scores: list[float] | None = None, sample_ids: list | None = None,
                    num_turns: list[int] | None = None, model_name: str = "the reward model") -> list[ScoredResponse]:
    """Score each decoded response: with ``model_scores`` (a reward model's) when given, else with
    ``reward_fn`` (default: the scorer registered for its data_source). ``raw_prompts`` (chat
    messages) reach the reward function as ``extra_info["raw_prompt"]``; in multi-turn runs each
    conversation's turn count reaches it as ``extra_info["num_turns"]``, as veRL's reward managers pass it.

    A reward function that raises or returns anything but a finite number (or a dict whose "score"
    is one) stops scoring with a RewardError naming the function, the sample and the value: a NaN
    reward would otherwise turn every loss after it into NaN."""
    from kfrl.rewards import compute_score

    reward_fn = reward_fn or compute_score
    shaping = overlong_buffer if overlong_buffer is not None and overlong_buffer.enable else None
    out: list[ScoredResponse] = []
    for i, (text, source, truth, extra, length) in enumerate(
            zip(texts, data_sources, ground_truths, extra_infos, response_lengths)):
        info = json.loads(extra) if isinstance(extra, str) and extra else (extra or None)
        if raw_prompts is not None:
            messages = raw_prompts[i]
            info = {**(info or {}), "raw_prompt": json.loads(messages) if isinstance(messages, str) else messages}
        if num_turns is not None:
            info = {**(info or {}), "num_turns": num_turns[i]}
        sample = f"sample {sample_ids[i]!r}" if sample_ids is not None else f"response {i}"
        who = model_name if model_scores is not None else reward_function_name(reward_fn, source)
        try:
            result = model_scores[i] if model_scores is not None else reward_fn(source, text, truth, info)
            value, extras, acc = _parse_result(result)
        except Exception as err:
            raise RewardError(f"{who} failed on {sample} (data_source {source!r}): {type(err).__name__}: {err}") from err
        if not (math.isfinite(value) and math.isfinite(acc)):
            raise RewardError(f"{who} returned a non-finite reward for {sample} (data_source {source!r}): "
                              f"score={value}, acc={acc}; rewards must be finite numbers")
        shaped = value
        if shaping is not None:
            penalty = overlong_penalty(length, max_response_length, shaping.len, shaping.penalty_factor)
            if shaping.log:
                extras["overlong_reward"] = penalty
                extras["overlong"] = penalty < 0
            shaped += penalty
        out.append(ScoredResponse(score=shaped, raw_score=value, acc=acc, extra=extras))
    return out


class Rewards:
    """The configured reward: rule scorers by data_source or a custom function, or a reward model
    (``reward_model``: (model, tokenizer)); then DAPO's overlong shaping. ``tokenizer`` decodes the
    policy's responses."""

    def __init__(self, config, tokenizer, *, reward_model=None, autocast_dtype=None):
        self.reward = config.reward
        self.max_response_length = config.data.max_response_length
        self.pass_raw_prompt = config.data.return_raw_chat
        self.tokenizer = tokenizer
        self.reward_model = reward_model
        self.autocast_dtype = autocast_dtype
        self.reward_fn = rule_reward_fn(config.reward.custom_function_path, config.reward.custom_function_name)

    def score(self, response_ids: list[list[int]], data_sources: list[str], ground_truths: list[str],
              extra_infos: list, raw_prompts: list[str], sample_ids: list | None = None,
              num_turns: list[int] | None = None) -> list[ScoredResponse]:
        """One ScoredResponse per response; ``raw_prompts`` are the prompts' chat messages as JSON;
        ``sample_ids`` name the samples in errors; ``num_turns``: each conversation's, multi-turn runs."""
        from kfrl.models.hf_io import decode_batch

        texts = decode_batch(self.tokenizer, response_ids, skip_special_tokens=True)
        model_scores = None
        if self.reward_model is not None:
            from kfrl.engines.reward_model import reward_model_scores

            model, rm_tokenizer = self.reward_model
            conversations = [json.loads(p) + [{"role": "assistant", "content": t}] for p, t in zip(raw_prompts, texts)]
            model_scores = reward_model_scores(model, rm_tokenizer, conversations,
                                               micro_batch_size=self.reward.micro_batch_size,
                                               autocast_dtype=self.autocast_dtype)
        return score_responses(
            texts, data_sources, ground_truths, extra_infos, [len(r) for r in response_ids],
            max_response_length=self.max_response_length, overlong_buffer=self.reward.overlong_buffer,
            reward_fn=self.reward_fn, raw_prompts=raw_prompts if self.pass_raw_prompt else None,
            model_scores=model_scores, sample_ids=sample_ids, num_turns=num_turns, model_name=f"reward model {self.reward.model_path}")
