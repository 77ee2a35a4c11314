"""Fused kernels for the torch decoder's decode step: Triton on CUDA, PyTorch everywhere else.

A decode step at rollout batch sizes is bound by kernel count, not arithmetic: written with plain
PyTorch ops a Qwen2.5-0.5B step launches ~1,100 kernels (an RMSNorm alone is eight), which costs
more than reading the weights. These kernels bring a transformer block to about ten launches:

- ``add_rms_norm``: residual add + RMSNorm (one read of x and delta, one write each of x and h);
- ``rope_attention``: q/k RMSNorm (Qwen3), rotary embedding of q and k, the K/V cache write, then one
  query token per sequence against the cache: the query heads of a KV head together (grouped-query
  attention without repeating K/V), online softmax over column blocks, the step's own column from
  registers; the attended length is read on the device, so one captured step serves every length;
  with ``ATTENTION_SPLITS`` > 1 the columns are split between that many programs per (sequence, KV
  head), and the last of them to finish combines their partial softmaxes (flash-decoding);
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
                         attn_bias: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    """q (b, heads, hd) against keys/values (b, kv_heads, >=L, hd) over the columns up to and including
    ``column`` (1,) (the decode step's own) of the first L = attn_bias.shape[1], attn_bias (b, L)
    additive. Returns (b, heads * hd)."""
    b, heads, head_dim = q.shape
    kv_heads, length = keys.shape[1], attn_bias.shape[1]
    # Masked rather than sliced: the column lives on the device (no host read).
    later = torch.arange(length, device=attn_bias.device) > column
    attn_bias = attn_bias.masked_fill(later, float("-inf"))
    # The query heads that share a KV head are laid out as that head's "query rows", so plain
    # attention serves grouped-query attention without repeating K/V.
    grouped = q.unflatten(1, (kv_heads, heads // kv_heads))
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, keys[:, :, :length], values[:, :, :length], attn_mask=attn_bias[:, None, None, :])
    return out.flatten(1)


def rope_attention_ref(qkv, positions, cos_table, sin_table, q_norm, k_norm, eps, keys, values, column, attn_bias,
                       n_heads: int, n_kv_heads: int, head_dim: int, prompt=None) -> torch.Tensor:
    """The decode step's attention from its fused projection: ``rope_to_cache_ref`` (the step's K/V into
    the cache at ``column``), then ``decode_attention_ref`` over the columns up to ``column``.

    ``prompt`` (prompt keys, prompt values, prompt_of, length): the first ``length`` columns of every
    sequence are its prompt's, held once per prompt in prompt keys/values (P, kv_heads, length, hd),
    sequence i's at row ``prompt_of[i]``; ``keys``/``values`` then hold the columns from ``length`` on
    (column c at c - length), where the step's own K/V go."""
    if prompt is None:
        q = rope_to_cache_ref(qkv, positions, cos_table, sin_table, q_norm, k_norm, eps, keys, values, column,
                              n_heads, n_kv_heads, head_dim)
        return decode_attention_ref(q, keys, values, attn_bias, column)
    prompt_keys, prompt_values, prompt_of, length = prompt
    q = rope_to_cache_ref(qkv, positions, cos_table, sin_table, q_norm, k_norm, eps, keys, values, column - length,
                          n_heads, n_kv_heads, head_dim)
    return decode_attention_ref(q, torch.cat([prompt_keys[prompt_of], keys], dim=2),
                                torch.cat([prompt_values[prompt_of], values], dim=2), attn_bias, column)


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

