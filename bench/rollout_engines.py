"""Rollout backends side by side, in ONE process on one GPU: HF generate (dynamic cache), HF generate
(static cache) and kfrl's ``torch`` decoder, on a Qwen2.5-0.5B-shaped model (random init, bf16).

    python bench/rollout_engines.py --out results.json [--engines hf,hf_static,torch] [--profile]

Workloads (133-token prompts, 256 new tokens, temperature 1, n = 4 samples per prompt):
- ``256x256``: 64 prompts x 4 = 256 sequences; a random-init model never emits its EOS, so every
  sequence runs the full 256 tokens (the worst case, and the issue's reference shape);
- ``512x256``: 128 prompts x 4;
- ``256x256-half-early``: as 256x256, but 410 token ids (0.27% of the vocabulary) count as EOS, so a
  sequence stops with probability ~0.27% per step and about half of them end before 256 tokens.

Each backend runs through the same ``generate_responses`` interface the rollout stage uses (the
``hf`` backend's time includes its teacher-forced log-prob pass; ``torch`` returns log-probs from the
sampling step). Every run is timed with the device synchronised; the figure reported is the second of
two runs (the first warms kernels and captures graphs; HF static compiles there), for HF dynamic one
run after a short warm-up call. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPT_LEN = 133
MAX_NEW = 256
HALF_EARLY_EOS = 410


def workloads(vocab: int):
    import torch

    g = torch.Generator().manual_seed(0)

    def prompts(count: int) -> list[list[int]]:
        return torch.randint(10, vocab, (count, PROMPT_LEN), generator=g).tolist()

    early_eos = set(range(1000, 1000 + HALF_EARLY_EOS))
    return [("256x256", prompts(64), None), ("512x256", prompts(128), None),
            ("256x256-half-early", prompts(64), early_eos)]


def time_sampler(sample_and_record, rows: int = 256, vocab: int = 151936, repeats: int = 200) -> dict:
    """Microseconds per call of a ``sample_and_record`` on random bf16 logits (rows, vocab), temperature
    sampling and greedy, timed with CUDA events over ``repeats`` calls after a warm-up."""
    import torch

    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) * 3
    seed = torch.tensor([3], device="cuda")
    out = {}
    for mode, greedy in (("sample", False), ("greedy", True)):
        state = dict(finished=torch.zeros(rows, dtype=torch.bool, device="cuda"),
                     sequence=torch.arange(rows, device="cuda"), tokens=torch.zeros(rows, dtype=torch.long, device="cuda"),
                     positions=torch.zeros(rows, dtype=torch.long, device="cuda"),
                     eos_table=torch.zeros(vocab, dtype=torch.bool, device="cuda"),
                     out_tokens=torch.zeros((rows + 1, 2), dtype=torch.long, device="cuda"),
                     out_logprobs=torch.zeros((rows + 1, 2), device="cuda"), column=torch.tensor([1], device="cuda"),
                     longest=1, pad_id=0)

        def call():
            state["finished"].zero_()
            sample_and_record(logits, temperature=1.0, greedy=greedy, seed=seed, **state)

        for _ in range(5):
            call()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            call()
        end.record()
        torch.cuda.synchronize()
        out[mode] = round(start.elapsed_time(end) * 1000 / repeats, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--engines", default="hf,hf_static,torch")
    parser.add_argument("--workloads", default="256x256,512x256,256x256-half-early")
    parser.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one torch decode")
    parser.add_argument("--sampler-from", type=Path, default=None,
                        help="a file with another sample_and_record (e.g. an earlier kfrl/engines/kernels.py): adds "
                             "the engine torch_other_sampler (the torch decoder with it) and times both samplers alone")
    args = parser.parse_args()

    import torch

    from gpu_iteration import build_model_dir
    from kfrl.engines.decoder import Decoder
    from kfrl.engines.rollout import SamplingParams, checkpoint_eos_ids
    from kfrl.engines.rollout_hf import HFRollout
    from kfrl.engines.rollout_torch import TorchRollout
    from kfrl.models.hf_io import load_causal_lm, load_tokenizer

    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    model_dir = build_model_dir(Path(tempfile.mkdtemp(prefix="kfrl-bench-")) / "model")
    tokenizer = load_tokenizer(model_dir)
    eos = checkpoint_eos_ids(model_dir, tokenizer)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=MAX_NEW)
    wanted = set(args.workloads.split(","))
    loads = [w for w in workloads(tokenizer.vocab_size if hasattr(tokenizer, "vocab_size") else 151936)
             if w[0] in wanted]
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "model": "Qwen2.5-0.5B shape (494M parameters), random init, bf16",
               "prompt_tokens": PROMPT_LEN, "new_tokens": MAX_NEW, "n": params.n, "runs": []}

    names = args.engines.split(",")
    t0 = time.perf_counter()
    if "hf" in names or "hf_static" in names:
        hf_model = load_causal_lm(model_dir, dtype=torch.bfloat16, device="cuda").eval()
        results["hf_load_s"] = round(time.perf_counter() - t0, 2)
    if "torch" in names:
        t0 = time.perf_counter()
        decoder = Decoder.from_pretrained(model_dir, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        results["torch_load_s"] = round(time.perf_counter() - t0, 2)

    from kfrl.engines import kernels

    own_sampler, other_sampler = kernels.sample_and_record, None
    if args.sampler_from is not None:
        import importlib.util

        spec = importlib.util.spec_from_file_location("other_kernels", args.sampler_from)
        other = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(other)
        other_sampler = other.sample_and_record
        names.append("torch_other_sampler")
        results["samplers_alone_us"] = {"own": time_sampler(own_sampler), "other": time_sampler(other_sampler)}
        print(json.dumps(results["samplers_alone_us"]), flush=True)

    def engine_for(name: str, eos_ids: set[int]):
        kernels.sample_and_record = other_sampler if name == "torch_other_sampler" else own_sampler
        if name.startswith("torch"):
            return TorchRollout(decoder, eos_ids, tokenizer.pad_token_id)
        cache = "static" if name == "hf_static" else "dynamic"
        return HFRollout(hf_model, tokenizer, cache_implementation=cache, eos_ids=eos_ids)

    for workload, prompts, early_eos in loads:
        for name in names:
            engine = engine_for(name, eos | (early_eos or set()))
            runs = []
            if name == "hf":  # a short warm-up call instead of a second long run (dynamic HF does not compile)
                engine.generate_responses(prompts[:2], SamplingParams(n=1, max_new_tokens=8), seed=0)
            for repeat in range(1 if name == "hf" else 2):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                t0 = time.perf_counter()
                gens = engine.generate_responses(prompts, params, seed=repeat)
                torch.cuda.synchronize()
                seconds = time.perf_counter() - t0
                tokens = sum(len(g.response_ids) for g in gens)
                runs.append({"seconds": round(seconds, 3), "tokens": tokens,
                             "tokens_per_s": round(tokens / seconds, 1),
                             "peak_extra_gib": round((torch.cuda.max_memory_allocated() - base) / 2**30, 2),
                             "stopped_early": round(sum(g.finish_reason == "stop" for g in gens) / len(gens), 3),
                             "stats": dict(getattr(engine, "stats", {}))})
            row = {"workload": workload, "engine": name, "sequences": len(prompts) * params.n,
                   **runs[-1], "first_run_s": runs[0]["seconds"]}
            results["runs"].append(row)
            print(json.dumps(row), flush=True)

    base = {r["workload"]: r["tokens_per_s"] for r in results["runs"] if r["engine"] == "hf"}
    for row in results["runs"]:
        if row["workload"] in base:
            row["speedup_vs_hf_dynamic"] = round(row["tokens_per_s"] / base[row["workload"]], 1)

    if args.profile and "torch" in names:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine_for("torch", eos).generate_responses(loads[0][1], params, seed=0)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))

    print("\n| workload | engine | tokens/s | seconds | first run s | peak extra GiB | x HF dynamic |")
    print("|---|---|---|---|---|---|---|")
    for r in results["runs"]:
        print(f"| {r['workload']} | {r['engine']} | {r['tokens_per_s']:.0f} | {r['seconds']:.2f} | "
              f"{r['first_run_s']:.2f} | {r['peak_extra_gib']} | {r.get('speedup_vs_hf_dynamic', '')} |")
    text = json.dumps(results, indent=2)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
