"""Fused kernels for the torch decoder's decode step: Triton on CUDA, PyTorch everywhere else.

A decode step at rollout batch sizes is bound by kernel count, not arithmetic: written with plain
PyTorch ops a Qwen2.5-0.5B step launches ~1,100 kernels (an RMSNorm alone is eight), which costs
more than reading the weights. These kernels bring a transformer block to about ten launches:

- ``add_rms_norm``: residual add + RMSNorm (one read of x and delta, one write each of x and h);
- ``rope_to_cache``: q/k RMSNorm (Qwen3), rotary embedding of q and k, and the K/V cache write;
- ``decode_attention``: one query token per sequence against the cache, the query heads of a KV
  head together (grouped-query attention without repeating K/V), online softmax over column blocks;
- ``silu_mul``: the SwiGLU activation on the fused gate/up projection;
- ``sample_and_record``: temperature sampling (inverse CDF: one Philox uniform per row) or greedy
  choice, the chosen token's log-prob under log_softmax(logits / T) by an online log-sum-exp, and
  the step's bookkeeping (output write, EOS check, next token and position), in two kernels: the
  first reduces vocabulary slices to their max and mass (and greedy's argmax), the second picks the
  slice that holds the uniform's share of the total mass and scans only that slice, so the (batch,
  vocab) logits are read about once and never copied to fp32.

Every kernel has a PyTorch reference with the same signature; the CPU path runs the references, and
the tests check each kernel against its reference (through Triton's interpreter where no GPU exists).
Rounding follows the HF modules (RMSNorm normalises in fp32, casts, then scales by the weight).
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references below serve
    triton = None


def triton_enabled(t: torch.Tensor) -> bool:
    """Whether ``t``'s device runs the Triton kernels (CUDA, or any device under TRITON_INTERPRET=1)."""
    if triton is None or os.environ.get("KFRL_DISABLE_TRITON") == "1":
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


# --- references ---------------------------------------------------------------------------------------

