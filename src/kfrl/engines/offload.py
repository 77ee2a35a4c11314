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


def _offloaded_tensors(model, optimizer, *, params: bool, optimizer_state: bool) -> list[tuple[object, str, torch.Tensor]]:
    """(holder, attribute or key, tensor) of every tensor to move: a parameter's ``data`` and the
    optimizer state's entries."""
    moved: list[tuple[object, str, torch.Tensor]] = []
    if params:
        moved += [(p, "data", p.data) for p in model.parameters()]
    if optimizer_state:
        moved += [(state, key, state[key]) for state, key in optimizer_tensors(optimizer)]
    return moved


def _put(holder, name: str, tensor: torch.Tensor) -> None:
    if isinstance(holder, dict):
        holder[name] = tensor
    else:
        setattr(holder, name, tensor)


def move_training_copy(model, optimizer, device: str | torch.device, *, params: bool, optimizer_state: bool) -> float:
    """Move the weights (``params``) and/or the optimizer's state (``optimizer_state``) of a training copy
    to ``device``; returns the seconds it took (after the copies completed).

    To the host the tensors go into page-locked buffers kept for the next offload (``HostBuffers``):
    about 4x the bandwidth of ordinary pages, and both directions are queued before one synchronisation.
    Back on the accelerator the buffers are given back for the next offload."""
    from kfrl.models.host_memory import host_buffers, on_host

    started = time.perf_counter()
    device = torch.device(device)
    pool = host_buffers(f"offload/{id(model)}")
    moved = _offloaded_tensors(model, optimizer, params=params, optimizer_state=optimizer_state)
    if device.type == "cpu":
        on_gpu = [(holder, name, tensor) for holder, name, tensor in moved if tensor.device.type != "cpu"]
        if on_gpu:
            buffers = pool.take()
            hosts = on_host([tensor for _, _, tensor in on_gpu], buffers=buffers)
            for (holder, name, _), host in zip(on_gpu, hosts):
                _put(holder, name, host)
            model._kfrl_offload_buffers = buffers  # held while offloaded, given back when onloaded
    else:
        for holder, name, tensor in moved:
            if tensor.device != device:
                _put(holder, name, tensor.to(device, non_blocking=True))
    if params:
        model.to(device)  # what is left: buffers (rotary tables) and gradients
    if device.type == "cuda" or any(p.is_cuda for p in model.parameters()):
        torch.cuda.synchronize()
    if device.type != "cpu":
        held = getattr(model, "_kfrl_offload_buffers", None)
        if held is not None:
            pool.give_back(held)
            model._kfrl_offload_buffers = None
    return time.perf_counter() - started


def offloads(role_cfg) -> tuple[bool, bool]:
    """(param_offload, optimizer_offload) of an actor or critic config section."""
    return bool(getattr(role_cfg, "param_offload", False)), bool(getattr(role_cfg, "optimizer_offload", False))
