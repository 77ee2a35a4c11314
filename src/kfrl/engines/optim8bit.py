"""AdamW with 8-bit moments (``actor.optimizer=AdamW8bit``): 2 bytes of optimizer state per parameter
instead of 8 in fp32, for a full fine-tune that would not fit one GPU otherwise.

Each moment is kept in blocks of ``block_size`` values, scaled per block so that its largest magnitude
maps to float8 e4m3's largest (448), and stored as float8 e4m3 (3 mantissa bits: 6 % relative
precision over 17 binary orders of magnitude below the block's largest). The second moment is stored
as its square root, which halves the orders of magnitude it spans. A square root that would round to
zero is stored as the smallest positive value instead: Adam's denominator is then over-estimated, so
the step is smaller than fp32 AdamW's, never blown up by a vanished denominator. The arithmetic of a
step is fp32 (the moments are dequantised, updated and requantised), the weight decay decoupled as in
``torch.optim.AdamW``. Tensors of fewer than ``min_8bit_size`` values (norms, biases) keep fp32
moments, as bitsandbytes' AdamW8bit does.
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# The smallest positive float8 e4m3 value (a subnormal, 2^-9).
FP8_TINY = 2.0 ** -9


def quantize(values: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 codes, fp32 scale per block) of a flat fp32 tensor (padded to whole blocks)."""
    blocks = _blocks(values, block_size)
    scale = blocks.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / FP8_MAX
    return (blocks / scale[:, None]).to(FP8), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, numel: int) -> torch.Tensor:
    return (codes.to(torch.float32) * scale[:, None]).flatten()[:numel]


def quantize_nonzero(values: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize`` for non-negative values where a positive value must not become zero."""
    codes, scale = quantize(values, block_size)
    lost = (codes.to(torch.float32) == 0) & (_blocks(values, block_size) > 0)
    if lost.any():
        codes = torch.where(lost, torch.tensor(FP8_TINY, dtype=FP8, device=codes.device), codes)
    return codes, scale


def _blocks(values: torch.Tensor, block_size: int) -> torch.Tensor:
    pad = (-values.numel()) % block_size
    flat = values.reshape(-1)
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, block_size)


class AdamW8bit(torch.optim.Optimizer):
    """``torch.optim.AdamW``'s update with the moments held in 8 bits (module docstring)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, block_size: int = 256, min_8bit_size: int = 4096):
        if lr <= 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1 or eps <= 0 or block_size < 1:
            raise ValueError(f"AdamW8bit: invalid lr={lr}, betas={betas}, eps={eps} or block_size={block_size}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      block_size=block_size, min_8bit_size=min_8bit_size))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                self._update(param, group, beta1, beta2)
        return loss

    def _update(self, param: torch.Tensor, group: dict, beta1: float, beta2: float) -> None:
        grad = param.grad.detach().to(torch.float32).reshape(-1)
        state = self.state[param]
        numel, block = param.numel(), group["block_size"]
        quantized = numel >= group["min_8bit_size"]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            if quantized:
                zeros = torch.zeros(numel, dtype=torch.float32, device=param.device)
                state["exp_avg_codes"], state["exp_avg_scale"] = quantize(zeros, block)
                state["exp_avg_sq_codes"], state["exp_avg_sq_scale"] = quantize(zeros, block)
            else:
                state["exp_avg"] = torch.zeros(numel, dtype=torch.float32, device=param.device)
                state["exp_avg_sq"] = torch.zeros(numel, dtype=torch.float32, device=param.device)
        if state["step"].device.type != "cpu":  # moved with the state (offload): read here without a sync
            state["step"] = state["step"].cpu()
        state["step"] += 1
        step = float(state["step"])
        if quantized:
            exp_avg = dequantize(state["exp_avg_codes"], state["exp_avg_scale"], numel)
            exp_avg_sq = dequantize(state["exp_avg_sq_codes"], state["exp_avg_sq_scale"], numel).square_()
        else:
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step
        denominator = (exp_avg_sq.sqrt() / bias2 ** 0.5).add_(group["eps"])
        master = param.detach().to(torch.float32).reshape(-1)
        master.mul_(1 - group["lr"] * group["weight_decay"])
        master.addcdiv_(exp_avg, denominator, value=-group["lr"] / bias1)
        param.copy_(master.view_as(param).to(param.dtype))
        if quantized:
            state["exp_avg_codes"], state["exp_avg_scale"] = quantize(exp_avg, block)
            state["exp_avg_sq_codes"], state["exp_avg_sq_scale"] = quantize_nonzero(exp_avg_sq.sqrt_(), block)

    def load_state_dict(self, state_dict: dict) -> None:
        # torch's loader casts every state tensor to its parameter's dtype, which would turn the float8
        # codes into numbers of another meaning (and fp32 moments of a bf16 parameter into bf16): the
        # tensors are put back as they were saved.
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for index, param in zip(ids, params):
            for key, value in saved.get(index, {}).items():
                if isinstance(value, torch.Tensor):
                    self.state[param][key] = value.to(param.device)

    def state_bytes(self) -> int:
        """Bytes of optimizer state held (moments, scales and step counters)."""
        return sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor))
