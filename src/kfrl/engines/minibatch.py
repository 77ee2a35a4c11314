"""The optimisation loop shared by the actor and the critic (veRL's dp_actor / dp_critic):
``epochs`` passes over the batch (reshuffled each epoch when asked), one optimizer step per
mini-batch, gradients accumulated over micro-batches with each micro-batch's loss weighted by its
share of the mini-batch, gradient clipping, and a skipped step when the gradient norm is not finite.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

import torch


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or infinite; stops the update before any checkpoint is written."""


def optimize(model, optimizer, n_total: int, micro_step: Callable[[torch.Tensor], torch.Tensor], *,
             mini_batch_size: int, micro_batch_size: int, epochs: int, shuffle: bool, seed: int, grad_clip: float,
             prefix: str, progress=None, sample_ids: Sequence | None = None) -> dict[str, list[float]]:
    """Runs the loop in place. ``micro_step(rows)`` returns the micro-batch loss (mean over its rows,
    before weighting) and may append its own metrics; returns ``{prefix}/grad_norm`` etc. as lists.
    A non-finite loss raises NonFiniteLossError naming the micro-batch's samples (``sample_ids``)."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    metrics: dict[str, list[float]] = defaultdict(list)
    model.train()
    for _epoch in range(epochs):
        order = torch.randperm(n_total, generator=generator) if shuffle else torch.arange(n_total)
        for mb_start in range(0, n_total, mini_batch_size):
            mini_rows = order[mb_start:mb_start + mini_batch_size]
            optimizer.zero_grad(set_to_none=True)
            for mc_start in range(0, len(mini_rows), micro_batch_size):
                rows = mini_rows[mc_start:mc_start + micro_batch_size].to(device)
                loss = micro_step(rows)
                if not torch.isfinite(loss):
                    names = [sample_ids[i] for i in rows.tolist()] if sample_ids is not None else rows.tolist()
                    raise NonFiniteLossError(
                        f"{prefix} loss is {float(loss.detach())} on the micro-batch of samples {names[:8]}"
                        f"{' ...' if len(names) > 8 else ''} (epoch {_epoch + 1}, mini-batch {mb_start // mini_batch_size + 1}); "
                        f"the update stopped before writing a checkpoint: lower {prefix}.lr or check its inputs")
                # The accumulated gradient equals the mini-batch mean whatever the micro-batch size.
                (loss * (len(rows) / len(mini_rows))).backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            if torch.isfinite(grad_norm):
                optimizer.step()
            else:
                metrics[f"{prefix}/skipped_steps"].append(1.0)
            optimizer.zero_grad(set_to_none=True)
            metrics[f"{prefix}/grad_norm"].append(float(grad_norm))
            if progress is not None:
                progress()
    metrics[f"{prefix}/lr"].append(optimizer.param_groups[0]["lr"])
    return metrics


def mean_metrics(metrics: dict[str, list[float]]) -> dict[str, float]:
    return {key: sum(values) / len(values) for key, values in metrics.items() if values}
