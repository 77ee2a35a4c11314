"""The critic: a value model (the LM body with a scalar token-classification head, veRL's
``AutoModelForTokenClassification(num_labels=1)``), its values and its clipped value-loss update.

The value of response token t is read at the position that predicts it (the state before the
token is generated), as veRL reads ``logits[:, -L-1:-1]``; values at masked positions are 0.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from kfrl.engines import autocast
from kfrl.engines.inference import PaddedBatch
from kfrl.engines.minibatch import mean_metrics, optimize, pad_rows


def forward_values(model, batch: PaddedBatch, autocast_dtype=None) -> torch.Tensor:
    """(B, L) values at response positions; differentiable when grad is enabled."""
    with autocast(batch.input_ids.device.type, autocast_dtype):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    per_position = logits.float().squeeze(-1)  # (B, T)
    return torch.gather(per_position, 1, batch.gather_positions)


@torch.no_grad()
def compute_values(model, prompts, responses, response_masks, *, pad_id: int, micro_batch_size: int,
                   autocast_dtype=None) -> list[list[float]]:
    device = next(model.parameters()).device
    out: list[list[float]] = []
    for start in range(0, len(prompts), micro_batch_size):
        stop = start + micro_batch_size
        batch = PaddedBatch.build(prompts[start:stop], responses[start:stop], response_masks[start:stop], pad_id, device)
        values = forward_values(model, batch, autocast_dtype) * batch.response_mask
        out.extend(values[row, :len(response)].tolist() for row, response in enumerate(responses[start:stop]))
    return out


@dataclass
class CriticBatch:
    prompts: list[list[int]]
    responses: list[list[int]]
    response_masks: list[list[int]]
    values: list[list[float]]   # the values stage's output: the clip anchor
    returns: list[list[float]]


def update_critic(model, optimizer, data: CriticBatch, *, mini_batch_size: int, micro_batch_size: int, epochs: int,
                  shuffle: bool, grad_clip: float, cliprange_value: float, loss_agg_mode: str, pad_id: int,
                  autocast_dtype=None, seed: int = 0, progress=None) -> dict[str, float]:
    """veRL's dp_critic ``update_critic``: clipped value loss; returns critic/* metrics (means)."""
    from kfrl.algos import masked_mean, value_loss

    device = next(model.parameters()).device
    full = PaddedBatch.build(data.prompts, data.responses, data.response_masks, pad_id, device)
    width = full.response_ids.shape[1]
    old_values = pad_rows(data.values, width, device)
    returns = pad_rows(data.returns, width, device)
    metrics: dict[str, list[float]] = defaultdict(list)

    def micro_step(rows: torch.Tensor) -> torch.Tensor:
        batch = full.select(rows)
        vpreds = forward_values(model, batch, autocast_dtype)
        vf_loss, vf_clipfrac = value_loss(vpreds, returns[rows], old_values[rows], batch.response_mask,
                                          cliprange_value=cliprange_value, loss_agg_mode=loss_agg_mode)
        metrics["critic/vf_loss"].append(float(vf_loss.detach()))
        metrics["critic/vf_clipfrac"].append(float(vf_clipfrac))
        metrics["critic/vpred_mean"].append(float(masked_mean(vpreds.detach(), batch.response_mask)))
        return vf_loss

    metrics.update(optimize(model, optimizer, len(data.prompts), micro_step, mini_batch_size=mini_batch_size,
                            micro_batch_size=micro_batch_size, epochs=epochs, shuffle=shuffle, seed=seed,
                            grad_clip=grad_clip, prefix="critic", progress=progress))
    return mean_metrics(metrics)
