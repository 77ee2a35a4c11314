"""The actor update: PPO-family policy loss over mini-batches and micro-batches (veRL's dp_actor).

One call = one iteration's update: ``ppo_epochs`` passes over the batch, one optimizer step per
mini-batch, gradients accumulated over micro-batches with each micro-batch's loss scaled by its
share of the mini-batch, gradient clipping, and a skipped step when the gradient norm is not finite.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from kfrl.engines.inference import PaddedBatch, forward_response


@dataclass
class UpdateBatch:
    prompts: list[list[int]]
    responses: list[list[int]]
    response_masks: list[list[int]]
    advantages: list[list[float]]
    old_logprobs: list[list[float]] | None  # None: on-policy shortcut (old = new.detach())
    ref_logprobs: list[list[float]] | None  # None: no KL loss


def _pad(rows: list[list[float]], width: int, device) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        if r:
            out[i, :len(r)] = torch.tensor(r, dtype=torch.float32)
    return out.to(device)


def update_actor(model, optimizer, data: UpdateBatch, actor_cfg, *, mini_batch_size: int, temperature: float,
                 pad_id: int, autocast_dtype=None, seed: int = 0, progress=None) -> dict[str, float]:
    """Runs the update in place on ``model``/``optimizer``; returns veRL-named metrics (means over micro-batches)."""
    from kfrl.algos import agg_loss, kl_penalty, policy_loss

    device = next(model.parameters()).device
    n_total = len(data.prompts)
    full = PaddedBatch.build(data.prompts, data.responses, data.response_masks, pad_id, device)
    width = full.response_ids.shape[1]
    advantages = _pad(data.advantages, width, device)
    old = _pad(data.old_logprobs, width, device) if data.old_logprobs is not None else None
    ref = _pad(data.ref_logprobs, width, device) if data.ref_logprobs is not None else None
    micro = actor_cfg.ppo_micro_batch_size_per_gpu
    generator = torch.Generator().manual_seed(seed)
    metrics: dict[str, list[float]] = defaultdict(list)
    model.train()
    for _epoch in range(actor_cfg.ppo_epochs):
        order = torch.randperm(n_total, generator=generator) if actor_cfg.shuffle else torch.arange(n_total)
        for mb_start in range(0, n_total, mini_batch_size):
            mini_rows = order[mb_start:mb_start + mini_batch_size]
            optimizer.zero_grad(set_to_none=True)
            for mc_start in range(0, len(mini_rows), micro):
                rows = mini_rows[mc_start:mc_start + micro].to(device)
                batch = full.select(rows)
                mask = batch.response_mask
                # Entropy costs a softmax over the vocabulary: only when it is in the loss, or when
                # no old-logprob pass reported actor/entropy for this batch.
                want_entropy = actor_cfg.entropy_coeff != 0 or old is None
                log_prob, entropy = forward_response(model, batch, temperature, want_entropy, autocast_dtype)
                old_lp = old[rows] if old is not None else log_prob.detach()
                pg_loss, pg_metrics = policy_loss(
                    "vanilla", old_lp, log_prob, advantages[rows], mask,
                    loss_agg_mode=actor_cfg.loss_agg_mode, clip_ratio=actor_cfg.clip_ratio,
                    clip_ratio_low=actor_cfg.clip_ratio_low, clip_ratio_high=actor_cfg.clip_ratio_high,
                    clip_ratio_c=actor_cfg.clip_ratio_c,
                )
                loss = pg_loss
                if actor_cfg.entropy_coeff != 0:
                    entropy_agg = agg_loss(entropy, mask, actor_cfg.loss_agg_mode)
                    loss = loss - actor_cfg.entropy_coeff * entropy_agg
                if ref is not None:
                    kl = kl_penalty(log_prob, ref[rows], actor_cfg.kl_loss_type)
                    kl_loss = agg_loss(kl, mask, actor_cfg.loss_agg_mode)
                    loss = loss + actor_cfg.kl_loss_coef * kl_loss
                    metrics["actor/kl_loss"].append(float(kl_loss.detach()))
                    metrics["actor/kl_coef"].append(actor_cfg.kl_loss_coef)
                # Each micro-batch contributes its share of the mini-batch, so the accumulated
                # gradient equals the mini-batch mean regardless of the micro-batch size.
                (loss * (len(rows) / len(mini_rows))).backward()
                metrics["actor/pg_loss"].append(float(pg_loss.detach()))
                for key, value in pg_metrics.items():
                    metrics[key].append(float(value))
                if entropy is not None:
                    metrics["actor/entropy"].append(float(agg_loss(entropy.detach(), mask, "token-mean")))
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), actor_cfg.grad_clip)
            if torch.isfinite(grad_norm):
                optimizer.step()
            else:
                metrics["actor/skipped_steps"].append(1.0)
            optimizer.zero_grad(set_to_none=True)
            metrics["actor/grad_norm"].append(float(grad_norm))
            if progress is not None:
                progress()
    metrics["actor/lr"].append(optimizer.param_groups[0]["lr"])
    return {key: sum(values) / len(values) for key, values in metrics.items()}
