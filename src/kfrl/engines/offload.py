"""Parameter and optimizer offload (veRL's ``fsdp_config.param_offload`` / ``optimizer_offload``): between
updates a role's training copy waits in host memory, so the GPU holds only what rollout and inference
need; an update brings it back first. Each direction costs one copy of the bytes over PCIe."""
from __future__ import annotations

import time

import torch


def optimizer_tensors(optimizer) -> list[tuple[dict, str]]:
    """(state dict, key) of every tensor in an optimizer's per-parameter state."""
    return [(state, key) for state in optimizer.state.values() for key, value in state.items()
            if isinstance(value, torch.Tensor)]


def move_training_copy(model, optimizer, device: str | torch.device, *, params: bool, optimizer_state: bool) -> float:
    """Move the weights (``params``) and/or the optimizer's state (``optimizer_state``) of a training copy
    to ``device``; returns the seconds it took (after the copies completed)."""
    started = time.perf_counter()
    device = torch.device(device)
    if params:
        model.to(device)
    if optimizer_state:
        for state, key in optimizer_tensors(optimizer):
            state[key] = state[key].to(device, non_blocking=device.type == "cuda")
    if device.type == "cuda" or any(p.is_cuda for p in model.parameters()):
        torch.cuda.synchronize()
    return time.perf_counter() - started


def offloads(role_cfg) -> tuple[bool, bool]:
    """(param_offload, optimizer_offload) of an actor or critic config section."""
    return bool(getattr(role_cfg, "param_offload", False)), bool(getattr(role_cfg, "optimizer_offload", False))
