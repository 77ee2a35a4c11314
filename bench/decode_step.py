"""Where a decode step of the ``torch`` rollout backend spends its time, on one GPU (random-init weights
of a Qwen2.5 shape, bf16, built straight on the device: no checkpoint).

    python bench/decode_step.py --shape 0.5b [--parts profile,attention,rollout] --out step.json

- ``profile``: one decode step of 256 sequences at column 261 (133 prompt + 128 response tokens, the
  middle of the 256 x 256 workload) captured as a CUDA graph: the wall time of a replay (CUDA events)
  against the sum of its kernels' times (torch.profiler), kernels grouped by name; the CPU time of one
  capture (warm-up step + capture + instantiate).
- ``attention``: the fused rotary + cache write + attention kernel alone over every layer's cache, per
  launch configuration (columns per block, warps, pipeline stages, splits of the columns; the sweep is
  ``--attention-grid``'s), against its bytes at the card's bandwidth. ``--kernel-setting ATTENTION_SPLITS=2`` (any integer constant of
  ``kfrl.engines.kernels``, repeatable) sets a constant before any part runs.
- ``gemm``: each projection alone over every layer at 256 rows, ``F.linear`` (what the step runs) against
  ``torch.mm`` on transposed copies of the weights and against split-K batched GEMMs in 2 and 4 shares of
  the input features (float32 partials, their sum not included), with the bytes and FLOPs bounds.
- ``rollout``: ``TorchRollout.generate_responses`` on 64 prompts x 4 samples, 133 + 256 tokens, no
  EOS (every sequence runs 256 tokens): tokens per second of the second call, the first call's seconds,
  and the engine's stats. Run it once per source tree (e.g. PYTHONPATH of an older checkout) to
  compare code versions in one device call.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

BATCH, PROMPT, NEW = 256, 133, 256
DEVICE = "cuda"  # --device cpu runs the rollout part on the smoke shape (a check of this script)
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}


def bandwidth(name: str) -> float:
    return next((v for k, v in BANDWIDTH.items() if k in name), 3.35e12)


def sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def random_decoder(shape: str):
    import torch

    from gpu_iteration import SHAPES
    from kfrl.engines.decoder import Decoder

    s = SHAPES[shape]
    config = SimpleNamespace(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu",
                             use_sliding_window=False, mlp_bias=False, rope_scaling=None, **s)
    heads, kv = s["num_attention_heads"], s["num_key_value_heads"]
    hd = s["hidden_size"] // heads
    g = torch.Generator(device=DEVICE).manual_seed(0)
    made: dict[str, torch.Tensor] = {}

    def get(name: str):
        if name in made:
            return made[name]
        h, inter = s["hidden_size"], s["intermediate_size"]
        shapes = {"q_proj.weight": (heads * hd, h), "k_proj.weight": (kv * hd, h), "v_proj.weight": (kv * hd, h),
                  "q_proj.bias": (heads * hd,), "k_proj.bias": (kv * hd,), "v_proj.bias": (kv * hd,),
                  "o_proj.weight": (h, heads * hd), "gate_proj.weight": (inter, h), "up_proj.weight": (inter, h),
                  "down_proj.weight": (h, inter), "input_layernorm.weight": (h,),
                  "post_attention_layernorm.weight": (h,), "embed_tokens.weight": (s["vocab_size"], h),
                  "norm.weight": (h,)}
        if name == "lm_head.weight" and not s["tie_word_embeddings"]:
            shape_ = (s["vocab_size"], h)
        else:
            shape_ = next((v for k, v in shapes.items() if name.endswith("." + k)), None)
        if shape_ is None:
            return None
        t = torch.randn(shape_, generator=g, device=DEVICE, dtype=torch.float32)
        t = (1.0 + 0.1 * t) if "norm" in name else t * (shape_[-1] ** -0.5)
        made[name] = t.to(torch.bfloat16)
        return made[name]

    return Decoder.from_tensors(config, get, device=DEVICE, dtype=torch.bfloat16)


def graph_time(fn, repeats: int = 20, rounds: int = 5) -> float:
    """Seconds per ``fn()`` call, from replays of one CUDA graph holding ``repeats`` calls."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000 / repeats)
    return statistics.median(times)