def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def add_rms_norm_ref(x, delta, weight, eps):
    if delta is not None:
        x = x + delta
    return x, rms_norm_ref(x, weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def split_rotated_qkv(qkv, cos, sin, q_norm, k_norm, eps, n_heads: int, n_kv_heads: int, head_dim: int):
    """qkv (..., (heads + 2 kv_heads) * hd) → q (..., heads, hd), k and v (..., kv_heads, hd), with the
    q/k norms (Qwen3) and the rotary embedding applied; cos/sin broadcast as (..., 1, hd)."""
    q, k, v = qkv.split((n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim), dim=-1)
    q = q.unflatten(-1, (n_heads, head_dim))
    k = k.unflatten(-1, (n_kv_heads, head_dim))
    v = v.unflatten(-1, (n_kv_heads, head_dim))
    if q_norm is not None:
        q, k = rms_norm_ref(q, q_norm, eps), rms_norm_ref(k, k_norm, eps)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def rope_to_cache_ref(qkv, positions, cos_table, sin_table, q_norm, k_norm, eps, keys, values, column,
                      n_heads: int, n_kv_heads: int, head_dim: int):
    """qkv (b, (heads + 2 kv_heads) * hd) → q (b, heads, hd) rotated; k rotated and v written into
    keys/values (b, kv_heads, columns, hd) at ``column`` (1,)."""
    cos, sin = cos_table[positions].unsqueeze(-2), sin_table[positions].unsqueeze(-2)
    q, k, v = split_rotated_qkv(qkv, cos, sin, q_norm, k_norm, eps, n_heads, n_kv_heads, head_dim)
    keys.index_copy_(2, column, k.unsqueeze(2))
    values.index_copy_(2, column, v.unsqueeze(2))
    return q


def decode_attention_ref(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         attn_bias: torch.Tensor) -> torch.Tensor:
    """q (b, heads, hd) against keys/values (b, kv_heads, >=L, hd) over the first L = attn_bias.shape[1]
    columns, attn_bias (b, L) additive. Returns (b, heads * hd)."""
    b, heads, head_dim = q.shape
    kv_heads, length = keys.shape[1], attn_bias.shape[1]
    # The query heads that share a KV head are laid out as that head's "query rows", so plain
    # attention serves grouped-query attention without repeating K/V.
    grouped = q.unflatten(1, (kv_heads, heads // kv_heads))
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, keys[:, :, :length], values[:, :, :length], attn_mask=attn_bias[:, None, None, :])
    return out.flatten(1)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def record_ref(new_tokens, new_logprobs, finished, sequence, tokens, positions, eos_table, out_tokens,
               out_logprobs, column, longest: int, pad_id: int) -> None:
    """The step's bookkeeping: finished rows emit padding; outputs go to each slot's output row."""
    rows = new_tokens.shape[0]
    new_tokens = torch.where(finished, pad_id, new_tokens)
    new_logprobs = torch.where(finished, 0.0, new_logprobs)
    out_column = (column - longest + 1).expand(rows)
    out_tokens.index_put_((sequence, out_column), new_tokens)
    out_logprobs.index_put_((sequence, out_column), new_logprobs)
    finished |= eos_table[new_tokens]
    tokens.copy_(new_tokens)
    positions += 1


# --- dispatch -----------------------------------------------------------------------------------------

def add_rms_norm(x, delta, weight, eps):
    """(x + delta, rms_norm(x + delta) * weight) for x (b, hidden); delta None = no residual add.
    The Triton path updates x in place."""
    if not triton_enabled(x):
        return add_rms_norm_ref(x, delta, weight, eps)
    rows, hidden = x.shape
    out = torch.empty_like(x)
    _rms_norm_kernel[(rows,)](x, delta if delta is not None else x, weight, out, hidden, eps,
                              HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(hidden))
    return x, out


def rope_to_cache(qkv, positions, cos_table, sin_table, q_norm, k_norm, eps, keys, values, column,
                  n_heads: int, n_kv_heads: int, head_dim: int):
    if not triton_enabled(qkv):
        return rope_to_cache_ref(qkv, positions, cos_table, sin_table, q_norm, k_norm, eps, keys, values, column,
                                 n_heads, n_kv_heads, head_dim)
    rows = qkv.shape[0]
    q = torch.empty((rows, n_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    has_norm = q_norm is not None
    _rope_cache_kernel[(rows, n_heads + 2 * n_kv_heads)](
        qkv, positions, cos_table, sin_table, q_norm if has_norm else qkv, k_norm if has_norm else qkv, eps,
        q, keys, values, column, qkv.stride(0), keys.stride(0), keys.stride(1), keys.stride(2),
        N_HEADS=n_heads, N_KV=n_kv_heads, HD=head_dim, HALF_BLOCK=triton.next_power_of_2(head_dim // 2),
        HAS_NORM=has_norm)
    return q


def decode_attention(q, keys, values, attn_bias):
    if not triton_enabled(q):
        return decode_attention_ref(q, keys, values, attn_bias)
    b, heads, head_dim = q.shape
    kv_heads, length = keys.shape[1], attn_bias.shape[1]
    group = heads // kv_heads
    out = torch.empty((b, heads, head_dim), dtype=q.dtype, device=q.device)
    _decode_attention_kernel[(b, kv_heads)](
        q, keys, values, attn_bias, out, length, attn_bias.stride(0), keys.stride(0), keys.stride(1), keys.stride(2),
        head_dim ** -0.5, GROUP=group, HD=head_dim, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_N=64)
    return out.flatten(1)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if not triton_enabled(gate_up):
        return silu_mul_ref(gate_up)
    rows, width = gate_up.shape
    inner = width // 2
    out = torch.empty((rows, inner), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(inner, block))](gate_up, out, inner, BLOCK=block)
    return out


def sample_and_record(logits, *, temperature: float, greedy: bool, seed: torch.Tensor, finished, sequence,
                      tokens, positions, eos_table, out_tokens, out_logprobs, column, longest: int,
                      pad_id: int) -> None:
    """Plain temperature sampling (no top-k/top-p) or greedy choice, plus ``record_ref``'s bookkeeping.
    ``seed`` (1,) int64 on the device; the noise of step c uses seed + c, so one seed gives one sequence
    of samples. Triton only (the caller falls back to sample_tokens + record_ref).

    Two kernels: the vocabulary is split into slices so that enough programs run (one program per
    row would leave most of the GPU idle on a 152k vocabulary); each slice reports its max, its sum
    of exponentials and its best candidate, and a second kernel combines them per row."""
    rows, vocab = logits.shape
    splits = max(1, min(64, triton.cdiv(2048, rows), triton.cdiv(vocab, 4096)))
    block = 4096
    slice_size = triton.cdiv(triton.cdiv(vocab, splits), block) * block
    partial = torch.empty((2, rows, splits), dtype=torch.float32, device=logits.device)
    partial_index = torch.empty((rows, splits), dtype=torch.int32, device=logits.device)
    inv_temp = 1.0 if greedy else 1.0 / temperature
    _sample_partial_kernel[(rows, splits)](logits, vocab, slice_size, inv_temp, partial, partial_index, splits,
                                           GREEDY=greedy, BLOCK=block, num_warps=8)
    _sample_combine_kernel[(rows,)](
        logits, vocab, slice_size, inv_temp, seed, partial, partial_index, splits, rows, column, finished, sequence,
        tokens, positions, eos_table, out_tokens, out_logprobs, out_tokens.stride(0), longest, pad_id, GREEDY=greedy,
        BLOCK_S=triton.next_power_of_2(splits), BLOCK=block, num_warps=8)


# --- Triton kernels -----------------------------------------------------------------------------------

if triton is not None:
    @triton.jit
    def _rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, n_cols, eps, HAS_DELTA: tl.constexpr,
                         BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
        if HAS_DELTA:
            d = tl.load(delta_ptr + row * n_cols + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(x_ptr + row * n_cols + cols, x, mask=mask)
        xf = x.to(tl.float32)
        variance = tl.sum(xf * xf, axis=0) / n_cols
        normed = (xf * tl.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(out_ptr + row * n_cols + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
                 mask=mask)

    @triton.jit
    def _head_norm(x1, x2, w_ptr, offs, mask, eps, HD: tl.constexpr):
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        variance = (tl.sum(x1f * x1f, axis=0) + tl.sum(x2f * x2f, axis=0)) / HD
        scale = tl.rsqrt(variance + eps)
        w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HD // 2 + offs, mask=mask, other=0.0).to(tl.float32)
        y1 = (w1 * (x1f * scale).to(x1.dtype).to(tl.float32)).to(x1.dtype)
        y2 = (w2 * (x2f * scale).to(x2.dtype).to(tl.float32)).to(x2.dtype)
        return y1, y2

    @triton.jit
    def _rope_cache_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, eps, q_ptr, k_ptr, v_ptr,
                           col_ptr, qkv_stride, cache_row_stride, cache_head_stride, cache_col_stride,
                           N_HEADS: tl.constexpr, N_KV: tl.constexpr, HD: tl.constexpr,
                           HALF_BLOCK: tl.constexpr, HAS_NORM: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        half: tl.constexpr = HD // 2
        offs = tl.arange(0, HALF_BLOCK)
        mask = offs < half
        src = qkv_ptr + row * qkv_stride + head * HD
        x1 = tl.load(src + offs, mask=mask, other=0.0)
        x2 = tl.load(src + half + offs, mask=mask, other=0.0)
        column = tl.load(col_ptr)
        if head < N_HEADS + N_KV:
            if HAS_NORM:
                if head < N_HEADS:
                    x1, x2 = _head_norm(x1, x2, qn_ptr, offs, mask, eps, HD)
                else:
                    x1, x2 = _head_norm(x1, x2, kn_ptr, offs, mask, eps, HD)
            pos = tl.load(pos_ptr + row)
            cos = tl.load(cos_ptr + pos * HD + offs, mask=mask, other=0.0).to(tl.float32)
            sin = tl.load(sin_ptr + pos * HD + offs, mask=mask, other=0.0).to(tl.float32)
            x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
            y1 = (x1f * cos - x2f * sin).to(x1.dtype)
            y2 = (x2f * cos + x1f * sin).to(x1.dtype)
            if head < N_HEADS:
                dst = q_ptr + (row * N_HEADS + head) * HD
            else:
                dst = (k_ptr + row * cache_row_stride + (head - N_HEADS) * cache_head_stride
                       + column * cache_col_stride)
            tl.store(dst + offs, y1, mask=mask)
            tl.store(dst + half + offs, y2, mask=mask)
        else:
            dst = (v_ptr + row * cache_row_stride + (head - N_HEADS - N_KV) * cache_head_stride
                   + column * cache_col_stride)
            tl.store(dst + offs, x1, mask=mask)
            tl.store(dst + half + offs, x2, mask=mask)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, inner, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inner
        gate = tl.load(gu_ptr + row * 2 * inner + cols, mask=mask, other=0.0)
        up = tl.load(gu_ptr + row * 2 * inner + inner + cols, mask=mask, other=0.0)
        gf = gate.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(gate.dtype)
        tl.store(out_ptr + row * inner + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)

    # Integer arguments are specialised by value class (== 1, divisible by 16), so one that changes
    # between calls can trigger a compile mid-rollout. The lengths may, the cache strides must not:
    # their divisibility is what lets Triton vectorise the K/V loads (unspecialised: 2.5x slower).
    @triton.jit(do_not_specialize=["length", "bias_stride"])
    def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, bias_ptr, out_ptr, length, bias_stride, row_stride, head_stride,
                                 col_stride, scale, GROUP: tl.constexpr, HD: tl.constexpr, BLOCK_G: tl.constexpr,
                                 BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
        """One program per (sequence, KV head): its GROUP query heads against the cached columns,
        with an online softmax over blocks of BLOCK_N columns (flash-decoding without the split)."""
        row = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        g_mask, d_mask = g < GROUP, d < HD
        q_rows = q_ptr + (row * GROUP * tl.num_programs(1) + kv_head * GROUP + g[:, None]) * HD + d[None, :]
        q = tl.load(q_rows, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        kv_base = row * row_stride + kv_head * head_stride
        best = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        total = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
        for start in range(0, length, BLOCK_N):
            cols = start + n
            c_mask = cols < length
            offsets = kv_base + cols[:, None] * col_stride + d[None, :]
            kv_mask = c_mask[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + offsets, mask=kv_mask, other=0.0)
            bias = tl.load(bias_ptr + row * bias_stride + cols, mask=c_mask, other=float("-inf")).to(tl.float32)
            scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale + bias[None, :]
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            # Rows that have seen only masked columns keep -inf; exp(-inf - -inf) would be NaN.
            safe = tl.where(new_best == float("-inf"), 0.0, new_best)
            weights = tl.exp(scores - safe[:, None])
            rescale = tl.exp(best - safe)
            total = total * rescale + tl.sum(weights, axis=1)
            v = tl.load(v_ptr + offsets, mask=kv_mask, other=0.0)
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v).to(tl.float32)
            best = new_best
        out = acc / total[:, None]
        out_rows = out_ptr + (row * GROUP * tl.num_programs(1) + kv_head * GROUP + g[:, None]) * HD + d[None, :]
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])

    @triton.jit(do_not_specialize=["slice_size", "splits"])
    def _sample_partial_kernel(logits_ptr, vocab, slice_size, inv_temp, partial_ptr, index_ptr, splits,
                               GREEDY: tl.constexpr, BLOCK: tl.constexpr):
        # Per lane, an online max and sum of exponentials (reduced across lanes once, at the end); greedy
        # also keeps each lane's first index of its max.
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        rows = tl.num_programs(0)
        offs = tl.arange(0, BLOCK)
        lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
        lane_sum = tl.zeros([BLOCK], tl.float32)
        lane_index = tl.zeros([BLOCK], tl.int32)
        begin = part * slice_size
        for start in range(begin, begin + slice_size, BLOCK):
            idx = start + offs
            x = tl.load(logits_ptr + row * vocab + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32) * inv_temp
            new_max = tl.maximum(lane_max, x)
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            lane_sum = lane_sum * tl.exp(lane_max - safe) + tl.exp(x - safe)
            if GREEDY:
                lane_index = tl.where(x > lane_max, idx, lane_index)
            lane_max = new_max
        slice_max = tl.max(lane_max, axis=0)
        safe_max = tl.where(slice_max == float("-inf"), 0.0, slice_max)
        at = row * splits + part
        plane = rows * splits
        tl.store(partial_ptr + at, slice_max)
        tl.store(partial_ptr + plane + at, tl.sum(lane_sum * tl.exp(lane_max - safe_max), axis=0))
        if GREEDY:  # the first index holding the slice's max (argmax's tie rule)
            tl.store(index_ptr + at, tl.min(tl.where(lane_max == slice_max, lane_index, 2147483647), axis=0))

    @triton.jit(do_not_specialize=["vocab", "slice_size", "splits", "rows", "out_stride", "longest"])
    def _sample_combine_kernel(logits_ptr, vocab, slice_size, inv_temp, seed_ptr, partial_ptr, index_ptr, splits, rows,
                               col_ptr, finished_ptr, sequence_ptr, tokens_ptr, positions_ptr, eos_table_ptr, out_tok_ptr,
                               out_lp_ptr, out_stride, longest, pad_id, GREEDY: tl.constexpr, BLOCK_S: tl.constexpr,
                               BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        s = tl.arange(0, BLOCK_S)
        mask = s < splits
        plane = rows * splits
        at = row * splits + s
        maxima = tl.load(partial_ptr + at, mask=mask, other=float("-inf"))
        sums = tl.load(partial_ptr + plane + at, mask=mask, other=0.0)
        top = tl.max(maxima, axis=0)
        mass = tl.where(maxima == float("-inf"), 0.0, sums * tl.exp(maxima - top))  # each slice's, scaled by e^-top
        total = tl.sum(mass, axis=0)
        log_norm = top + tl.log(total)
        column = tl.load(col_ptr)
        if GREEDY:
            winner = tl.min(tl.where(maxima == top, s, BLOCK_S), axis=0)
            choice = tl.sum(tl.where(s == winner, tl.load(index_ptr + at, mask=mask, other=0), 0), axis=0).to(tl.int64)
        else:
            # Inverse CDF: one uniform per row; u * total is found first among the slices' masses, then
            # within the slice that holds it by a running sum over its tokens.
            u = tl.rand(tl.load(seed_ptr) + column * 1048576, row)
            target = u * total
            cumulative = tl.cumsum(mass, axis=0)
            picked = tl.min(tl.where((cumulative > target) & (mass > 0), s, BLOCK_S), axis=0)
            last = tl.max(tl.where(mass > 0, s, -1), axis=0)
            picked = tl.where(picked == BLOCK_S, last, picked)  # u * total rounded past the last slice
            remaining = target - tl.sum(tl.where(s < picked, mass, 0.0), axis=0)
            offs = tl.arange(0, BLOCK)
            running = tl.full((), 0.0, tl.float32)
            choice = tl.full((), 2147483647, tl.int64)
            fallback = tl.full((), -1, tl.int64)  # the slice's last token of positive weight
            begin = picked.to(tl.int64) * slice_size
            for start in range(0, slice_size, BLOCK):
                idx = begin + start + offs
                valid = idx < vocab
                x = tl.load(logits_ptr + row * vocab + idx, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
                weights = tl.where(valid, tl.exp(x - top), 0.0)
                crossed = ((running + tl.cumsum(weights, axis=0)) > remaining) & (weights > 0)
                choice = tl.minimum(choice, tl.min(tl.where(crossed, idx, 2147483647), axis=0))
                fallback = tl.maximum(fallback, tl.max(tl.where(weights > 0, idx, -1), axis=0))
                running += tl.sum(weights, axis=0)
            choice = tl.where(choice == 2147483647, fallback, choice)
        logit = tl.load(logits_ptr + row * vocab + choice).to(tl.float32) * inv_temp
        done = tl.load(finished_ptr + row)
        token = tl.where(done, pad_id, choice)
        logprob = tl.where(done, 0.0, logit - log_norm)
        slot = tl.load(sequence_ptr + row) * out_stride + (column - longest + 1)
        tl.store(out_tok_ptr + slot, token)
        tl.store(out_lp_ptr + slot, logprob)
        tl.store(finished_ptr + row, done | tl.load(eos_table_ptr + token))
        tl.store(tokens_ptr + row, token)
        tl.store(positions_ptr + row, tl.load(positions_ptr + row) + 1)
