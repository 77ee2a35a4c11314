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

A large tensor is stepped in pieces of ``chunk_size`` values (whole blocks), so the fp32 working
tensors of a step stay a few hundred MB whatever the tensor: stepped whole, the 151936 x 1536
embedding of a 1.5B model needs six fp32 copies of itself (5.6 GB) on top of everything the update
holds, which made the optimizer step the peak of the whole iteration. Blocks are independent, so
the pieces give the same values as one whole step.
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
                 weight_decay: float = 1e-2, block_size: int = 256, min_8bit_size: int = 4096,
                 chunk_size: int = 1 << 24):
        if lr <= 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1 or eps <= 0 or block_size < 1:
            raise ValueError(f"AdamW8bit: invalid lr={lr}, betas={betas}, eps={eps} or block_size={block_size}")
        if chunk_size < block_size or chunk_size % block_size:
            raise ValueError(f"AdamW8bit: chunk_size={chunk_size} must be a multiple of block_size={block_size}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      block_size=block_size, min_8bit_size=min_8bit_size, chunk_size=chunk_size))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                self._update(param, group)
        return loss

    def _update(self, param: torch.Tensor, group: dict) -> None:
        state = self.state[param]
        numel, block = param.numel(), group["block_size"]
        quantized = numel >= group["min_8bit_size"]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            if quantized:
                blocks = -(-numel // block)
                for name in ("exp_avg", "exp_avg_sq"):
                    state[f"{name}_codes"] = torch.zeros((blocks, block), dtype=FP8, device=param.device)
                    state[f"{name}_scale"] = torch.full((blocks,), torch.finfo(torch.float32).tiny / FP8_MAX,
                                                        dtype=torch.float32, device=param.device)
            else:
                state["exp_avg"] = torch.zeros(numel, dtype=torch.float32, device=param.device)
                state["exp_avg_sq"] = torch.zeros(numel, dtype=torch.float32, device=param.device)
        if state["step"].device.type != "cpu":  # moved with the state (offload): read here without a sync
            state["step"] = state["step"].cpu()
        state["step"] += 1
        step = float(state["step"])
        grads = param.grad.detach().reshape(-1)
        if not quantized:
            master = _adamw(param.detach().reshape(-1), grads, state["exp_avg"], state["exp_avg_sq"], group, step)
            param.copy_(master.view_as(param))
            return
        # A view of the parameter's values; a parameter that is not contiguous (not seen) goes through a copy.
        values = param.detach().view(-1) if param.is_contiguous() else param.detach().reshape(-1).clone()
        chunk = group["chunk_size"]
        for start in range(0, numel, chunk):
            end = min(numel, start + chunk)
            rows = slice(start // block, -(-end // block))
            codes, scales = state["exp_avg_codes"][rows], state["exp_avg_scale"][rows]
            sq_codes, sq_scales = state["exp_avg_sq_codes"][rows], state["exp_avg_sq_scale"][rows]
            exp_avg = dequantize(codes, scales, end - start)
            exp_avg_sq = dequantize(sq_codes, sq_scales, end - start).square_()
            master = _adamw(values[start:end], grads[start:end], exp_avg, exp_avg_sq, group, step)
            values[start:end].copy_(master)
            for (codes_out, scales_out), (new_codes, new_scales) in (
                    ((codes, scales), quantize(exp_avg, block)),
                    ((sq_codes, sq_scales), quantize_nonzero(exp_avg_sq.sqrt_(), block))):
                codes_out.copy_(new_codes)
                scales_out.copy_(new_scales)
        if not param.is_contiguous():
            param.copy_(values.view_as(param))

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


def _adamw(values: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
           group: dict, step: int | float) -> torch.Tensor:
    """One decoupled-weight-decay Adam step of flat ``values`` in fp32: updates the fp32 moments in place
    and returns the new values (fp32; ``values`` itself when it is fp32)."""
    beta1, beta2 = group["betas"]
    grads = grads.to(torch.float32)
    exp_avg.lerp_(grads, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grads, grads, value=1 - beta2)
    bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step
    denominator = (exp_avg_sq.sqrt() / bias2 ** 0.5).add_(group["eps"])
    master = values.to(torch.float32)
    master.mul_(1 - group["lr"] * group["weight_decay"])
    return master.addcdiv_(exp_avg, denominator, value=-group["lr"] / bias1)
