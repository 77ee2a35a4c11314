"""The data-parallel plan an update runs under in each of N processes (``kfrl.engines.minibatch.data_parallel``).

Each mini-batch is cut into micro-batches exactly as one process cuts it; micro-batch k goes to rank
k mod N. Each rank weights its micro-batch losses by their share of the mini-batch, as one process
does, and the gradients are **summed** over the ranks, so the step sees the gradient one process
would have accumulated. A rank with fewer micro-batches than the busiest one runs zero-weighted passes
(on the mini-batch's first micro-batch) so that every rank takes part in every collective of the
sharded model. Per-micro-batch metrics are tagged with their micro-batch's index and merged over the
ranks in one process's order, so their means are one process's means.
"""
from __future__ import annotations

import math
from collections import defaultdict


class DataParallel:
    """FSDP2 (torch ``fully_shard``) or any model whose gradients a plain ``backward`` sums over ranks.
    ``root``: the FSDP root (``kfrl.distributed.sharding.sharded_root_class``) each micro-step runs inside."""

    def __init__(self, rank: int, world_size: int, root=None):
        self.rank, self.world_size = rank, world_size
        self.root = root
        self._first = 0            # global index of the current mini-batch's first micro-batch
        self._current = -1         # global index of the micro-batch of the pass running now
        self._last_pass = False    # the pass running now is this rank's last of the mini-batch
        self._seen: dict[str, int] = {}
        self._tags: dict[str, list[int]] = defaultdict(list)

    # --- which micro-batches are mine ------------------------------------------------------------
    def assignment(self, n_micro: int) -> tuple[list[int], int]:
        """(indices of this rank's micro-batches, zero-weighted passes it adds) for a mini-batch of
        ``n_micro`` micro-batches: round-robin, padded to the busiest rank's count."""
        mine = list(range(self.rank, n_micro, self.world_size))
        return mine, math.ceil(n_micro / self.world_size) - len(mine)

    def passes(self, micro_batches: list):
        """This rank's passes over one mini-batch: [(rows, real)]; a pass with real=False is zero-weighted."""
        mine, padding = self.assignment(len(micro_batches))
        first, total = self._first, len(mine) + padding
        self._first += len(micro_batches)
        for n, index in enumerate(mine):
            self._current, self._last_pass = first + index, n == total - 1
            yield micro_batches[index], True
        for n in range(padding):
            self._current, self._last_pass = -1, len(mine) + n == total - 1
            yield micro_batches[0], False

    # --- metrics ---------------------------------------------------------------------------------
    def recorded(self, step_metrics: dict | None, real: bool) -> None:
        """After a pass: tag the values it appended to ``step_metrics`` with its micro-batch (or drop
        them: a zero-weighted pass reports nothing)."""
        if step_metrics is None:
            return
        for key, values in step_metrics.items():
            seen = self._seen.get(key, 0)
            if real:
                self._tags[key].extend([self._current] * (len(values) - seen))
            else:
                del values[seen:]
            self._seen[key] = len(values)

    def merge(self, step_metrics: dict) -> None:
        """Replace each rank's per-micro-batch values by every rank's, in micro-batch order (in place,
        the same on every rank)."""
        import torch.distributed as dist

        mine = {key: list(zip(self._tags[key], values)) for key, values in step_metrics.items()}
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, mine)
        merged: dict[str, list] = defaultdict(list)
        for part in gathered:
            for key, tagged in part.items():
                merged[key].extend(tagged)
        for key, tagged in merged.items():
            # sorted() is stable: values of one micro-batch keep the order they were appended in.
            step_metrics[key] = [value for _index, value in sorted(tagged, key=lambda item: item[0])]
        self._seen = {key: len(values) for key, values in step_metrics.items()}
        self._tags = defaultdict(list, {key: [] for key in step_metrics})

    # --- gradients -------------------------------------------------------------------------------
    def forward(self, micro_step, rows):
        """The micro-step's loss, computed inside the sharded root's forward (which gathers the root's
        parameters and reduces their gradients after the backward pass)."""
        return micro_step(rows) if self.root is None else self.root(micro_step, rows)

    def backward(self, loss) -> None:
        loss.backward()

    def clip_and_step(self, model, optimizer, grad_clip: float):
        """Clip by the norm of the whole (sharded) gradient, which equals one process's norm, and step
        unless it is not finite; returns (norm, stepped)."""
        import torch

        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor (replicated): the same value on every rank
            grad_norm = grad_norm.full_tensor()
        stepped = bool(torch.isfinite(grad_norm))
        if stepped:
            optimizer.step()
        return grad_norm, stepped


class ReplicatedParallel(DataParallel):
    """Every rank holds the whole training copy (a LoRA copy: the frozen base and its adapters, small
    enough to replicate): the trained parameters' gradients are summed over the ranks once per
    mini-batch, before the clip and the step (DDP's all-reduce), so every rank takes the same step and
    the copies stay equal. Nothing collective runs inside a pass, so no rank pads with
    zero-weighted passes."""

    def assignment(self, n_micro: int) -> tuple[list[int], int]:
        return list(range(self.rank, n_micro, self.world_size)), 0

    def clip_and_step(self, model, optimizer, grad_clip: float):
        import torch
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        trained = [p for p in model.parameters() if p.requires_grad]
        for param in trained:
            if param.grad is None:  # a rank without a micro-batch in this mini-batch adds zeros
                param.grad = torch.zeros_like(param)
        by_dtype: dict = {}
        for param in trained:
            by_dtype.setdefault(param.grad.dtype, []).append(param)
        for params in by_dtype.values():  # one collective per dtype, not one per adapter tensor
            grads = [p.grad for p in params]
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat)
            for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(summed)
        return super().clip_and_step(model, optimizer, grad_clip)


class DeepSpeedParallel(DataParallel):
    """DeepSpeed ZeRO-2/3: the engine owns backward, the reduction and the step. DeepSpeed averages
    gradients over the ranks, so each loss is multiplied by the world size (a sum, as above); the
    accumulation boundary is the last pass of each mini-batch. Gradient clipping is the engine's
    (``gradient_clipping`` in its config); a non-finite norm is reported, the engine still steps."""

    def __init__(self, rank: int, world_size: int, engine):
        super().__init__(rank, world_size)
        self.engine = engine

    def backward(self, loss) -> None:
        self.engine.set_gradient_accumulation_boundary(self._last_pass)
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)

    def clip_and_step(self, model, optimizer, grad_clip: float):
        import torch

        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        grad_norm = torch.as_tensor(float("nan") if norm is None else float(norm))
        return grad_norm, bool(torch.isfinite(grad_norm))
