"""The ``torch`` rollout backend: a batched decoder with a static KV cache and CUDA-graph decode steps.

One call generates n samples for each of P prompts (B = P * n sequences):

1. **Prefill** each prompt once (left-padded to the longest prompt, with a causal + padding mask and
   per-row positions), in chunks bounded by a token budget. Its K/V go to its row of the prompt cache
   and its last logits give each sample's first token.
2. **KV cache**: a prompt cache (layers, 2, P, kv_heads, P_max, head_dim), each prompt's K/V once
   (``PromptCache``: its n samples read the same rows, which meet in L2, and hold no copy of them), and
   one static tensor (layers, 2, B, kv_heads, max_new_tokens - 1, head_dim) for the responses, both
   allocated per call. Static rather than paged because a rollout batch is known up front (B
   sequences, at most P_max + R columns each), every sequence lives for the whole call, and fixed
   addresses are what CUDA graphs need; the price is that memory is sized for the longest case,
   which ``rollout.micro_batch_size`` bounds. Left-padding puts token t of every response in the same
   column P_max + t, so one column index serves the whole batch.
3. **Decode**: one step (embedding → blocks → logits → sampling → bookkeeping) per token, captured
   as a CUDA graph per batch bucket on first use and replayed after. The attention kernel reads the
   step's column on the device and attends exactly the columns written so far, so one graph serves
   every step and no step reads the empty end of the cache. Sampling (temperature, top-k, top-p,
   greedy) and the sampled token's log-prob run inside the graph; per-step logits are never kept.
   Tokens and log-probs go straight into (B, R) outputs.
4. **Finished sequences stop costing work**: every few steps the host reads how many sequences are
   still running; when they fit a smaller batch bucket, the running rows are compacted to the front
   of every buffer (cache included) and the smaller bucket's graph takes over. When none is running
   the call ends.

On CPU (or with ``use_cuda_graphs=False``) the same step runs eagerly and compaction is exact.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kfrl.engines import kernels
from kfrl.engines.decoder import Decoder, PromptCache
from kfrl.engines.rollout import Generation, SamplingParams, generations_from_tokens, left_pad
from kfrl.engines.sampling import sample_tokens

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
    owner: torch.Tensor | None = None  # (B,) which sequence's cache a slot holds (multi-turn: kept across compactions)
    prompts: PromptCache | None = None  # the prompts' columns, once per prompt; ``cache`` then holds the rest


_WARMUP_STREAMS: dict = {}


def warmup_stream(device):
    """One side stream per device for the eager warm-up before each capture. A new stream per capture
    would cost memory for good: cuBLAS keeps a workspace (32 MiB on Hopper) for every stream it has run
    on, up to the 32 streams of PyTorch's pool, so resident memory would grow rollout after rollout."""
    import torch

    if device not in _WARMUP_STREAMS:
        _WARMUP_STREAMS[device] = torch.cuda.Stream(device=device)
    return _WARMUP_STREAMS[device]


