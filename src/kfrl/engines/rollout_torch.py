"""The ``torch`` rollout backend: a batched decoder with a static KV cache and CUDA-graph decode steps.

One call generates n samples for each of P prompts (B = P * n sequences):

1. **Prefill** each prompt once (left-padded to the longest prompt, with a causal + padding mask and
   per-row positions), in chunks bounded by a token budget. Its K/V is copied into the cache rows of
   its n samples and its last logits give each sample's first token.
2. **KV cache**: one static tensor (layers, 2, B, kv_heads, P_max + max_new_tokens, head_dim)
   allocated per call. Static rather than paged because a rollout batch is known up front (B
   sequences, at most P_max + R columns each), every sequence lives for the whole call, and fixed
   addresses are what CUDA graphs need; the price is that memory is sized for the longest case,
   which ``rollout.micro_batch_size`` bounds. Left-padding puts token t of every response in the same
   column P_max + t, so one column index serves the whole batch.
3. **Decode**: one step (embedding → blocks → logits → sampling → bookkeeping) per token, captured
   as a CUDA graph per (batch bucket, attended-length bucket) on first use and replayed after. The
   attended length grows in buckets of 64 columns, so early steps do not read the empty cache.
   Sampling (temperature, top-k, top-p, greedy) and the sampled token's log-prob run inside the
   graph; per-step logits are never kept. Tokens and log-probs go straight into (B, R) outputs.
4. **Finished sequences stop costing work**: every few steps the host reads how many sequences are
   still running; when they fit a smaller batch bucket, the running rows are compacted to the front
   of every buffer (cache included) and the smaller bucket's graph takes over. When none is running
   the call ends.

On CPU (or with ``use_cuda_graphs=False``) the same step runs eagerly and compaction is exact.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kfrl.engines import kernels
from kfrl.engines.decoder import Decoder
from kfrl.engines.rollout import Generation, SamplingParams, generations_from_tokens, left_pad
from kfrl.engines.sampling import sample_tokens

LENGTH_BUCKET = 64          # attended columns grow in steps of this many
CHECK_EVERY_GPU = 8         # decode steps between host reads of the running count (each read syncs)
PREFILL_TOKEN_BUDGET = 16384
_BATCH_BUCKETS = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


def batch_buckets(batch: int) -> list[int]:
    """Graph batch sizes for a call of ``batch`` sequences, largest first."""
    return [batch] + [b for b in reversed(_BATCH_BUCKETS) if b < batch]


@dataclass
class _DecodeState:
    """Static buffers of one call; rows are sequence slots (compaction moves sequences between them)."""
    cache: torch.Tensor       # (layers, 2, B, kv_heads, columns, hd)
    attn_bias: torch.Tensor   # (B, columns) additive: 0 visible, -inf not
    tokens: torch.Tensor      # (B,) the token each slot feeds to the next step
    positions: torch.Tensor   # (B,) its rotary position
    finished: torch.Tensor    # (B,) bool
    sequence: torch.Tensor    # (B,) which output row a slot writes (B = the scratch row, for filler slots)
    column: torch.Tensor      # (1,) cache column of this step's token (shared by all slots)
    out_tokens: torch.Tensor  # (B + 1, R)
    out_logprobs: torch.Tensor


_WARMUP_STREAMS: dict = {}


def warmup_stream(device):
    """One side stream per device for the eager warm-up before each capture. A new stream per capture
    would cost memory for good: cuBLAS keeps a workspace (32 MiB on Hopper) for every stream it has run
    on, up to the 32 streams of PyTorch's pool, so resident memory would grow rollout after rollout."""
    import torch

    if device not in _WARMUP_STREAMS:
        _WARMUP_STREAMS[device] = torch.cuda.Stream(device=device)
    return _WARMUP_STREAMS[device]


