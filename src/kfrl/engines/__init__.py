"""Compute engines behind small interfaces: rollout (generation), inference (log-probs, entropy)
and training (the actor update). Stages pick an engine by config; engines know nothing of stores."""
from __future__ import annotations


def pick_device(requested: str = "auto") -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but no CUDA device is visible; use trainer.device=auto or cpu")
    return requested


def compute_dtype(requested: str, device: str):
    """The dtype for forward passes: bf16 on CUDA under "auto", fp32 on CPU."""
    import torch

    if requested == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return getattr(torch, requested)


def autocast(device_type: str, dtype):
    """Autocast to ``dtype`` for a forward pass; a no-op context for None or float32."""
    import torch

    enabled = dtype is not None and dtype != torch.float32
    return torch.autocast(device_type=device_type, dtype=dtype or torch.float32, enabled=enabled)
