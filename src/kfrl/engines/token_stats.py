"""Log-probs of the sampled tokens and entropies through the LM head, fused: the (N, V) logits are read
once forward and once backward, in the compute dtype, and never copied to fp32.

The unfused pass (``kfrl.engines.inference._token_stats`` under autograd) casts each chunk of logits to
fp32, divides by the temperature, takes log_softmax, gathers, computes the entropy from a softmax, and
its backward scatters into a zero (N, V) fp32 tensor: about a dozen passes over a tensor with 152k
columns per position, which took half the update's GPU time for a 0.5B model (bench/profile_update.py).

Here, per chunk of positions: forward, logits = h W^T (one GEMM) and one kernel computing, per row,
log-sum-exp, the target's log-prob and the entropy by an online reduction; backward, the logits are
recomputed and one kernel overwrites them with the gradient

    dL/dz_j = g_logp (1[j = target] - p_j) - g_H p_j (z_j - lse + H),   z = logits / T,

scaled by 1/T, which two GEMMs turn into the gradients of h and W. Gradients equal the unfused pass up
to the rounding of the compute dtype (tested). The Triton kernels run on CUDA (and under Triton's
interpreter in the tests); ``*_ref`` are their PyTorch equivalents, used on other devices.
"""
from __future__ import annotations

import torch