def capture(graph, pool, stream, run) -> None:
    """Record ``run()``'s kernels into ``graph`` on ``stream`` (the warm-up's: the cuBLAS workspace it
    made is the one the graph uses). Unlike ``torch.cuda.graph`` this neither synchronises the device
    nor empties the allocator's caches: a rollout would otherwise wait for the copy of the last update's
    weights still running on the copy stream (``kfrl.models.host_memory.on_host_later``), and hand back
    the memory the next update then allocates again. thread_local: a trainer-state write may be copying
    on another thread of this process meanwhile."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            run()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)


def graph_memory_pool():
    """A memory pool for one decode call's CUDA graphs: a ``torch.cuda.MemPool``, whose memory goes back
    to the device when it and the graphs captured into it are gone (its destructor empties that pool
    only). The bare id of ``graph_pool_handle`` has no such owner: the allocator marks a pool freeable
    when its graphs die but frees it only when it empties all its caches (``empty_cache``, or a failed
    allocation), so each rollout's ~100 MiB pool stayed reserved and a process's reserved memory grew by
    that much every iteration (0.5B on an H100: 6.73 -> 7.13 GiB over five iterations; with a MemPool per
    call, flat at 6.54). One MemPool for several calls does not work: in PyTorch 2.11 capturing into it
    after its graphs were destroyed failed an allocator assertion (``use_count > 0``)."""
    if hasattr(torch.cuda, "MemPool"):
        return torch.cuda.MemPool()
    return torch.cuda.graph_pool_handle()


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
        self.stats = {"graphs_captured": 0, "capture_host_s": 0.0, "compactions": 0,
                      "decode_steps": 0, "kv_cache_bytes": 0}
        step = self.micro_batch_size or len(prompts)
        out: list[Generation] = []
        for start in range(0, len(prompts), step):
            if seed is not None:
                torch.manual_seed(seed + start)
            out.extend(self._generate(prompts[start:start + step], params))
        return out

    def turns(self) -> "TorchTurns":
        """A multi-turn session (kfrl.agent.loop) that continues every conversation from its KV cache."""
        return TorchTurns(self)

    # --- one batch ---------------------------------------------------------------------------------
    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        dec, device = self.decoder, self.decoder.device
        spec = dec.spec
        n, max_new = params.n, params.max_new_tokens
        batch = len(prompts) * n
        longest = max(len(p) for p in prompts)
        columns = longest + max(max_new - 1, 1)
        dec.rope_tables(longest + max_new)
        shared = bool(kernels.DECODE_SHARED_PROMPTS)
        prompts_cache = PromptCache(
            torch.empty((spec.n_layers, 2, len(prompts), spec.n_kv_heads, longest, spec.head_dim), dtype=dec.dtype,
                        device=device),
            torch.arange(len(prompts), device=device).repeat_interleave(n), longest) if shared else None
        st = _DecodeState(
            cache=torch.zeros((spec.n_layers, 2, batch, spec.n_kv_heads, columns - longest if shared else columns,
                               spec.head_dim), dtype=dec.dtype, device=device),
            prompts=prompts_cache,
            attn_bias=torch.full((batch, columns), float("-inf"), dtype=dec.dtype, device=device),
            tokens=torch.empty(batch, dtype=torch.long, device=device),
            positions=torch.tensor([len(p) for p in prompts], device=device).repeat_interleave(n),
            finished=torch.zeros(batch, dtype=torch.bool, device=device),
            sequence=torch.arange(batch, device=device),
            column=torch.tensor([longest], device=device),
            out_tokens=torch.full((batch + 1, max_new), self.pad_id, dtype=torch.long, device=device),
            out_logprobs=torch.zeros((batch + 1, max_new), dtype=torch.float32, device=device))

        held = [st.cache] + ([st.prompts.cache] if st.prompts is not None else [])
        self.stats["kv_cache_bytes"] = max(self.stats.get("kv_cache_bytes", 0),
                                           sum(t.numel() * t.element_size() for t in held))
        first_logits = self._prefill(prompts, n, longest, st)
        self._run_turn(st, batch, first_logits.repeat_interleave(n, dim=0), max_new, longest, params)
        return generations_from_tokens(st.out_tokens[:batch], st.out_logprobs[:batch], self.eos_ids)

    def _sampler(self, params: SamplingParams):
        def sample(logits):
            return sample_tokens(logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                 greedy=not params.do_sample)
        return sample

    def _run_turn(self, st: _DecodeState, batch: int, first_logits: torch.Tensor, max_new: int, start_column: int,
                  params: SamplingParams, report=None) -> None:
        """Samples each sequence's first token from ``first_logits`` (batch, V), then decodes from
        ``start_column`` until every sequence ended or ``max_new`` tokens; outputs in st.out_*."""
        sample = self._sampler(params)
        tokens, logprobs = sample(first_logits)
        st.tokens.copy_(tokens)
        st.out_tokens[:batch, 0] = tokens
        st.out_logprobs[:batch, 0] = logprobs
        st.finished.copy_(self._eos_table[tokens])
        del first_logits
        if max_new > 1:
            self._decode(st, batch, max_new, start_column, params, sample, report)

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
            rows = slice(start * n, (start + len(chunk)) * n)
            if st.prompts is not None:  # straight into the prompt's own rows of the prompt cache
                logits.append(dec.prefill(ids, valid, positions, st.prompts.cache[:, :, start:start + len(chunk)]))
            else:
                kv = torch.empty((spec.n_layers, 2, len(chunk), spec.n_kv_heads, longest, spec.head_dim),
                                 dtype=dec.dtype, device=device)
                logits.append(dec.prefill(ids, valid, positions, kv))
                st.cache[:, :, rows, :, :longest] = kv.repeat_interleave(n, dim=2)
                del kv
            visible = torch.where(valid, 0.0, float("-inf")).to(dec.dtype)
            st.attn_bias[rows, :longest] = visible.repeat_interleave(n, dim=0)
        return torch.cat(logits)

    # --- decode loop --------------------------------------------------------------------------------
    def _decode(self, st: _DecodeState, batch: int, max_new: int, longest: int, params: SamplingParams,
                sample, report=None) -> None:
        """``report(sequences)``, when given, hears at every host check which sequences have ended since
        the last (a multi-turn rollout starts their tool calls while the others decode)."""
        # Plain temperature sampling and greedy run fused in one Triton kernel; top-k/top-p sort in PyTorch.
        fused_sampling = kernels.triton_enabled(st.cache) and params.top_k <= 0 and params.top_p >= 1.0
        seed = torch.randint(0, 2**31 - 1, (1,)).to(st.cache.device)  # from the seeded CPU generator
        buckets = batch_buckets(batch) if self.bucketed else None
        active = batch
        graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool_owner = graph_memory_pool() if self.use_cuda_graphs else None
        pool = None if pool_owner is None else getattr(pool_owner, "id", pool_owner)
        check_every = CHECK_EVERY_GPU if self.use_cuda_graphs else 1

        def step(rows: int) -> None:
            st.attn_bias[:rows].index_fill_(1, st.column, 0.0)
            logits = self.decoder.decode(st.tokens[:rows], st.positions[:rows], st.cache, st.column,
                                         st.attn_bias[:rows], st.prompts)
            state = dict(finished=st.finished[:rows], sequence=st.sequence[:rows], tokens=st.tokens[:rows],
                         positions=st.positions[:rows], eos_table=self._eos_table, out_tokens=st.out_tokens,
                         out_logprobs=st.out_logprobs, column=st.column, longest=longest, pad_id=self.pad_id)
            if fused_sampling:
                kernels.sample_and_record(logits, temperature=params.temperature, greedy=not params.do_sample,
                                          seed=seed, **state)
            else:
                kernels.record_ref(*sample(logits), **state)
            st.column += 1

        reported: set[int] = set()
        for t in range(max_new - 1):  # t: index of the response token fed in (its successor is produced)
            # With graphs the first host read waits for step t = check_every: a read at t = 0 would make the
            # host wait for the prefill before capturing, where the capture can be recorded while the GPU
            # still runs it (sequences that ended at their first token run as filler until then).
            if t % check_every == 0 and (t > 0 or not self.use_cuda_graphs):
                if report is not None:
                    ended = st.sequence[:active][st.finished[:active]].tolist()
                    fresh = sorted(set(ended) - reported - {batch})
                    if fresh:
                        reported.update(fresh)
                        report(fresh)
                running = int((~st.finished[:active]).sum())
                if running == 0:
                    break
                target = running if buckets is None else min(b for b in buckets if b >= running)
                if target < active:
                    self._compact(st, active, target, batch)
                    active = target
            if not self.use_cuda_graphs:
                step(active)
            elif active in graphs:
                graphs[active].replay()
            else:
                # The first step of a new shape runs eagerly on a side stream (warm-up for capture; it is a
                # real step), then the shape is captured; capturing records kernels without running them.
                began = time.perf_counter()
                side = warmup_stream(st.cache.device)
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    step(active)
                torch.cuda.current_stream().wait_stream(side)
                # Held by ``graphs`` alone (no local name): they must be gone before their pool is dropped.
                graphs[active] = torch.cuda.CUDAGraph()
                capture(graphs[active], pool, side, lambda: step(active))
                self.stats["graphs_captured"] += 1
                self.stats["capture_host_s"] += time.perf_counter() - began
            self.stats["decode_steps"] += 1
        if graphs:
            torch.cuda.current_stream().synchronize()  # not the device: a copy to the host may run beside
        # The graphs before their pool: a MemPool dropped while a graph still uses it only marks the pool
        # freeable (and older PyTorch asserts that nothing else uses it), so its memory would stay reserved.
        graphs.clear()
        del pool_owner

    def _compact(self, st: _DecodeState, active: int, target: int, batch: int) -> None:
        """Moves the running slots among the first ``active`` to the front; slots up to ``target`` after
        them become finished filler that writes to the scratch output row. With ``st.owner`` (multi-turn)
        the finished sequences' caches are kept: the slots are permuted, not overwritten."""
        running = torch.nonzero(~st.finished[:active]).squeeze(1)
        m = running.numel()
        if st.owner is not None:
            order = torch.cat([running, torch.nonzero(st.finished[:active]).squeeze(1)])
            st.cache[:, :, :active] = st.cache[:, :, order]
            for buffer in (st.attn_bias, st.tokens, st.positions, st.sequence, st.owner):
                buffer[:active] = buffer[order]
        else:
            st.cache[:, :, :m] = st.cache[:, :, running]
            shared = () if st.prompts is None else (st.prompts.prompt_of,)
            for buffer in (st.attn_bias, st.tokens, st.positions, st.sequence, *shared):
                buffer[:m] = buffer[running]
        st.finished[:m] = False
        st.finished[m:target] = True
        st.sequence[m:target] = batch
        self.stats["compactions"] += 1


