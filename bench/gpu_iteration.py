"""One GRPO iteration of a Qwen2.5-0.5B-shaped model (random init) on one GPU, stage by stage.

    python bench/gpu_iteration.py --out results.json [--iterations 2] [key=value ...]
    python bench/gpu_iteration.py --workload trl --iterations 10 --out results.json
    python bench/gpu_iteration.py --config configs/gsm8k_grpo_qwen05b.yaml [key=value ...]

With ``--config`` a ready config runs as written except for the model (the random 0.5B shape),
the data (256 synthetic GSM8K-format rows: the same schema, prompt and reward as `kfrl data
gsm8k` writes) and the store: a smoke run of the GSM8K configs where no hub is reachable.

Runs the same stage functions the pipeline runs, in one long-lived process as the resident engine
runs them (``run_stage`` in turn, trainer state written in the background, weights handed from the
update to the rollout in memory; the engine's HTTP hop is not included), on a local store. Shape:
64 prompts x 4 samples, 256 new tokens; ``--workload full`` (default) has the KL loss on (so the
reference pass runs) and 4 mini-batches (so the old-logprob pass runs); ``--workload trl`` is the
TRL GRPOTrainer comparison: no KL, one optimizer step, micro-batch 32. A random-init model almost never emits EOS, so every response is the
full 256 tokens: the worst case for rollout. Prints one JSON object: per-stage seconds and peak
GPU memory, tokens per second, and the config used.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1_000_000.0,
                  tie_word_embeddings=True, rms_norm_eps=1e-6)


def build_model_dir(out: Path) -> Path:
    """A random-init 0.5B Qwen2 and a word-level tokenizer with the same 151,936-entry vocabulary."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from kfrl.models.tiny import CHAT_TEMPLATE

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for word in "What is + ? user assistant".split() + [str(d) for d in range(10)]:
        vocab.setdefault(word, len(vocab))
    while len(vocab) < QWEN25_05B["vocab_size"]:
        vocab[f"w{len(vocab)}"] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(True)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                        additional_special_tokens=["<|im_start|>"], padding_side="left")
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    config = Qwen2Config(**QWEN25_05B, pad_token_id=0, eos_token_id=2, bos_token_id=0)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=2, pad_token_id=0, bos_token_id=0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def write_gsm8k_shaped(out: Path, rows: int = 256) -> dict[str, Path]:
    """GSM8K-format Parquet files (kfrl.data.gsm8k's row builder) from synthetic sums."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    from kfrl.data.gsm8k import make_row

    rng = random.Random(0)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, count in (("train", rows), ("test", rows // 4)):
        table = []
        for i in range(count):
            a, b = rng.randint(10, 999), rng.randint(10, 999)
            table.append(make_row(f"A shop sells {a} apples and {b} pears. How many fruits?",
                                  f"{a} + {b} = {a + b}\n#### {a + b}", split, i))
        paths[split] = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(table), paths[split])
    return paths


def write_long_prompts(out: Path, prompt_tokens: int, rows: int = 512) -> Path:
    """The arithmetic task's rows with filler words in front of each question, longer than
    ``prompt_tokens``: with ``data.truncation=left`` every prompt is exactly that long (the question
    and the chat template's end kept), as in a workload with fixed-length prompts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kfrl.data.synthetic import make_arith_rows

    filler = " ".join(f"w{1000 + k}" for k in range(prompt_tokens))  # in the bench tokenizer, a token each
    table = make_arith_rows(rows, 0, "train")
    for row in table:
        row["prompt"][0]["content"] = filler + " " + row["prompt"][0]["content"]
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(table), out / "train.parquet")
    return out / "train.parquet"


H200_BF16_DENSE_FLOPS = 989e12  # NVIDIA's H200 SXM figure without sparsity


