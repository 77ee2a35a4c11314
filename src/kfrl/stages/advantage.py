"""Stage ``advantage``: token-level rewards (outcome score at the last response token) and advantages."""
from __future__ import annotations

from kfrl.stages.context import StageContext


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


def advantage(ctx: StageContext, attempt) -> dict[str, float]:
    from kfrl import batch
    from kfrl.algos import advantage as compute_advantage

    cfg = ctx.config
    table = ctx.read_groups("rollout", "score")
    mask = batch.to_torch_padded(table, "response_mask").float()
    lengths = [len(r) for r in table.column("response_ids").to_pylist()]
    rewards = outcome_rewards(table.column("score").to_pylist(), lengths, mask.shape[1])
    advantages, returns = compute_advantage(
        cfg.algorithm.adv_estimator, rewards, mask, index=table.column("uid").to_pylist(),
        gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam, norm_adv_by_std=cfg.algorithm.norm_adv_by_std_in_grpo,
    )

    def unpad(t):
        return [row[:n].tolist() for row, n in zip(t, lengths)]

    batch.write_group(attempt, "advantage", batch.make_table("advantage", {
        "sample_id": table.column("sample_id").to_pylist(), "token_level_rewards": unpad(rewards),
        "advantages": unpad(advantages), "returns": unpad(returns)}))
    sequence_rewards = rewards.sum(-1)
    metrics = {"critic/rewards/mean": float(sequence_rewards.mean()),
               "critic/rewards/max": float(sequence_rewards.max()),
               "critic/rewards/min": float(sequence_rewards.min())}
    metrics.update(masked_stats(advantages, mask, "critic/advantages"))
    metrics.update(masked_stats(returns, mask, "critic/returns"))
    return metrics