# rope_attention's launch: columns per block of its online softmax, warps and pipeline stages per program
# (the best of a sweep on an H100 at the Qwen2.5-0.5B and -1.5B shapes: bench/decode_step.py --parts attention).
ATTENTION_BLOCK_N = 64
ATTENTION_WARPS = 4
ATTENTION_STAGES = 2
# Programs per (sequence, KV head), each over its own share of the columns (flash-decoding): one per
# pair leaves a 256-sequence batch of a 2-KV-head model at 512 programs, each reading its columns
# serially; more split the read and the last to finish combines the partial softmaxes.
ATTENTION_SPLITS = 1
# 1: a rollout's prompts are kept once in the KV cache, not once per sample (rope_attention's prompt
# cache); 0: every sequence holds its prompt's columns (the layout before, for comparison).
DECODE_SHARED_PROMPTS = 1
# Programs the sampler's first kernel aims for (rows x vocabulary slices, at most 64 slices of one or more
# 4,096-logit blocks): fewer programs mean longer slices, which the second kernel scans serially in the row
# it samples. At 256 rows of a 152k vocabulary, 16384 gives 38 slices of one block; 2048 gave 8 slices of 5
# blocks, and the 0.5B rollout ran at 131.6k against 142.6k tokens/s (H100, bench/decode_step.py).
SAMPLE_PROGRAMS = 16384

_split_counters: dict = {}