def update_mfu(run, iteration: int, stage: dict) -> float | None:
    """Model FLOPs utilisation of the actor update's compute: 6 x parameters x tokens trained (prompt and
    response, padding excluded) over the update's seconds without its checkpoint and hand-off."""
    import pyarrow.parquet as pq

    from kfrl.run import Run

    if stage.get("skipped"):
        return None
    r = Run(run)
    manifest = r.manifest("rollout", iteration)
    tokens = 0
    for name in manifest.names():
        if name.endswith(".parquet"):
            table = pq.read_table(run.url(f"{manifest.prefix}/{manifest.attempt}/{name}"),
                                  columns=["prompt_ids", "response_ids"])
            tokens += sum(len(x) for x in table.column("prompt_ids").to_pylist())
            tokens += sum(len(x) for x in table.column("response_ids").to_pylist())
    compute_s = stage["timing_s/update_actor"] - sum(stage.get(k, 0.0) for k in (
        "timing_s/save_checkpoint", "timing_s/hand_off", "timing_s/save_trainer_state"))
    params = 494_032_768
    return round(6 * params * tokens / compute_s / H200_BF16_DENSE_FLOPS, 3) if compute_s > 0 else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=256)
    parser.add_argument("--hf-cache", choices=["dynamic", "static"], default="dynamic")
    parser.add_argument("--workload", choices=["full", "trl"], default="full")
    parser.add_argument("--cudnn-attention", action="store_true",
                        help="let SDPA use cuDNN's attention in the update (kfrl leaves it out by default)")
    parser.add_argument("--prompt-tokens", type=int, default=0,
                        help="every prompt exactly this many tokens (filler words before the question); 0: the task's own")
    parser.add_argument("--per-task", action="store_true",
                        help="forget loaded models and the training copy after every stage (each stage loads from the store)")
    parser.add_argument("--config", type=Path, default=None, help="a ready config to run instead of the issue shape")
    parser.add_argument("--profile-stage", default="",
                        help="stages (comma-separated) to run under cProfile at iteration 3 (top functions go in the JSON)")
    parser.add_argument("overrides", nargs="*", help="extra config overrides, e.g. algorithm.adv_estimator=gae")
    args = parser.parse_args()

    import torch

    from kfrl.config import load_config
    from kfrl.stages import STAGES, context, run_stage, update
    from kfrl.stages.prepare import prepare_run
    from kfrl.store import Store

    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    if args.cudnn_attention:
        from kfrl.engines import inference

        inference.AVOID_CUDNN_ATTENTION = False
    work = Path(tempfile.mkdtemp(prefix="kfrl-bench-"))
    t0 = time.perf_counter()
    model_dir = build_model_dir(work / "model")
    build_s = time.perf_counter() - t0
    if args.config is not None:
        data = write_gsm8k_shaped(work / "data")
        overrides = [f"model.path={model_dir}", f"store.uri={work / 'store'}", "pipeline.runner=inline",
                     f"data.train_files={data['train']}", f"data.val_files={data['test']}",
                     f"trainer.total_iterations={args.iterations}", *args.overrides]
    else:
        overrides = [
            f"model.path={model_dir}", f"store.uri={work / 'store'}", "pipeline.runner=inline",
            f"data.train_batch_size={args.prompts}", f"rollout.n={args.n}",
            f"data.max_response_length={args.response_length}",
            *(["actor.ppo_mini_batch_size=16", "actor.ppo_micro_batch_size_per_gpu=16", "actor.use_kl_loss=true"]
              if args.workload == "full" else
              [f"actor.ppo_mini_batch_size={args.prompts}", "actor.ppo_micro_batch_size_per_gpu=32",
               "actor.use_kl_loss=false"]),
            "rollout.log_prob_micro_batch_size_per_gpu=64", "actor.lr=1e-6",
            f"trainer.total_iterations={args.iterations}", f"rollout.hf_cache={args.hf_cache}",
            *([f"data.train_files={write_long_prompts(work / 'data', args.prompt_tokens)}",
               f"data.max_prompt_length={args.prompt_tokens}", "data.truncation=left"] if args.prompt_tokens else []),
            *args.overrides,
        ]
    cfg = load_config(args.config, overrides)
    run = Store(str(work / "store" / "bench"))
    t0 = time.perf_counter()
    prepare_run(run, cfg)
    prepare_s = time.perf_counter() - t0

    update.write_states_in_background(not args.per_task)
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "model": "Qwen2.5-0.5B shape, random init",
               "config": str(args.config) if args.config else None, "workload": args.workload,
               "mode": "per_task" if args.per_task else "resident", "cudnn_attention": args.cudnn_attention,
               "params": None, "build_model_s": build_s, "prepare_s": prepare_s, "overrides": overrides, "iterations": []}
    for iteration in range(1, args.iterations + 1):
        stages = {}
        it_start = time.perf_counter()
        for stage in STAGES:
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if stage in args.profile_stage.split(",") and iteration == min(3, args.iterations):
                import cProfile
                import io
                import pstats

                profiler = cProfile.Profile()
                result = profiler.runcall(run_stage, stage, run.uri, iteration)
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
                results.setdefault("profiles", {})[f"{stage}@{iteration}"] = text.getvalue()[-16000:]
            else:
                result = run_stage(stage, run.uri, iteration)
            if args.per_task:
                update.drain()
                update._RESIDENT_TRAINERS.clear()
                context._MODEL_CACHE.clear()
                context._MODEL_SLOTS.clear()
                torch.cuda.empty_cache()
            torch.cuda.synchronize()
            stages[stage] = {"wall_s": round(time.perf_counter() - t0, 3),
                             "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                             "skipped": result.skipped or None}
            stages[stage].update({k: round(v, 4) for k, v in result.metrics.items()
                                  if k.startswith(("timing_s/", "response_length/mean", "perf/", "actor/grad_norm",
                                                   "critic/score/mean", "val-core/"))})
            if stage == "rollout":
                from kfrl.stages.context import StageContext

                stages[stage]["backend"] = StageContext.open(run.uri, iteration).manifest("rollout").info.get(
                    "rollout_backend")
        total = time.perf_counter() - it_start
        update._wait_for_state("actor")  # memory measured once the state snapshot is on the host
        gen = stages["rollout"]
        results["iterations"].append({
            "iteration": iteration, "total_s": round(total, 2), "stages": stages,
            "rollout_tokens_per_s": round(gen["perf/response_tokens"] / gen["wall_s"], 1),
            "update_mfu": update_mfu(run, iteration, stages["update_actor"]),
            "allocated_gib_after": round(torch.cuda.memory_allocated() / 2**30, 3),
            "reserved_gib_after": round(torch.cuda.memory_reserved() / 2**30, 3),
        })
        print(json.dumps(results["iterations"][-1]), flush=True)
    started = time.perf_counter()
    update.drain()
    results["drain_trainer_state_s"] = round(time.perf_counter() - started, 2)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    results["params"] = "494M (Qwen2.5-0.5B shape: " + json.dumps({k: getattr(config, k, v) for k, v in QWEN25_05B.items()}) + ")"
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
