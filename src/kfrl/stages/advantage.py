"""Stage ``advantage`` (veRL's driver step ``adv``): token-level scores (the outcome score at the last
response token), the KL penalty in the reward when configured, then the advantage estimator.

The adaptive KL controller's coefficient is state that outlives an iteration: each advantage
commit records the coefficient for the next iteration, so a retried or resumed iteration uses the
same value it would have used the first time.
"""
from __future__ import annotations

from kfrl.stages.context import StageContext

KL_COEF_INFO = "kl_ctrl_value_next"


def masked_stats(values, mask, prefix: str) -> dict[str, float]:
    picked = values[mask.bool()]
    if picked.numel() == 0:
        return {}
    return {f"{prefix}/mean": float(picked.mean()), f"{prefix}/max": float(picked.max()),
            f"{prefix}/min": float(picked.min())}


def outcome_rewards(scores, response_lengths, width: int):
    """(bs, width) zeros with each score at its last valid response token (veRL's reward manager)."""
    import torch

    rewards = torch.zeros((len(scores), width), dtype=torch.float32)
    rows = torch.arange(len(scores))
    last = torch.clamp(torch.as_tensor(response_lengths) - 1, min=0)
    rewards[rows, last] = torch.as_tensor(scores, dtype=torch.float32)
    return rewards


def apply_kl_penalty(token_level_scores, old_logprobs, ref_logprobs, mask, controller, kind: str):
    """veRL's ``apply_kl_penalty``: rewards = scores - beta * KL(old || ref) per token; then the
    controller sees the batch's mean per-sequence KL. Returns (rewards, metrics)."""
    from kfrl.algos import kl_penalty, masked_mean

    kld = kl_penalty(old_logprobs, ref_logprobs, kind) * mask
    beta = controller.value
    rewards = token_level_scores - beta * kld
    current_kl = float(masked_mean(kld, mask, axis=-1).mean())
    controller.update(current_kl, n_steps=token_level_scores.shape[0])
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": float(beta)}


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


def explained_variance(returns, values, mask) -> float | None:
    """veRL's critic/vf_explained_var: 1 - Var(R - V) / (Var(R) + 1e-5) over valid tokens (unbiased)."""
    import torch

    valid = mask.bool()
    r, v = returns[valid], values[valid]
    if r.numel() < 2:
        return None
    return float(1.0 - torch.var(r - v) / (torch.var(r) + 1e-5))


def advantage(ctx: StageContext, table, attempt) -> tuple[dict, dict[str, float]]:
    import torch

    from kfrl import batch
    from kfrl.algos import advantage as compute_advantage
    from kfrl.engines.minibatch import pad_rows

    cfg = ctx.config
    algo = cfg.algorithm
    names = set(table.column_names)
    mask = batch.to_torch_padded(table, "response_mask").float()
    width = mask.shape[1]
    lengths = [len(r) for r in table.column("response_ids").to_pylist()]
    scores = outcome_rewards(table.column("score").to_pylist(), lengths, width)
    metrics: dict[str, float] = {}

    rewards = scores
    if algo.use_kl_in_reward:
        controller = kl_controller(ctx)
        rewards, kl_metrics = apply_kl_penalty(
            scores, pad_rows(table.column("old_logprobs").to_pylist(), width, "cpu"),
            pad_rows(table.column("ref_logprobs").to_pylist(), width, "cpu"), mask, controller, algo.kl_penalty)
        metrics.update(kl_metrics)
        attempt.info[KL_COEF_INFO] = float(controller.value)

    values = pad_rows(table.column("values").to_pylist(), width, "cpu") if "values" in names else None
    baselines = (torch.tensor(table.column("reward_baselines").to_pylist(), dtype=torch.float32)
                 if "reward_baselines" in names else None)
    if algo.adv_estimator == "gae" and values is None:
        raise RuntimeError("adv_estimator=gae needs the values stage's output; is the critic enabled?")
    if algo.adv_estimator == "remax" and baselines is None:
        raise RuntimeError("adv_estimator=remax needs the gen_max stage's greedy baselines")
    advantages, returns = compute_advantage(
        algo.adv_estimator, rewards, mask, index=table.column("uid").to_pylist(), values=values,
        reward_baselines=baselines, gamma=algo.gamma, lam=algo.lam, norm_adv_by_std=algo.norm_adv_by_std_in_grpo,
    )

    def unpad(t):
        return [row[:n].tolist() for row, n in zip(t, lengths)]

    columns = {"sample_id": table.column("sample_id").to_pylist(), "token_level_rewards": unpad(rewards),
               "advantages": unpad(advantages), "returns": unpad(returns)}
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