def _arrival_counters(device, count: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (sequence, KV head), kept across calls: the last program of a
    pair to arrive combines the pair's partial results and resets its counter to 0 for the next."""
    counters = _split_counters.get(device)
    if counters is None or counters.numel() < count:
        counters = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _split_counters[device] = counters
    return counters

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


def rope_attention(qkv, positions, cos_table, sin_table, q_norm, k_norm, eps, keys, values, column, attn_bias,
                   n_heads: int, n_kv_heads: int, head_dim: int, prompt=None):
    """``rope_attention_ref`` in one kernel: each (sequence, KV head) program rotates its query heads and
    its key in registers, writes the key and value to the cache, and attends the earlier columns from
    the cache (a prompt's columns from its prompt's rows, with ``prompt``) and its own from registers.
    Returns (b, heads * hd)."""
    if not triton_enabled(qkv):
        return rope_attention_ref(qkv, positions, cos_table, sin_table, q_norm, k_norm, eps, keys, values, column,
                                  attn_bias, n_heads, n_kv_heads, head_dim, prompt)
    if prompt is not None:
        prompt_keys, prompt_values, prompt_of, prompt_length = prompt
        if prompt_keys.stride(2) != keys.stride(2) or prompt_keys.stride() != prompt_values.stride():
            raise ValueError("the prompt cache and the cache must both be (rows, kv_heads, columns, head_dim) "
                             "with contiguous columns")
    else:
        prompt_keys, prompt_values, prompt_of, prompt_length = keys, values, positions, 0
    b = qkv.shape[0]
    group = n_heads // n_kv_heads
    block_g = max(16, triton.next_power_of_2(group))
    out = torch.empty((b, n_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    has_norm = q_norm is not None
    splits = max(1, ATTENTION_SPLITS)
    if splits > 1:
        # per (sequence, KV head, split): the running output (GROUP, HD), then its max and sum per query head
        partial = torch.empty((b * n_kv_heads * splits, group * (head_dim + 2)), dtype=torch.float32,
                              device=qkv.device)
        counters = _arrival_counters(qkv.device, b * n_kv_heads)
    else:
        partial = counters = out
    _rope_attention_kernel[(b, n_kv_heads, splits)](
        qkv, positions, cos_table, sin_table, q_norm if has_norm else qkv, k_norm if has_norm else qkv, eps,
        keys, values, attn_bias, out, partial, counters, column, attn_bias.shape[1], qkv.stride(0),
        attn_bias.stride(0), keys.stride(0), keys.stride(1), keys.stride(2), head_dim ** -0.5,
        prompt_keys, prompt_values, prompt_of, prompt_length, prompt_keys.stride(0), prompt_keys.stride(1),
        N_HEADS=n_heads, GROUP=group, HD=head_dim, BLOCK_G=block_g,
        HALF_BLOCK=max(16, triton.next_power_of_2(head_dim // 2)), BLOCK_N=ATTENTION_BLOCK_N, HAS_NORM=has_norm,
        SPLITS=splits, HAS_PROMPT=prompt is not None, num_warps=ATTENTION_WARPS, num_stages=ATTENTION_STAGES)
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
    splits = max(1, min(64, triton.cdiv(SAMPLE_PROGRAMS, rows), triton.cdiv(vocab, 4096)))
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
    def _silu_mul_kernel(gu_ptr, out_ptr, inner, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inner
        gate = tl.load(gu_ptr + row * 2 * inner + cols, mask=mask, other=0.0)
        up = tl.load(gu_ptr + row * 2 * inner + inner + cols, mask=mask, other=0.0)
        gf = gate.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(gate.dtype)
        tl.store(out_ptr + row * inner + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)

    @triton.jit
    def _head_norm_rows(x1, x2, w_ptr, offs, mask, eps, HD: tl.constexpr):
        """RMSNorm over head_dim (Qwen3's q/k norms) for a block of heads, one per row, each held as its
        two rotary halves (rows, HD/2); rounded as the HF module rounds (normalise in fp32, cast, scale)."""
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        variance = (tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)) / HD
        scale = tl.rsqrt(variance + eps)[:, None]
        w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HD // 2 + offs, mask=mask, other=0.0).to(tl.float32)[None, :]
        y1 = (w1 * (x1f * scale).to(x1.dtype).to(tl.float32)).to(x1.dtype)
        y2 = (w2 * (x2f * scale).to(x2.dtype).to(tl.float32)).to(x2.dtype)
        return y1, y2

    @triton.jit
    def _rotate_rows(x1, x2, cos, sin):
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        return (x1f * cos - x2f * sin).to(x1.dtype), (x2f * cos + x1f * sin).to(x1.dtype)

    # Integer arguments are specialised by value class (== 1, divisible by 16), so one that changes
    # between calls can trigger a compile mid-rollout. The cache width and bias stride may, the cache
    # strides must not: their divisibility is what lets Triton vectorise the K/V loads (unspecialised,
    # the earlier attention kernel was 2.5x slower).
    @triton.jit(do_not_specialize=["columns", "bias_stride", "prompt_length"])
    def _rope_attention_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, eps, k_ptr, v_ptr, bias_ptr,
                               out_ptr, partial_ptr, count_ptr, col_ptr, columns, qkv_stride, bias_stride, row_stride,
                               head_stride, col_stride, scale, pk_ptr, pv_ptr, prompt_of_ptr, prompt_length,
                               prompt_row_stride, prompt_head_stride, N_HEADS: tl.constexpr, GROUP: tl.constexpr,
                               HD: tl.constexpr, BLOCK_G: tl.constexpr, HALF_BLOCK: tl.constexpr,
                               BLOCK_N: tl.constexpr, HAS_NORM: tl.constexpr, SPLITS: tl.constexpr,
                               HAS_PROMPT: tl.constexpr):
        """One program per (sequence, KV head, split of the columns). Vectors are kept as their two rotary
        halves, so that the rotation needs no shuffle: scores are q1.k1 + q2.k2 and the output is written
        half by half. Split 0 writes the step's K/V and attends its own column from registers. With
        HAS_PROMPT the columns before ``prompt_length`` are read from the sequence's prompt's rows of the
        prompt cache (shared by the prompt's samples, so their reads of it meet in L2), the later ones
        from the sequence's own rows at column - prompt_length."""
        row = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        first = split == 0
        half: tl.constexpr = HD // 2
        g = tl.arange(0, BLOCK_G)
        h = tl.arange(0, HALF_BLOCK)
        n = tl.arange(0, BLOCK_N)
        g_mask, h_mask = g < GROUP, h < half
        column = tl.load(col_ptr).to(tl.int32)
        pos = tl.load(pos_ptr + row)
        cos = tl.load(cos_ptr + pos * HD + h, mask=h_mask, other=0.0).to(tl.float32)[None, :]
        sin = tl.load(sin_ptr + pos * HD + h, mask=h_mask, other=0.0).to(tl.float32)[None, :]
        src = qkv_ptr + row * qkv_stride
        q_at = src + (kv_head * GROUP + g[:, None]) * HD + h[None, :]
        q_mask = g_mask[:, None] & h_mask[None, :]
        q1 = tl.load(q_at, mask=q_mask, other=0.0)
        q2 = tl.load(q_at + half, mask=q_mask, other=0.0)
        k_at = src + (N_HEADS + kv_head) * HD + h[None, :]
        v_at = src + (N_HEADS + tl.num_programs(1) + kv_head) * HD + h[None, :]
        k1 = tl.load(k_at, mask=h_mask[None, :], other=0.0)
        k2 = tl.load(k_at + half, mask=h_mask[None, :], other=0.0)
        v1 = tl.load(v_at, mask=h_mask[None, :], other=0.0)
        v2 = tl.load(v_at + half, mask=h_mask[None, :], other=0.0)
        if HAS_NORM:
            q1, q2 = _head_norm_rows(q1, q2, qn_ptr, h, h_mask, eps, HD)
            k1, k2 = _head_norm_rows(k1, k2, kn_ptr, h, h_mask, eps, HD)
        q1, q2 = _rotate_rows(q1, q2, cos, sin)
        k1, k2 = _rotate_rows(k1, k2, cos, sin)
        base = row * row_stride + kv_head * head_stride
        if HAS_PROMPT:
            prompt_base = tl.load(prompt_of_ptr + row).to(tl.int64) * prompt_row_stride + kv_head * prompt_head_stride
        here = base + (column - prompt_length) * col_stride + h[None, :]
        own_mask = h_mask[None, :] & (h[None, :] * 0 + split == 0)  # a block, not scalar & block: the interpreter
        tl.store(k_ptr + here, k1, mask=own_mask)
        tl.store(k_ptr + here + half, k2, mask=own_mask)
        tl.store(v_ptr + here, v1, mask=own_mask)
        tl.store(v_ptr + here + half, v2, mask=own_mask)
        # The step's own column, from registers (this program's stores are not yet visible to its loads).
        own_bias = tl.load(bias_ptr + row * bias_stride + column).to(tl.float32)
        own = (tl.sum(q1.to(tl.float32) * k1.to(tl.float32), axis=1)
               + tl.sum(q2.to(tl.float32) * k2.to(tl.float32), axis=1)) * scale + own_bias
        best = tl.where(first, own, float("-inf"))
        seen = tl.where(best == float("-inf"), 0.0, 1.0)
        total = seen
        acc1 = seen[:, None] * v1.to(tl.float32)
        acc2 = seen[:, None] * v2.to(tl.float32)
        # This split's columns: a whole number of blocks each, the last split's share possibly shorter.
        length = tl.minimum(column, columns)
        share = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
        lo = split * share
        hi = tl.minimum(lo + share, length)
        bias_row = bias_ptr + row * bias_stride
        # The bias block is read one iteration ahead: a block of it is 2 bytes per thread, too small for
        # the asynchronous copies that pipeline the K/V blocks, so read in place it stalls every iteration.
        # (H100, Qwen2.5 shapes: 17.75 against 18.23 µs a layer at 0.5B, 29.99 against 30.36 at 1.5B.)
        bias_next = tl.load(bias_row + lo + n, mask=lo + n < hi, other=float("-inf"))
        for start in range(lo, hi, BLOCK_N):
            cols = start + n
            c_mask = cols < hi
            kv_mask = c_mask[:, None] & h_mask[None, :]
            # (not k_at/v_at: those name the step's own key and value above, and a name assigned in the
            # loop with another shape is a loop-carried variable whose type changes, which Triton refuses)
            if HAS_PROMPT:
                in_prompt = (cols < prompt_length)[:, None]
                own_at = base + (cols[:, None] - prompt_length) * col_stride + h[None, :]
                shared_at = prompt_base + cols[:, None] * col_stride + h[None, :]
                block_k = tl.where(in_prompt, pk_ptr + shared_at, k_ptr + own_at)
                block_v = tl.where(in_prompt, pv_ptr + shared_at, v_ptr + own_at)
            else:
                at = base + cols[:, None] * col_stride + h[None, :]
                block_k = k_ptr + at
                block_v = v_ptr + at
            bias = bias_next.to(tl.float32)
            bias_next = tl.load(bias_row + cols + BLOCK_N, mask=cols + BLOCK_N < hi, other=float("-inf"))
            c1 = tl.load(block_k, mask=kv_mask, other=0.0)
            c2 = tl.load(block_k + half, mask=kv_mask, other=0.0)
            scores = (tl.dot(q1, tl.trans(c1)) + tl.dot(q2, tl.trans(c2))).to(tl.float32) * scale + bias[None, :]
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            # Rows that have seen only masked columns keep -inf; exp(-inf - -inf) would be NaN.
            safe = tl.where(new_best == float("-inf"), 0.0, new_best)
            weights = tl.exp(scores - safe[:, None])
            rescale = tl.exp(best - safe)
            total = total * rescale + tl.sum(weights, axis=1)
            w = weights.to(c1.dtype)
            d1 = tl.load(block_v, mask=kv_mask, other=0.0)
            d2 = tl.load(block_v + half, mask=kv_mask, other=0.0)
            acc1 = acc1 * rescale[:, None] + tl.dot(w, d1).to(tl.float32)
            acc2 = acc2 * rescale[:, None] + tl.dot(w, d2).to(tl.float32)
            best = new_best
        out_at = out_ptr + (row * N_HEADS + kv_head * GROUP + g[:, None]) * HD + h[None, :]
        if SPLITS == 1:
            tl.store(out_at, (acc1 / total[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)
            tl.store(out_at + half, (acc2 / total[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)
        else:
            pair = row * tl.num_programs(1) + kv_head
            width: tl.constexpr = GROUP * (HD + 2)
            mine = partial_ptr + (pair * SPLITS + split) * width
            part_at = g[:, None] * HD + h[None, :]
            tl.store(mine + part_at, acc1, mask=q_mask)
            tl.store(mine + part_at + half, acc2, mask=q_mask)
            tl.store(mine + GROUP * HD + g, best, mask=g_mask)
            tl.store(mine + GROUP * HD + GROUP + g, total, mask=g_mask)
            # acq_rel: the stores above are visible to whichever program arrives last, and that program
            # sees every other split's.
            arrived = tl.atomic_add(count_ptr + pair, 1, sem="acq_rel")
            if arrived == SPLITS - 1:
                pair_at = partial_ptr + pair * SPLITS * width
                top = tl.full([BLOCK_G], float("-inf"), tl.float32)
                for s in tl.static_range(SPLITS):
                    top = tl.maximum(top, tl.load(pair_at + s * width + GROUP * HD + g, mask=g_mask,
                                                  other=float("-inf"), volatile=True))
                safe = tl.where(top == float("-inf"), 0.0, top)
                sum_all = tl.zeros([BLOCK_G], tl.float32)
                out1 = tl.zeros([BLOCK_G, HALF_BLOCK], tl.float32)
                out2 = tl.zeros([BLOCK_G, HALF_BLOCK], tl.float32)
                for s in tl.static_range(SPLITS):
                    at_s = pair_at + s * width
                    factor = tl.exp(tl.load(at_s + GROUP * HD + g, mask=g_mask, other=float("-inf"),
                                            volatile=True) - safe)
                    sum_all += factor * tl.load(at_s + GROUP * HD + GROUP + g, mask=g_mask, other=0.0,
                                                volatile=True)
                    out1 += factor[:, None] * tl.load(at_s + part_at, mask=q_mask, other=0.0, volatile=True)
                    out2 += factor[:, None] * tl.load(at_s + part_at + half, mask=q_mask, other=0.0, volatile=True)
                tl.store(out_at, (out1 / sum_all[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)
                tl.store(out_at + half, (out2 / sum_all[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)
                tl.atomic_xchg(count_ptr + pair, 0)

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