from kfrl.engines.kernels import triton, triton_enabled

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _stats_fwd_kernel(logits_ptr, row_stride, targets_ptr, lse_ptr, logp_ptr, ent_ptr, V, inv_t,
                          BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * row_stride
        lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
        lane_sum = tl.zeros([BLOCK], tl.float32)
        lane_zsum = tl.zeros([BLOCK], tl.float32)  # sum of exp(z - max) * z
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            valid = cols < V
            z = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
            new_max = tl.maximum(lane_max, z)
            scale = tl.where(new_max == float("-inf"), 1.0, tl.exp(lane_max - new_max))
            e = tl.where(valid, tl.exp(z - new_max), 0.0)
            lane_sum = lane_sum * scale + e
            lane_zsum = lane_zsum * scale + tl.where(valid, e * z, 0.0)
            lane_max = new_max
        row_max = tl.max(lane_max, axis=0)
        weight = tl.where(lane_max == float("-inf"), 0.0, tl.exp(lane_max - row_max))
        total = tl.sum(lane_sum * weight, axis=0)
        lse = row_max + tl.log(total)
        target = tl.load(targets_ptr + row)
        z_target = tl.load(base + target).to(tl.float32) * inv_t
        tl.store(lse_ptr + row, lse)
        tl.store(logp_ptr + row, z_target - lse)
        tl.store(ent_ptr + row, lse - tl.sum(lane_zsum * weight, axis=0) / total)

    @triton.jit
    def _stats_bwd_kernel(logits_ptr, row_stride, targets_ptr, lse_ptr, ent_ptr, glogp_ptr, gent_ptr, V, inv_t,
                          HAS_ENT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * row_stride
        lse = tl.load(lse_ptr + row)
        g_logp = tl.load(glogp_ptr + row)
        target = tl.load(targets_ptr + row)
        if HAS_ENT:
            g_ent = tl.load(gent_ptr + row)
            shift = tl.load(ent_ptr + row) - lse
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            valid = cols < V
            z = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32) * inv_t
            p = tl.exp(z - lse)
            grad = -g_logp * p
            if HAS_ENT:
                grad -= g_ent * p * (z + shift)
            grad = tl.where(cols == target, grad + g_logp, grad)
            tl.store(base + cols, (grad * inv_t).to(logits_ptr.dtype.element_ty), mask=valid)

BLOCK = 4096


def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def stats_fwd_ref(logits: torch.Tensor, targets: torch.Tensor, inv_t: float):
    """(lse, log-prob of the target, entropy), fp32 (n,) (fp64 from fp64), of softmax(logits * inv_t)."""
    z = logits.to(_at_least_fp32(logits.dtype)) * inv_t
    lse = torch.logsumexp(z, dim=-1)
    p = torch.exp(z - lse[:, None])
    return lse, z.gather(-1, targets[:, None]).squeeze(-1) - lse, lse - (p * z).sum(-1)


def stats_bwd_ref(logits: torch.Tensor, targets: torch.Tensor, lse, entropy, g_logp, g_ent, inv_t: float) -> None:
    """Overwrites ``logits`` with dL/dlogits (see the module docstring)."""
    z = logits.to(_at_least_fp32(logits.dtype)) * inv_t
    p = torch.exp(z - lse[:, None])
    grad = -g_logp[:, None] * p
    if g_ent is not None:
        grad -= g_ent[:, None] * p * (z - lse[:, None] + entropy[:, None])
    grad.scatter_add_(-1, targets[:, None], g_logp[:, None])
    logits.copy_(grad * inv_t)


def _fwd(logits, targets, inv_t):
    if not triton_enabled(logits):
        return stats_fwd_ref(logits, targets, inv_t)
    rows = logits.shape[0]
    lse, logp, ent = (torch.empty(rows, device=logits.device, dtype=torch.float32) for _ in range(3))
    if rows:
        _stats_fwd_kernel[(rows,)](logits, logits.stride(0), targets, lse, logp, ent, logits.shape[1], inv_t,
                                   BLOCK=BLOCK, num_warps=8)
    return lse, logp, ent


def _bwd(logits, targets, lse, entropy, g_logp, g_ent, inv_t) -> None:
    if not triton_enabled(logits):
        return stats_bwd_ref(logits, targets, lse, entropy, g_logp, g_ent, inv_t)
    if logits.shape[0]:
        _stats_bwd_kernel[(logits.shape[0],)](
            logits, logits.stride(0), targets, lse, entropy, g_logp, g_ent if g_ent is not None else g_logp,
            logits.shape[1], inv_t, HAS_ENT=g_ent is not None, BLOCK=BLOCK, num_warps=8)


class _LinearTokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_t: float, dtype, chunk: int):
        w = weight.to(dtype)
        parts = []
        for start in range(0, hidden.shape[0], chunk):
            logits = hidden[start:start + chunk].to(dtype) @ w.t()
            parts.append(_fwd(logits, targets[start:start + chunk], inv_t))
        lse, logp, entropy = (torch.cat([p[k] for p in parts]) for k in range(3))
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.inv_t, ctx.dtype, ctx.chunk = inv_t, dtype, chunk
        ctx.into_grad = weight if accumulates_into_grad(weight) else None
        ctx.mark_non_differentiable(lse)
        return logp, entropy, lse

    @staticmethod
    def backward(ctx, g_logp, g_ent, _g_lse):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        w = weight.to(ctx.dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # The weight's gradient is summed over chunks in place, with no temporary of its size: in the
        # weight's own dtype when the GEMMs run in it (bf16 weights: as autograd sums the chunks of the
        # unfused pass), else in fp32 (fp32 weights, bf16 GEMMs). A temporary the size of the LM head
        # is 0.3-0.9 GB at 0.5B-1.5B, at the peak of the update.
        in_place = weight.dtype == ctx.dtype
        wide = weight.dtype if in_place else _at_least_fp32(weight.dtype)
        grad_weight = None
        into_grad = ctx.into_grad is not None and ctx.needs_input_grad[1] and wide == weight.dtype
        if into_grad:  # straight into the parameter's .grad: see accumulates_into_grad
            if ctx.into_grad.grad is None:
                ctx.into_grad.grad = torch.zeros_like(weight)
            grad_weight = ctx.into_grad.grad
        elif ctx.needs_input_grad[1]:
            grad_weight = torch.zeros_like(weight, dtype=wide)
        g_logp = g_logp.to(lse.dtype).contiguous() if g_logp is not None else torch.zeros_like(lse)
        g_ent = g_ent.to(lse.dtype).contiguous() if g_ent is not None else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            h = hidden[rows].to(ctx.dtype)
            logits = h @ w.t()
            _bwd(logits, targets[rows], lse[rows], entropy[rows], g_logp[rows],
                 g_ent[rows] if g_ent is not None else None, ctx.inv_t)
            if grad_hidden is not None:
                grad_hidden[rows] = (logits @ w).to(hidden.dtype)
            if grad_weight is not None and in_place:
                grad_weight.addmm_(logits.t(), h)
            elif grad_weight is not None:
                grad_weight.add_(logits.t() @ h)  # cast while added: no fp32 copy of the product
        ctx.into_grad = None
        if into_grad:
            grad_weight = None  # already in .grad
        elif grad_weight is not None and not in_place:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def accumulates_into_grad(weight: torch.Tensor) -> bool:
    """Whether the backward adds the weight's gradient straight into ``weight.grad`` instead of handing
    autograd a gradient of the weight's size. A tied LM head (Qwen2.5-0.5B/1.5B) is also the embedding,
    which gets its gradient only at the very end of the backward: autograd holds the LM head's part
    (0.25-0.43 GiB in bf16, twice that in fp32) through the whole transformer body's backward, at the
    update's peak, to sum it with the embedding's. Only for a plain leaf parameter in a single process,
    with no hooks on its gradient: a sharded or hooked parameter (FSDP, DDP) gets its gradient through
    autograd, where its hooks see it."""
    import torch.distributed as dist

    return (isinstance(weight, torch.nn.Parameter) and weight.is_leaf and weight.requires_grad
            and type(weight.data) is torch.Tensor
            and not (dist.is_available() and dist.is_initialized())
            and not getattr(weight, "_backward_hooks", None)
            and not getattr(weight, "_post_accumulate_grad_hooks", None))


def linear_token_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                       dtype: torch.dtype, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs (N,), entropies (N,)) of ``targets`` under softmax((hidden W^T) / temperature), with
    the GEMMs in ``dtype`` over chunks of ``chunk`` rows; differentiable in ``hidden`` and ``weight``."""
    with torch.autocast(hidden.device.type, enabled=False):
        logp, entropy, _ = _LinearTokenStats.apply(hidden.contiguous(), weight, targets.contiguous(),
                                                   1.0 / temperature, dtype, chunk)
    return logp, entropy
