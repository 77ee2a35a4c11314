"""The optimisation loop shared by the actor and the critic (veRL's dp_actor / dp_critic):
``epochs`` passes over the batch (reshuffled each epoch when asked), one optimizer step per
mini-batch, gradients accumulated over micro-batches with each micro-batch's loss weighted by its
share of the mini-batch, gradient clipping, and a skipped step when the gradient norm is not finite.

Under ``data_parallel(plan)`` (the distributed update, ``kfrl.distributed``) the same loop runs in each
of N processes: the plan hands this process its share of each mini-batch's micro-batches (cut exactly
as one process cuts them), adds zero-weighted passes so every process runs as many passes as the
busiest one (the collectives of a sharded model need them), sums the gradients over the processes,
clips and steps, and merges the per-micro-batch metrics in one process's order.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections import defaultdict
from typing import Callable, Sequence

import torch

# The data-parallel plan of the update running in this process (None: one process does everything).
_DATA_PARALLEL: contextvars.ContextVar = contextvars.ContextVar("kfrl_data_parallel", default=None)


@contextlib.contextmanager
def data_parallel(plan):
    """Run ``optimize`` calls inside the block as this process's share of a data-parallel update. ``plan``
    (``kfrl.distributed.parallel.DataParallel``) provides ``passes(micro_batches)`` → [(rows, real)],
    ``forward(micro_step, rows)`` → loss, ``recorded(step_metrics, real)``, ``backward(loss)``, ``clip_and_step(model, optimizer, grad_clip)`` →
    (grad norm, stepped) and ``merge(step_metrics)``."""
    token = _DATA_PARALLEL.set(plan)
    try:
        yield plan
    finally:
        _DATA_PARALLEL.reset(token)


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or infinite; stops the update before any checkpoint is written."""


def optimize(model, optimizer, n_total: int, micro_step: Callable[[torch.Tensor], torch.Tensor], *,
             mini_batch_size: int, micro_batch_size: int, epochs: int, shuffle: bool, seed: int, grad_clip: float,
             prefix: str, progress=None, sample_ids: Sequence | None = None,
             step_metrics: dict[str, list] | None = None, token_budget: int = 0,
             sequence_lengths: torch.Tensor | None = None) -> dict[str, list[float]]:
    """Runs the loop in place. ``micro_step(rows)`` returns the micro-batch loss (mean over its rows,
    before weighting) and may append its own metrics (to ``step_metrics``, one value per key and
    micro-batch: a data-parallel update merges them over processes); returns ``{prefix}/grad_norm`` etc.
    as lists. A non-finite loss raises NonFiniteLossError naming the micro-batch's samples (``sample_ids``).
    With ``token_budget`` > 0 micro-batches are cut by tokens instead of rows (``budget_micro_batches``
    over ``sequence_lengths``, veRL's ``use_dynamic_bsz``)."""
    parallel = _DATA_PARALLEL.get()
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    metrics: dict[str, list[float]] = defaultdict(list)
    model.train()
    for _epoch in range(epochs):
        order = torch.randperm(n_total, generator=generator) if shuffle else torch.arange(n_total)
        for mb_start in range(0, n_total, mini_batch_size):
            mini_rows = order[mb_start:mb_start + mini_batch_size]
            optimizer.zero_grad(set_to_none=True)
            if token_budget > 0:
                micro_batches = budget_micro_batches(mini_rows, sequence_lengths, token_budget)
            else:
                micro_batches = [mini_rows[mc_start:mc_start + micro_batch_size]
                                 for mc_start in range(0, len(mini_rows), micro_batch_size)]
            # One copy to the device per mini-batch: a copy from pageable host memory waits for the GPU.
            micro_batches = list(torch.cat(micro_batches).to(device).split([len(rows) for rows in micro_batches]))
            passes = [(rows, True) for rows in micro_batches] if parallel is None else parallel.passes(micro_batches)
            losses: list[tuple[torch.Tensor, torch.Tensor]] = []
            for rows, real in passes:
                loss = micro_step(rows) if parallel is None else parallel.forward(micro_step, rows)
                if parallel is not None:
                    parallel.recorded(step_metrics, real)
                    if not real:  # a pass that only keeps this process in step with the others' collectives
                        parallel.backward(loss * 0.0)
                        continue
                losses.append((rows, loss.detach()))
                # The accumulated gradient equals the mini-batch mean whatever the micro-batch size (and
                # whatever the number of processes: their gradients are summed).
                weighted = loss * (len(rows) / len(mini_rows))
                if parallel is None:
                    weighted.backward()
                else:
                    parallel.backward(weighted)
            # Checked once per mini-batch, before its step: a check per micro-batch would make the host
            # wait for each forward pass before queuing its backward, leaving the GPU idle meanwhile.
            check_finite(losses, prefix, sample_ids, f"epoch {_epoch + 1}, mini-batch {mb_start // mini_batch_size + 1}")
            if parallel is None:
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
                stepped = bool(torch.isfinite(grad_norm))
                if stepped:
                    optimizer.step()
            else:
                grad_norm, stepped = parallel.clip_and_step(model, optimizer, grad_clip)
            if not stepped:
                metrics[f"{prefix}/skipped_steps"].append(1.0)
            optimizer.zero_grad(set_to_none=True)
            metrics[f"{prefix}/grad_norm"].append(float(grad_norm))
            if progress is not None:
                progress()
    metrics[f"{prefix}/lr"].append(optimizer.param_groups[0]["lr"])
    if step_metrics is not None:
        read_tensors(step_metrics)
    if parallel is not None and step_metrics is not None:
        parallel.merge(step_metrics)
    return metrics


