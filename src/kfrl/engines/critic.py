"""The critic: a value model (the LM body with a scalar token-classification head, veRL's
``AutoModelForTokenClassification(num_labels=1)``), its values and its clipped value-loss update.

The value of response token t is read at the position that predicts it (the state before the
token is generated), as veRL reads ``logits[:, -L-1:-1]``; values at masked positions are 0.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from kfrl.engines import autocast, inference
from kfrl.engines.minibatch import mean_metrics, optimize
from kfrl.trajectory import Trajectories


def forward_values(model, batch: Trajectories, autocast_dtype=None) -> torch.Tensor:
    """(B, L) values at response positions; differentiable when grad is enabled."""
    device_type = batch.input_ids.device.type
    with autocast(device_type, autocast_dtype), inference.attention_kernels(device_type):
        # right-padded rows: a causal model needs no padding mask (see inference.response_hidden)
        mask = None if inference.causal_attention(model) else batch.attention_mask
        logits = model(input_ids=batch.input_ids, attention_mask=mask, **inference.uncached(model)).logits
    per_position = logits.float().squeeze(-1)  # (B, T)
    return torch.gather(per_position, 1, batch.gather_positions)


@torch.no_grad()
def compute_values(model, trajectories: Trajectories, *, micro_batch_size: int, autocast_dtype=None) -> torch.Tensor:
    """Values (B, L), 0 at masked positions, micro-batched."""
    device = next(model.parameters()).device
    trajectories = trajectories.to(device)
    out = []
    for start in range(0, len(trajectories), micro_batch_size):
        batch = trajectories.select(slice(start, start + micro_batch_size))
        out.append(forward_values(model, batch, autocast_dtype) * batch.response_mask)
    return torch.cat(out)


def update_critic(model, optimizer, trajectories: Trajectories, *, mini_batch_size: int, micro_batch_size: int,
                  epochs: int, shuffle: bool, grad_clip: float, cliprange_value: float, loss_agg_mode: str,
                  autocast_dtype=None, seed: int = 0, progress=None, sample_ids=None) -> dict[str, float]:
    """veRL's dp_critic ``update_critic`` over trajectories with the ``values`` (the values stage's
    output: the clip anchor) and ``returns`` fields: clipped value loss; returns critic/* metrics (means)."""
    from kfrl.algos import masked_mean, value_loss

    full = trajectories.to(next(model.parameters()).device)
    metrics: dict[str, list[float]] = defaultdict(list)

    def micro_step(rows: torch.Tensor) -> torch.Tensor:
        batch = full.select(rows)
        vpreds = forward_values(model, batch, autocast_dtype)
        vf_loss, vf_clipfrac = value_loss(vpreds, batch.get("returns"), batch.get("values"), batch.response_mask,
                                          cliprange_value=cliprange_value, loss_agg_mode=loss_agg_mode)
        # Tensors: the loop reads them all at its end (kfrl.engines.minibatch.read_tensors).
        metrics["critic/vf_loss"].append(vf_loss.detach())
        metrics["critic/vf_clipfrac"].append(vf_clipfrac)
        metrics["critic/vpred_mean"].append(masked_mean(vpreds.detach(), batch.response_mask))
        return vf_loss

    metrics.update(optimize(model, optimizer, len(full), micro_step, mini_batch_size=mini_batch_size,
                            micro_batch_size=micro_batch_size, epochs=epochs, shuffle=shuffle, seed=seed,
                            grad_clip=grad_clip, prefix="critic", progress=progress, sample_ids=sample_ids,
                            step_metrics=metrics))
    return mean_metrics(metrics)
