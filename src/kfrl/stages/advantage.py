"""Stage ``advantage`` (veRL's driver step ``adv``): token-level scores (the outcome score at the last
response token), the KL penalty in the reward when configured, then the advantage estimator (gdpo
reads its reward dimensions from the score group's ``reward_extra``; optimal_token_baseline reads
``old_logprobs`` and ``sum_pi_squared`` from the old_logprob group).

The adaptive KL controller's coefficient is state that outlives an iteration: each advantage
commit records the coefficient for the next iteration, so a retried or resumed iteration uses the
same value it would have used the first time.
"""
from __future__ import annotations

from kfrl.stages.context import StageContext

KL_COEF_INFO = "kl_ctrl_value_next"


def kl_controller(ctx: StageContext):
    """The KL controller as it stands before this iteration (the previous commit's coefficient)."""
    from kfrl.algos import get_kl_controller

    ctrl_cfg = ctx.config.algorithm.kl_ctrl
    controller = get_kl_controller(ctrl_cfg.type, kl_coef=ctrl_cfg.kl_coef, target_kl=ctrl_cfg.target_kl,
                                   horizon=ctrl_cfg.horizon)
    if ctx.iteration > 1:
        previous = ctx.manifest("advantage", ctx.iteration - 1)
        if KL_COEF_INFO in previous.info:
            controller.value = float(previous.info[KL_COEF_INFO])
    return controller


def reward_dimensions(table, keys: list[str]):
    """gdpo's (bs, K) reward dimensions: for each of ``keys`` (algorithm.gdpo_reward_keys) the value the
    reward function returned under that key (the score group's ``reward_extra``); ``score`` and ``acc``
    fall back to the score group's columns of that name, as in veRL's non_tensor_batch."""
    import json
    import math

    import torch

    extras = [json.loads(extra) if extra else {} for extra in table.column("reward_extra").to_pylist()]
    columns = {name: table.column(name).to_pylist() for name in ("score", "acc")}
    sample_ids = table.column("sample_id").to_pylist()
    rows = []
    for i, extra in enumerate(extras):
        row = []
        for key in keys:
            if key in extra:
                value = extra[key]
            elif key in columns:
                value = columns[key][i]
            else:
                returned = sorted(extra)
                why = (f"it returned the keys {returned}" if returned else
                       "it returned a single number, not a dict; gdpo needs a dict with one entry per reward "
                       "dimension (e.g. {'score': ..., 'format_reward': ..., 'accuracy_reward': ...})")
                raise RuntimeError(f"algorithm.gdpo_reward_keys names {key!r}, but the reward function gave no "
                                   f"{key!r} for sample {sample_ids[i]!r}: {why}")
            if isinstance(value, bool) or (isinstance(value, (int, float)) and math.isfinite(value)):
                row.append(float(value))
            else:
                raise RuntimeError(f"algorithm.gdpo_reward_keys: the reward function's {key!r} for sample "
                                   f"{sample_ids[i]!r} is {value!r}; a reward dimension must be a finite number")
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32).reshape(len(rows), len(keys))


def advantage(ctx: StageContext, table, attempt) -> tuple[dict, dict[str, float]]:
    import torch

    from kfrl.algos import advantage as compute_advantage
    from kfrl.algos.shaping import explained_variance, kl_in_reward, masked_stats, outcome_rewards
    from kfrl.trajectory import Trajectories

    cfg = ctx.config
    algo = cfg.algorithm
    names = set(table.column_names)
    batch = Trajectories.from_table(table, pad_id=0,
                                    fields=("old_logprobs", "ref_logprobs", "values", "sum_pi_squared"))
    mask = batch.response_mask
    scores = outcome_rewards(table.column("score").to_pylist(), batch.lengths, mask.shape[1])
    metrics: dict[str, float] = {}

    rewards = scores
    if algo.use_kl_in_reward:
        controller = kl_controller(ctx)
        rewards, kl_metrics = kl_in_reward(scores, batch.get("old_logprobs"), batch.get("ref_logprobs"), mask,
                                           controller, algo.kl_penalty)
        metrics.update(kl_metrics)
        attempt.info[KL_COEF_INFO] = float(controller.value)

    values = batch.get("values")
    baselines = (torch.tensor(table.column("reward_baselines").to_pylist(), dtype=torch.float32)
                 if "reward_baselines" in names else None)
    if algo.adv_estimator == "gae" and values is None:
        raise RuntimeError("adv_estimator=gae needs the values stage's output; is the critic enabled?")
    if algo.adv_estimator == "remax" and baselines is None:
        raise RuntimeError("adv_estimator=remax needs the gen_max stage's greedy baselines")
    if algo.needs_sum_pi_squared and (batch.get("sum_pi_squared") is None or batch.get("old_logprobs") is None):
        raise RuntimeError(f"adv_estimator={algo.adv_estimator} needs the old_logprob stage's old_logprobs and "
                           "sum_pi_squared; was this iteration's old_logprob committed under another config?")
    dimensions = None
    if algo.adv_estimator == "gdpo":
        dimensions = reward_dimensions(table, list(algo.gdpo_reward_keys))
        for k, key in enumerate(algo.gdpo_reward_keys):
            metrics.update({f"gdpo/{key}/mean": float(dimensions[:, k].mean()),
                            f"gdpo/{key}/std": float(dimensions[:, k].std(unbiased=False)),
                            f"gdpo/{key}/max": float(dimensions[:, k].max()),
                            f"gdpo/{key}/min": float(dimensions[:, k].min())})
    advantages, returns = compute_advantage(
        algo.adv_estimator, rewards, mask, index=table.column("uid").to_pylist(), values=values,
        reward_baselines=baselines, gamma=algo.gamma, lam=algo.lam, norm_adv_by_std=algo.norm_adv_by_std_in_grpo,
        reward_dimensions=dimensions, reward_weights=algo.gdpo_reward_weights,
        old_logprobs=batch.get("old_logprobs"), sum_pi_squared=batch.get("sum_pi_squared"),
    )
    columns = {"sample_id": table.column("sample_id").to_pylist(), "token_level_rewards": batch.unpad_vectors(rewards),
               "advantages": batch.unpad_vectors(advantages), "returns": batch.unpad_vectors(returns)}
    sequence_rewards = rewards.sum(-1)
    metrics.update({"critic/rewards/mean": float(sequence_rewards.mean()),
                    "critic/rewards/max": float(sequence_rewards.max()),
                    "critic/rewards/min": float(sequence_rewards.min())})
    metrics.update(masked_stats(advantages, mask, "critic/advantages"))
    metrics.update(masked_stats(returns, mask, "critic/returns"))
    if values is not None:
        metrics.update(masked_stats(values, mask, "critic/values"))
        explained = explained_variance(returns, values, mask)
        if explained is not None:
            metrics["critic/vf_explained_var"] = explained
    return columns, metrics