class TorchRollout:
    name = "torch"

    def __init__(self, decoder: Decoder, eos_ids: set[int], pad_id: int, *, micro_batch_size: int = 0,
                 use_cuda_graphs: bool = True, bucketed: bool | None = None):
        self.decoder = decoder
        self.eos_ids = set(eos_ids)
        self.pad_id = pad_id
        self.micro_batch_size = micro_batch_size
        self.use_cuda_graphs = use_cuda_graphs and decoder.device.type == "cuda"
        # Compaction into fixed batch sizes (needed for graphs; forced on CPU only by tests).
        self.bucketed = self.use_cuda_graphs if bucketed is None else bucketed
        self._eos_table = torch.zeros(decoder.spec.vocab_size, dtype=torch.bool, device=decoder.device)
        self._eos_table[sorted(i for i in self.eos_ids if i < decoder.spec.vocab_size)] = True
        self.stats: dict[str, float] = {}

    @torch.no_grad()
    def generate_responses(self, prompts: list[list[int]], params: SamplingParams, *,
                           seed: int | None = None) -> list[Generation]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("the torch rollout backend needs at least one prompt token per prompt")
        self.stats = {"graphs_captured": 0, "compactions": 0, "decode_steps": 0}
        step = self.micro_batch_size or len(prompts)
        out: list[Generation] = []
        for start in range(0, len(prompts), step):
            if seed is not None:
                torch.manual_seed(seed + start)
            out.extend(self._generate(prompts[start:start + step], params))
        return out

    # --- one batch ---------------------------------------------------------------------------------
    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        dec, device = self.decoder, self.decoder.device
        spec = dec.spec
        n, max_new = params.n, params.max_new_tokens
        batch = len(prompts) * n
        longest = max(len(p) for p in prompts)
        columns = longest + max(max_new - 1, 1)
        dec.rope_tables(longest + max_new)

        def sample(logits):
            return sample_tokens(logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                 greedy=not params.do_sample)

        st = _DecodeState(
            cache=torch.zeros((spec.n_layers, 2, batch, spec.n_kv_heads, columns, spec.head_dim),
                              dtype=dec.dtype, device=device),
            attn_bias=torch.full((batch, columns), float("-inf"), dtype=dec.dtype, device=device),
            tokens=torch.empty(batch, dtype=torch.long, device=device),
            positions=torch.tensor([len(p) for p in prompts], device=device).repeat_interleave(n),
            finished=torch.zeros(batch, dtype=torch.bool, device=device),
            sequence=torch.arange(batch, device=device),
            column=torch.tensor([longest], device=device),
            out_tokens=torch.full((batch + 1, max_new), self.pad_id, dtype=torch.long, device=device),
            out_logprobs=torch.zeros((batch + 1, max_new), dtype=torch.float32, device=device))

        first_logits = self._prefill(prompts, n, longest, st)
        tokens, logprobs = sample(first_logits.repeat_interleave(n, dim=0))
        st.tokens.copy_(tokens)
        st.out_tokens[:batch, 0] = tokens
        st.out_logprobs[:batch, 0] = logprobs
        st.finished.copy_(self._eos_table[tokens])
        del first_logits

        if max_new > 1:
            self._decode(st, batch, max_new, longest, params, sample)
        return generations_from_tokens(st.out_tokens[:batch], st.out_logprobs[:batch], self.eos_ids)

    def _prefill(self, prompts: list[list[int]], n: int, longest: int, st: _DecodeState) -> torch.Tensor:
        """Fills the cache rows and attention bias of every sample; returns the prompts' last logits (P, V)."""
        dec, device = self.decoder, self.decoder.device
        spec = dec.spec
        per_chunk = max(1, PREFILL_TOKEN_BUDGET // longest)
        logits = []
        for start in range(0, len(prompts), per_chunk):
            chunk = prompts[start:start + per_chunk]
            ids, valid = left_pad(chunk, self.pad_id, device, width=longest)
            valid = valid.bool()
            positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
            kv = torch.empty((spec.n_layers, 2, len(chunk), spec.n_kv_heads, longest, spec.head_dim),
                             dtype=dec.dtype, device=device)
            logits.append(dec.prefill(ids, valid, positions, kv))
            rows = slice(start * n, (start + len(chunk)) * n)
            st.cache[:, :, rows, :, :longest] = kv.repeat_interleave(n, dim=2)
            visible = torch.where(valid, 0.0, float("-inf")).to(dec.dtype)
            st.attn_bias[rows, :longest] = visible.repeat_interleave(n, dim=0)
            del kv
        return torch.cat(logits)

    # --- decode loop --------------------------------------------------------------------------------
    def _decode(self, st: _DecodeState, batch: int, max_new: int, longest: int, params: SamplingParams,
                sample) -> None:
        columns = st.attn_bias.shape[1]
        # Plain temperature sampling and greedy run fused in one Triton kernel; top-k/top-p sort in PyTorch.
        fused_sampling = kernels.triton_enabled(st.cache) and params.top_k <= 0 and params.top_p >= 1.0
        seed = torch.randint(0, 2**31 - 1, (1,)).to(st.cache.device)  # from the seeded CPU generator
        buckets = batch_buckets(batch) if self.bucketed else None
        active = batch
        graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        pool = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None
        check_every = CHECK_EVERY_GPU if self.use_cuda_graphs else 1

        def step(rows: int, length: int) -> None:
            st.attn_bias[:rows].index_fill_(1, st.column, 0.0)
            logits = self.decoder.decode(st.tokens[:rows], st.positions[:rows], st.cache, st.column,
                                         st.attn_bias[:rows, :length])
            state = dict(finished=st.finished[:rows], sequence=st.sequence[:rows], tokens=st.tokens[:rows],
                         positions=st.positions[:rows], eos_table=self._eos_table, out_tokens=st.out_tokens,
                         out_logprobs=st.out_logprobs, column=st.column, longest=longest, pad_id=self.pad_id)
            if fused_sampling:
                kernels.sample_and_record(logits, temperature=params.temperature, greedy=not params.do_sample,
                                          seed=seed, **state)
            else:
                kernels.record_ref(*sample(logits), **state)
            st.column += 1

        for t in range(max_new - 1):  # t: index of the response token fed in (its successor is produced)
            if t % check_every == 0:
                running = int((~st.finished[:active]).sum())
                if running == 0:
                    break
                target = running if buckets is None else min(b for b in buckets if b >= running)
                if target < active:
                    self._compact(st, active, target, batch)
                    active = target
            length = min(columns, longest + LENGTH_BUCKET * math.ceil((t + 1) / LENGTH_BUCKET))
            if not self.use_cuda_graphs:
                step(active, length)
            elif (active, length) in graphs:
                graphs[(active, length)].replay()
            else:
                # The first step of a new shape runs eagerly on a side stream (warm-up for capture; it is a
                # real step), then the shape is captured; capturing records kernels without running them.
                side = warmup_stream(st.cache.device)
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    step(active, length)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # thread_local: a trainer-state write may be copying on another thread of this process.
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    step(active, length)
                graphs[(active, length)] = graph
                self.stats["graphs_captured"] += 1
            self.stats["decode_steps"] += 1
        if graphs:
            torch.cuda.synchronize()

    def _compact(self, st: _DecodeState, active: int, target: int, batch: int) -> None:
        """Moves the running slots among the first ``active`` to the front; slots up to ``target`` after
        them become finished filler that writes to the scratch output row."""
        running = torch.nonzero(~st.finished[:active]).squeeze(1)
        m = running.numel()
        st.cache[:, :, :m] = st.cache[:, :, running]
        for buffer in (st.attn_bias, st.tokens, st.positions, st.sequence):
            buffer[:m] = buffer[running]
        st.finished[:m] = False
        st.finished[m:target] = True
        st.sequence[m:target] = batch
        self.stats["compactions"] += 1