def step_state(decoder, column: int = PROMPT + 128):
    import torch

    spec = decoder.spec
    columns = PROMPT + NEW - 1
    decoder.rope_tables(PROMPT + NEW)
    cache = torch.randn((spec.n_layers, 2, BATCH, spec.n_kv_heads, columns, spec.head_dim), device=DEVICE,
                        dtype=torch.bfloat16)
    bias = torch.full((BATCH, columns), float("-inf"), device=DEVICE, dtype=torch.bfloat16)
    bias[:, :column + 1] = 0
    return dict(tokens=torch.randint(0, spec.vocab_size, (BATCH,), device=DEVICE),
                positions=torch.full((BATCH,), column, device=DEVICE), cache=cache,
                column=torch.tensor([column], device=DEVICE), attn_bias=bias)


def part_profile(decoder, device: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kfrl.engines import kernels

    state = step_state(decoder)
    rows = BATCH
    out = dict(finished=torch.zeros(rows, dtype=torch.bool, device=DEVICE), sequence=torch.arange(rows, device=DEVICE),
               tokens=state["tokens"], positions=state["positions"].clone(),
               eos_table=torch.zeros(decoder.spec.vocab_size, dtype=torch.bool, device=DEVICE),
               out_tokens=torch.zeros((rows + 1, NEW), dtype=torch.long, device=DEVICE),
               out_logprobs=torch.zeros((rows + 1, NEW), device=DEVICE), column=state["column"], longest=PROMPT,
               pad_id=0)
    seed = torch.tensor([1], device=DEVICE)

    def step():
        logits = decoder.decode(state["tokens"], out["positions"], state["cache"], state["column"], state["attn_bias"])
        kernels.sample_and_record(logits, temperature=1.0, greedy=False, seed=seed, **out)
        out["positions"].fill_(PROMPT + 128)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()
    capture_s = time.perf_counter() - t0
    replay = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        replay.append(start.elapsed_time(end) / 1000)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
    groups: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            groups.setdefault(event.name[:90], []).append(event.device_time_total)
    kernels_per_step = sum(len(v) for v in groups.values()) / 10
    by_name = sorted(((name, sum(v) / 10, len(v) / 10) for name, v in groups.items()), key=lambda r: -r[1])
    spec = decoder.spec
    weight_bytes = sum(t.numel() * t.element_size() for t in decoder.tensors())
    kv_bytes = spec.n_layers * 2 * BATCH * spec.n_kv_heads * (PROMPT + 129) * spec.head_dim * 2
    bound = (weight_bytes + kv_bytes) / bandwidth(device)
    return {"replay_s": statistics.median(replay), "kernel_sum_s": sum(r[1] for r in by_name) / 1e6,
            "kernels_per_step": kernels_per_step, "capture_cpu_s": round(capture_s, 4),
            "bytes_bound_s": bound, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
            "kernels": [{"name": n, "us_per_step": round(t, 2), "count_per_step": c} for n, t, c in by_name[:30]]}


# The launch configurations part_attention sweeps (overridden with --attention-grid).
ATTENTION_GRID = {"block_n": (32, 64), "warps": (4,), "stages": (2, 3), "splits": (1, 2, 4)}


def parse_grid(text: str) -> dict:
    """``"block_n=64,128;warps=2,4"`` -> ATTENTION_GRID with those axes replaced."""
    grid = dict(ATTENTION_GRID)
    for axis in filter(None, text.split(";")):
        name, values = axis.split("=")
        if name not in grid:
            raise SystemExit(f"--attention-grid: unknown axis {name!r} (axes: {', '.join(grid)})")
        grid[name] = tuple(int(v) for v in values.split(","))
    return grid


def part_attention(decoder, device: str) -> dict:
    """``rope_attention`` over every layer, for each launch configuration (columns per block, warps,
    pipeline stages, splits of the columns: ``ATTENTION_GRID``), set through the module's constants as a
    rollout sets them."""
    import torch

    from kfrl.engines import kernels

    spec = decoder.spec
    state = step_state(decoder)
    cache, bias, column, positions = state["cache"], state["attn_bias"], state["column"], state["positions"]
    cos_table, sin_table = decoder.rope_tables(1)
    qkv = torch.randn((BATCH, spec.q_size + 2 * spec.kv_size), device=DEVICE, dtype=torch.bfloat16)
    length = int(column) + 1
    kv_bytes = 2 * BATCH * spec.n_kv_heads * length * spec.head_dim * 2
    settings = ("ATTENTION_BLOCK_N", "ATTENTION_WARPS", "ATTENTION_STAGES", "ATTENTION_SPLITS")
    default = tuple(getattr(kernels, name) for name in settings)

    def all_layers():
        for layer in range(spec.n_layers):
            kernels.rope_attention(qkv, positions, cos_table, sin_table, None, None, 1e-6, cache[layer, 0],
                                   cache[layer, 1], column, bias, spec.n_heads, spec.n_kv_heads, spec.head_dim)

    results = []
    try:
        for block_n in ATTENTION_GRID["block_n"]:
            for warps in ATTENTION_GRID["warps"]:
                for stages in ATTENTION_GRID["stages"]:
                    for splits in ATTENTION_GRID["splits"]:
                        config = (block_n, warps, stages, splits)
                        for name, value in zip(settings, config):
                            setattr(kernels, name, value)
                        row = dict(zip(("block_n", "warps", "stages", "splits"), config))
                        try:
                            row["fused_us"] = round(graph_time(all_layers, repeats=2) / spec.n_layers * 1e6, 2)
                        except Exception as exc:  # a configuration that does not fit (shared memory) is skipped
                            row["fused_us_error"] = str(exc)[:120]
                        results.append(row)
    finally:
        for name, value in zip(settings, default):
            setattr(kernels, name, value)
    chosen = next((r for r in results if (r["block_n"], r["warps"], r["stages"], r["splits"]) == default), None)
    return {"per_layer_bytes": kv_bytes, "bound_us": round(kv_bytes / bandwidth(device) * 1e6, 2),
            "best": min((r for r in results if "fused_us" in r), key=lambda r: r["fused_us"]), "default": chosen,
            "all": results}


def part_gemm(decoder, device: str) -> dict:
    """Each projection of the decode step over every layer at 256 rows: ``F.linear`` on the decoder's
    (out, in) weights (what the step runs) against ``torch.mm`` on (in, out) copies, which cuBLAS serves
    with other kernels, and against the weights' bytes at the card's bandwidth and the FLOPs at 989 TFLOP/s."""
    import torch
    import torch.nn.functional as F

    def split_k_linear(x, weight, splits: int):
        """x @ weight.T as ``splits`` float32 partial products over shares of the input features, one
        batched GEMM over views of x and weight (what a split-K projection would cost before its sum)."""
        rows, k = x.shape
        share = k // splits
        return torch.bmm(x.view(rows, splits, share).transpose(0, 1),
                         weight.view(weight.shape[0], splits, share).permute(1, 2, 0), out_dtype=torch.float32)

    blocks = decoder.blocks
    projections = {"qkv": [b.qkv_weight for b in blocks], "o": [b.o_weight for b in blocks],
                   "gate_up": [b.gate_up_weight for b in blocks], "down": [b.down_weight for b in blocks],
                   "lm_head": [decoder.lm_head]}
    result = {}
    for name, weights in projections.items():
        out_features, in_features = weights[0].shape
        x = torch.randn((BATCH, in_features), device=DEVICE, dtype=torch.bfloat16)
        transposed = [w.t().contiguous() for w in weights]
        y = torch.empty((BATCH, out_features), device=DEVICE, dtype=torch.bfloat16)
        row = {"out": out_features, "in": in_features,
               "bytes_bound_us": round(weights[0].numel() * 2 / bandwidth(device) * 1e6, 2),
               "flops_bound_us": round(2 * BATCH * weights[0].numel() / 989e12 * 1e6, 2)}
        row["linear_us"] = round(graph_time(lambda: [F.linear(x, w) for w in weights], repeats=2)
                                 / len(weights) * 1e6, 2)
        row["mm_transposed_us"] = round(graph_time(lambda: [torch.mm(x, w, out=y) for w in transposed], repeats=2)
                                        / len(weights) * 1e6, 2)
        for splits in (2, 4):  # split-K: float32 partials over shares of the input features
            if in_features % splits == 0:
                row[f"split{splits}_us"] = round(graph_time(lambda: [split_k_linear(x, w, splits) for w in weights],
                                                            repeats=2) / len(weights) * 1e6, 2)
        result[name] = row
    return result


def part_rollout(decoder) -> dict:
    import torch

    from kfrl.engines.rollout import SamplingParams
    from kfrl.engines.rollout_torch import TorchRollout

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, decoder.spec.vocab_size, (BATCH // 4, PROMPT), generator=g).tolist()
    engine = TorchRollout(decoder, eos_ids=set(), pad_id=0)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=NEW)
    runs = []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        generations = engine.generate_responses(prompts, params, seed=0)
        sync()
        seconds = time.perf_counter() - t0
        tokens = sum(len(x.response_ids) for x in generations)
        runs.append({"seconds": round(seconds, 4), "tokens": tokens, "tokens_per_s": round(tokens / seconds),
                     "stats": dict(engine.stats)})
    return {"runs": runs, "tokens_per_s_median_of_2_3": round(statistics.median(r["tokens_per_s"] for r in runs[1:]))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="0.5b")
    parser.add_argument("--parts", default="profile,attention,rollout")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--kernel-setting", action="append", default=[], metavar="NAME=VALUE",
                        help="set an integer constant of kfrl.engines.kernels (e.g. ATTENTION_SPLITS=2) first")
    parser.add_argument("--attention-grid", default="", metavar="AXIS=V,V;...",
                        help="the attention part's sweep, axes block_n, warps, stages, splits "
                             "(e.g. 'block_n=64,128;warps=2,4,8'); axes not named keep their default values")
    args = parser.parse_args()
    ATTENTION_GRID.update(parse_grid(args.attention_grid))

    import torch

    from gpu_iteration import apply_kernel_settings

    apply_kernel_settings(args.kernel_setting)

    global DEVICE
    DEVICE = args.device
    device = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu"
    decoder = random_decoder(args.shape)
    result = {"device": device, "shape": args.shape, "label": args.label, "torch": torch.__version__,
              "kernel_settings": args.kernel_setting}
    for part in args.parts.split(","):
        t0 = time.perf_counter()
        try:
            run_part(part, result, decoder, device)
        except Exception as exc:  # one part's failure must not lose the others' figures
            result[part] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        result[f"{part}_wall_s"] = round(time.perf_counter() - t0, 1)
        summary = {k: v for k, v in result[part].items() if k not in ("all", "kernels")}
        print(f"SUMMARY {args.shape} {args.label} {part}: {json.dumps(summary)}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


def run_part(part: str, result: dict, decoder, device: str) -> None:
    parts = {"profile": lambda: part_profile(decoder, device), "attention": lambda: part_attention(decoder, device),
             "rollout": lambda: part_rollout(decoder), "gemm": lambda: part_gemm(decoder, device)}
    result[part] = parts[part]()

if __name__ == "__main__":
    main()