def check_finite(losses: Sequence[tuple[torch.Tensor, torch.Tensor]], prefix: str, sample_ids: Sequence | None,
                 where: str) -> None:
    """Raise NonFiniteLossError naming the samples of the first micro-batch of ``losses`` ((rows, loss)
    pairs) whose loss is NaN or infinite; one read from the device for all of them."""
    if not losses:
        return
    finite = torch.isfinite(torch.stack([loss.float() for _rows, loss in losses])).tolist()
    for (rows, loss), ok in zip(losses, finite):
        if not ok:
            names = [sample_ids[i] for i in rows.tolist()] if sample_ids is not None else rows.tolist()
            raise NonFiniteLossError(
                f"{prefix} loss is {float(loss)} on the micro-batch of samples {names[:8]}"
                f"{' ...' if len(names) > 8 else ''} ({where}); "
                f"the update stopped before writing a checkpoint: lower {prefix}.lr or check its inputs")


def read_tensors(metrics: dict[str, list]) -> None:
    """Replace, in place, the tensors among ``metrics``' values (0-d, as the losses return them) by python
    floats, with one copy to the host: a copy per value would wait for the GPU once per value."""
    found = [(key, i, value) for key, values in metrics.items() for i, value in enumerate(values)
             if isinstance(value, torch.Tensor)]
    if not found:
        return
    device = found[0][2].device
    host = torch.stack([value.detach().float().reshape(()).to(device) for _key, _i, value in found]).tolist()
    for (key, i, _value), number in zip(found, host):
        metrics[key][i] = number


def budget_micro_batches(rows: torch.Tensor, lengths: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """``rows`` cut into micro-batches of at most ``budget`` tokens once padded to their longest member:
    longest first, each micro-batch filled while (rows + 1) x its longest fits (a row longer than the
    budget goes alone). Sorting by length is what leaves almost no padding in a micro-batch."""
    order = sorted(rows.tolist(), key=lambda row: -int(lengths[row]))
    batches: list[list[int]] = []
    for row in order:
        if batches and (len(batches[-1]) + 1) * int(lengths[batches[-1][0]]) <= budget:
            batches[-1].append(row)
        else:
            batches.append([row])
    return [torch.tensor(batch, dtype=rows.dtype) for batch in batches]


def mean_metrics(metrics: dict[str, list[float]]) -> dict[str, float]:
    return {key: sum(values) / len(values) for key, values in metrics.items() if values}