class TorchTurns:
    """Multi-turn rollouts on the torch decoder (``kfrl.agent.loop.TurnEngine``): a conversation's K/V
    stay in the cache between turns, so a turn after a tool answer computes only the new tokens (the
    previous turn's last token and the answer, ``Decoder.extend``) instead of the whole conversation.

    Layout: every conversation of a batch writes a turn's token t at the same column (as in one
    call); the columns a sequence did not fill (its turn ended early, or its tool answer is shorter
    than another's) are masked in its attention bias, and positions count only its real tokens, so the
    gaps change nothing. Each turn gathers the continuing conversations' cache rows into a batch of
    their own, wide enough for the answer and the longest budget. Prompts are taken
    ``micro_batch_size`` at a time, each chunk a conversation batch of its own.
    """

    def __init__(self, engine: TorchRollout):
        self.engine = engine
        self.chunks: list[_TurnChunk] = []

    def first(self, prompts, params, seed, on_turn) -> None:
        step = self.engine.micro_batch_size or len(prompts)
        self.engine.stats = {"graphs_captured": 0, "capture_host_s": 0.0, "compactions": 0,
                             "decode_steps": 0, "extend_tokens": 0}
        for start in range(0, len(prompts), step):
            if seed is not None:
                torch.manual_seed(seed + start)
            chunk = _TurnChunk(self.engine, start * params.n)
            chunk.first(prompts[start:start + step], params, on_turn)
            self.chunks.append(chunk)

    def next(self, rows, appended, budgets, params, seed, on_turn) -> None:
        if seed is not None:
            torch.manual_seed(seed)
        for chunk in self.chunks:
            mine = [i for i, row in enumerate(rows) if chunk.offset <= row < chunk.offset + chunk.size]
            if mine:
                chunk.next([rows[i] for i in mine], [appended[i] for i in mine], [budgets[i] for i in mine],
                           params, on_turn)


