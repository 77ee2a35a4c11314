"""A LoRA linear layer's forward and backward in three GEMMs each way, with nothing between them.

PEFT's ``lora.Linear`` computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling``. With adapters in
fp32 over a bf16 base under autocast (how kfrl trains LoRA on a GPU), each call first copies the
activation ``x`` to fp32 (the adapters' dtype), autocast copies it back to bf16 for ``lora_A``, and the
scaling and the sum are two more passes over the output; the backward pass repeats the casts, and
autograd keeps a bf16 copy of ``x`` per adapted module (q, k and v each hold their own). At the Qwen2.5-7B
shape (all-linear) those passes read and write about 1 MB per token and layer in the forward pass (12
bytes per input element for the two casts, 10 per output element for the scaling and the sum): 85 GB for
a micro-batch of 8 x 389 tokens, some 28 ms at 3 TB/s, and as much again backward (an estimate).

Here the scaling is folded into ``B`` (a small ``(out, r)`` matrix), the low-rank product is added by
the GEMM that writes the output (``addmm_`` into the base's result), and the gradient of ``x`` is summed
the same way::

    forward   h = x Aᵀ             y = x Wᵀ (+ bias);   y += h (sB)ᵀ
    backward  g_h = g_y (sB)       g_x = g_y W;         g_x += g_h A
              g_A = g_hᵀ x         g_B = s g_yᵀ h

``x`` is saved as it came (modules fed the same tensor share it), with ``h`` (``(N, r)``). The results
are PEFT's up to the rounding of the compute dtype (one rounding of the sum instead of three); tests
compare them in float64. PEFT keeps building, saving and loading the adapters: only the forward of its
plain LoRA linears (no dropout, no DoRA, one adapter, base ``nn.Linear``) is replaced, and a model whose
adapters are disabled (the reference policy) or merged runs PEFT's own. (Saving the frozen weight for the
backward pass is what ``F.linear`` does too; DeepSpeed ZeRO-3, which empties partitioned weights in place
and so needs its own linear function, is refused with LoRA by the config.)
"""
from __future__ import annotations

import os
import types

import torch

# KFRL_LORA_LINEAR=peft keeps PEFT's own forward (to compare the two on a device).
_ENV = "KFRL_LORA_LINEAR"


class LowRankLinear(torch.autograd.Function):
    """``y = x Wᵀ + bias + scaling · (x Aᵀ) Bᵀ`` with ``W`` (and ``bias``) frozen; every GEMM runs in
    ``x``'s dtype (the autocast dtype when autocast is on), the adapters' gradients come back in theirs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
        dtype = _compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            flat = x.reshape(-1, x.shape[-1]).to(dtype)
            a = lora_a.to(dtype)
            b = (lora_b * scaling).to(dtype)
            h = flat @ a.t()
            y = torch.nn.functional.linear(flat, weight.to(dtype), None if bias is None else bias.to(dtype))
            y.addmm_(h, b.t())
        ctx.save_for_backward(flat, h, weight, a, b)
        ctx.scaling = scaling
        ctx.dtypes = (x.dtype, lora_a.dtype, lora_b.dtype)
        ctx.shape = x.shape
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        flat, h, weight, a, b = ctx.saved_tensors
        x_dtype, a_dtype, b_dtype = ctx.dtypes
        with torch.autocast(flat.device.type, enabled=False):
            g_y = grad_y.reshape(-1, grad_y.shape[-1]).to(flat.dtype)
            g_h = g_y @ b
            grad_x = grad_a = grad_b = None
            if ctx.needs_input_grad[0]:
                grad_x = g_y @ weight.to(flat.dtype)
                grad_x.addmm_(g_h, a)
                grad_x = grad_x.view(ctx.shape).to(x_dtype)
            if ctx.needs_input_grad[3]:
                grad_a = (g_h.t() @ flat).to(a_dtype)
            if ctx.needs_input_grad[4]:
                grad_b = (g_y.t() @ h).to(b_dtype).mul_(ctx.scaling)
        return grad_x, None, None, grad_a, grad_b, None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _fused_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    adapters = self.active_adapters
    base = self.base_layer
    if (self.disable_adapters or self.merged or args or kwargs or len(adapters) != 1 or adapters[0] not in self.lora_A
            or base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad)):
        return self._kfrl_peft_forward(x, *args, **kwargs)
    name = adapters[0]
    return LowRankLinear.apply(x, base.weight, base.bias, self.lora_A[name].weight, self.lora_B[name].weight,
                               self.scaling[name])


def _fusable(module) -> bool:
    return (isinstance(getattr(module, "base_layer", None), torch.nn.Linear)
            and not getattr(module, "fan_in_fan_out", False)
            and not getattr(module, "lora_variant", {})  # DoRA and other variants keep PEFT's forward
            and all(isinstance(d, torch.nn.Identity) for d in module.lora_dropout.values())
            and all(isinstance(m, torch.nn.Linear) and m.bias is None
                    for m in (*module.lora_A.values(), *module.lora_B.values())))


def fuse_lora_linears(model) -> int:
    """Replace the forward of every plain LoRA linear in ``model`` (a PEFT model) by ``LowRankLinear``;
    returns how many. Nothing is replaced under ``KFRL_LORA_LINEAR=peft``."""
    mode = os.environ.get(_ENV, "fused").strip().lower()
    if mode not in ("fused", "peft"):
        raise ValueError(f"{_ENV} must be 'fused' (the default) or 'peft' (PEFT's own forward), not {mode!r}")
    if mode == "peft":
        return 0
    from peft.tuners.lora.layer import Linear as LoraLinear

    fused = 0
    for module in model.modules():
        if type(module) is LoraLinear and _fusable(module) and not hasattr(module, "_kfrl_peft_forward"):
            module._kfrl_peft_forward = module.forward
            module.forward = types.MethodType(_fused_forward, module)
            fused += 1
    return fused
