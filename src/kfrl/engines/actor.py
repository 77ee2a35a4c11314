"""The actor update: a PPO-family policy loss (veRL's dp_actor ``update_policy``), optionally with
an entropy bonus and a KL loss towards the reference policy, run by the shared mini-batch loop."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from kfrl.engines.inference import PaddedBatch, forward_response
from kfrl.engines.minibatch import mean_metrics, optimize, pad_rows


@dataclass
class UpdateBatch:
    prompts: list[list[int]]
    responses: list[list[int]]
    response_masks: list[list[int]]
    advantages: list[list[float]]
    old_logprobs: list[list[float]] | None  # None: on-policy shortcut (old = new.detach())
    ref_logprobs: list[list[float]] | None  # None: no KL loss


def update_actor(model, optimizer, data: UpdateBatch, actor_cfg, *, mini_batch_size: int, temperature: float,
                 pad_id: int, autocast_dtype=None, seed: int = 0, progress=None) -> dict[str, float]:
    """Runs the update in place on ``model``/``optimizer``; returns veRL-named metrics (means over micro-batches)."""
    from kfrl.algos import actor_loss

    device = next(model.parameters()).device
    full = PaddedBatch.build(data.prompts, data.responses, data.response_masks, pad_id, device)
    width = full.response_ids.shape[1]
    advantages = pad_rows(data.advantages, width, device)
    old = pad_rows(data.old_logprobs, width, device) if data.old_logprobs is not None else None
    ref = pad_rows(data.ref_logprobs, width, device) if data.ref_logprobs is not None else None
    metrics: dict[str, list[float]] = defaultdict(list)

    def micro_step(rows: torch.Tensor) -> torch.Tensor:
        batch = full.select(rows)
        mask = batch.response_mask
        # Entropy costs a softmax over the vocabulary: only when it is in the loss, or when no
        # old-logprob pass reported actor/entropy for this batch.
        want_entropy = actor_cfg.entropy_coeff != 0 or old is None
        log_prob, entropy = forward_response(model, batch, temperature, want_entropy, autocast_dtype)
        old_lp = old[rows] if old is not None else log_prob.detach()
        loss, stats = actor_loss(
            log_prob, old_lp, advantages[rows], mask, loss_mode=actor_cfg.loss_mode,
            loss_agg_mode=actor_cfg.loss_agg_mode, clip_ratio=actor_cfg.clip_ratio,
            clip_ratio_low=actor_cfg.clip_ratio_low, clip_ratio_high=actor_cfg.clip_ratio_high,
            clip_ratio_c=actor_cfg.clip_ratio_c, entropy=entropy, entropy_coeff=actor_cfg.entropy_coeff,
            ref_log_prob=ref[rows] if ref is not None else None, kl_loss_type=actor_cfg.kl_loss_type,
            kl_loss_coef=actor_cfg.kl_loss_coef)
        for key, value in stats.items():
            metrics[key].append(value)
        return loss

    loop_metrics = optimize(model, optimizer, len(data.prompts), micro_step, mini_batch_size=mini_batch_size,
                            micro_batch_size=actor_cfg.ppo_micro_batch_size_per_gpu, epochs=actor_cfg.ppo_epochs,
                            shuffle=actor_cfg.shuffle, seed=seed, grad_clip=actor_cfg.grad_clip, prefix="actor",
                            progress=progress)
    metrics.update(loop_metrics)
    return mean_metrics(metrics)