class _TurnChunk:
    """The conversations of one prompt chunk: their cache between turns and where each one stands."""

    def __init__(self, engine: TorchRollout, offset: int):
        self.engine, self.offset = engine, offset
        self.size = 0
        self.state: _DecodeState | None = None
        self.turn_rows: list[int] = []       # the local rows of the last turn, in its sequence order
        self.end_column = 0                  # the first column no sequence has written
        self.cached: dict[int, int] = {}     # local row -> tokens whose K/V are in the cache (= next position)
        self.last_token: dict[int, int] = {}  # local row -> its last turn's final token (fed with the next turn)
        self.turn_length: dict[int, int] = {}

    def first(self, prompts, params, on_turn) -> None:
        engine, dec = self.engine, self.engine.decoder
        spec, device, n = dec.spec, dec.device, params.n
        batch, longest, max_new = len(prompts) * n, max(len(p) for p in prompts), params.max_new_tokens
        self.size = batch
        columns = longest + max(max_new - 1, 1)
        dec.rope_tables(longest + max_new)
        st = self._state(torch.zeros((spec.n_layers, 2, batch, spec.n_kv_heads, columns, spec.head_dim),
                                     dtype=dec.dtype, device=device),
                         torch.full((batch, columns), float("-inf"), dtype=dec.dtype, device=device),
                         torch.tensor([len(p) for p in prompts], device=device).repeat_interleave(n), longest, max_new)
        first_logits = engine._prefill(prompts, n, longest, st)
        self.cached = {row: len(prompts[row // n]) for row in range(batch)}
        self._turn(st, list(range(batch)), first_logits.repeat_interleave(n, dim=0), longest, max_new,
                   [max_new] * batch, params, on_turn)

    def next(self, rows, appended, budgets, params, on_turn) -> None:
        engine, dec, previous = self.engine, self.engine.decoder, self.state
        local = [row - self.offset for row in rows]
        feeds = [[self.last_token[r]] + list(ids) for r, ids in zip(local, appended)]
        width, max_new = max(len(f) for f in feeds), max(budgets)
        start = self.end_column
        columns = start + width + max(max_new - 1, 1)
        slot_of = {row: slot for slot, row in enumerate(self._rows_by_slot())}
        slots = torch.tensor([slot_of[r] for r in local], device=dec.device)
        old_columns = previous.attn_bias.shape[1]
        cache = torch.zeros((*previous.cache.shape[:2], len(local), *previous.cache.shape[3:4], columns,
                             previous.cache.shape[-1]), dtype=dec.dtype, device=dec.device)
        cache[:, :, :, :, :old_columns] = previous.cache[:, :, slots]
        bias = torch.full((len(local), columns), float("-inf"), dtype=dec.dtype, device=dec.device)
        bias[:, :old_columns] = previous.attn_bias[slots]
        self.state = None
        del previous
        ids, valid = left_pad(feeds, engine.pad_id, dec.device, width=width)
        valid = valid.bool()
        base = torch.tensor([self.cached[r] for r in local], device=dec.device)
        positions = (base[:, None] + valid.long().cumsum(-1) - 1).clamp(min=0)
        bias[:, start:start + width] = torch.where(valid, 0.0, float("-inf")).to(dec.dtype)
        dec.rope_tables(int(positions.max()) + max_new + 1)
        logits = dec.extend(ids, valid, positions, cache, start, bias)
        engine.stats["extend_tokens"] = engine.stats.get("extend_tokens", 0) + sum(len(f) for f in feeds)
        for r, feed in zip(local, feeds):
            self.cached[r] += len(feed)
        st = self._state(cache, bias, torch.tensor([self.cached[r] for r in local], device=dec.device),
                         start + width, max_new)
        self._turn(st, local, logits, start + width, max_new, budgets, params, on_turn)

    def _state(self, cache, bias, positions, column: int, max_new: int) -> _DecodeState:
        batch, device = cache.shape[2], cache.device
        return _DecodeState(
            cache=cache, attn_bias=bias, tokens=torch.empty(batch, dtype=torch.long, device=device),
            positions=positions, finished=torch.zeros(batch, dtype=torch.bool, device=device),
            sequence=torch.arange(batch, device=device), column=torch.tensor([column], device=device),
            out_tokens=torch.full((batch + 1, max_new), self.engine.pad_id, dtype=torch.long, device=device),
            out_logprobs=torch.zeros((batch + 1, max_new), dtype=torch.float32, device=device),
            owner=torch.arange(batch, device=device))

    def _turn(self, st, local_rows, first_logits, start_column, max_new, budgets, params, on_turn) -> None:
        from kfrl.agent.loop import within_budget

        engine = self.engine
        done: set[int] = set()

        def report(sequences: list[int]) -> None:
            generations = generations_from_tokens(st.out_tokens[sequences], st.out_logprobs[sequences], engine.eos_ids)
            for sequence, generation in zip(sequences, generations):
                done.add(sequence)
                row = local_rows[sequence]
                self.turn_length[row] = len(generation.response_ids)
                self.last_token[row] = generation.response_ids[-1]
                self.cached[row] += len(generation.response_ids) - 1
                on_turn(self.offset + row, within_budget(generation, budgets[sequence]))

        engine._run_turn(st, len(local_rows), first_logits, max_new, start_column, params, report)
        report([s for s in range(len(local_rows)) if s not in done])
        self.state, self.turn_rows = st, local_rows
        self.end_column = int(st.column.item())
        # A sequence that ended keeps running as filler until compaction drops it: the columns after its
        # last fed token hold K/V of padding, hidden here so no later turn attends to them.
        for slot, row in enumerate(self._rows_by_slot()):
            st.attn_bias[slot, start_column + self.turn_length[row] - 1:] = float("-inf")

    def _rows_by_slot(self) -> list[int]:
        """The local row each cache slot of the last turn holds (compaction permutes the slots)."""
        return [self.turn_rows[i] for i in self.state.owner.tolist()]
