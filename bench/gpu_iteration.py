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
import threading
import time
from pathlib import Path

# Model shapes (random init): Qwen2.5-0.5B and -1.5B as published, and a tiny one that runs on a CPU.
SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1_000_000.0,
                 tie_word_embeddings=True, rms_norm_eps=1e-6),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1_000_000.0,
                 tie_word_embeddings=True, rms_norm_eps=1e-6),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rope_theta=1_000_000.0,
               tie_word_embeddings=False, rms_norm_eps=1e-6),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=2048, max_position_embeddings=4096, rope_theta=1_000_000.0,
                  tie_word_embeddings=True, rms_norm_eps=1e-6),
}


def build_model_dir(out: Path, shape: str = "0.5b") -> Path:
    """A random-init Qwen2 of ``shape`` (``SHAPES``) and a word-level tokenizer of its vocabulary size."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from kfrl.models.tiny import CHAT_TEMPLATE

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for word in "What is + ? user assistant".split() + [str(d) for d in range(10)]:
        vocab.setdefault(word, len(vocab))
    while len(vocab) < SHAPES[shape]["vocab_size"]:
        vocab[f"w{len(vocab)}"] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(True)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                        additional_special_tokens=["<|im_start|>"], padding_side="left")
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[shape], pad_token_id=0, eos_token_id=2, bos_token_id=0)
    if shape == "7b" and torch.cuda.is_available():  # 7B parameters initialise in seconds on the GPU, minutes on 16 cores
        with torch.device("cuda"):
            model = Qwen2ForCausalLM._from_config(config, dtype=torch.bfloat16)
    else:
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


def model_parameters(model_dir: Path) -> int:
    """The checkpoint's parameter count (tied tensors once), read from its safetensors headers."""
    from safetensors import safe_open

    from kfrl.models.hf_io import safetensors_files

    total = 0
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                shape = f.get_slice(key).get_shape()
                count = 1
                for dim in shape:
                    count *= dim
                total += count
    return total


def update_mfu(run, iteration: int, stage: dict, params: int, flops_per_token_param: int = 6) -> float | None:
    """Model FLOPs utilisation of the actor update's compute: 6 x parameters x tokens trained (prompt and
    response, padding excluded) over the update's seconds without its checkpoint and hand-off. LoRA
    (``flops_per_token_param`` 4): the frozen weights need no weight gradient, so forward (2) and the
    gradient of the activations (2) are the work; the adapters' own FLOPs are under 1 % at rank 64."""
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
    return round(flops_per_token_param * params * tokens / compute_s / peak_flops(), 3) if compute_s > 0 else None


def peak_flops() -> float:
    """The dense bf16 peak of the GPU in use (H100 SXM: 989 TF/s as the H200; the same tensor cores)."""
    return H200_BF16_DENSE_FLOPS


def wall_summary(walls: list[float]) -> dict:
    """Mean, median, worst and worst/median of iteration wall times."""
    import statistics

    if not walls:
        return {}
    median = statistics.median(walls)
    return {"n": len(walls), "mean_s": round(statistics.fmean(walls), 3), "median_s": round(median, 3),
            "worst_s": round(max(walls), 3), "best_s": round(min(walls), 3),
            "worst_over_median": round(max(walls) / median, 2) if median > 0 else None}


def apply_kernel_settings(settings: list[str]) -> None:
    """Set integer constants of ``kfrl.engines.kernels`` from NAME=VALUE strings (e.g. ATTENTION_SPLITS=2)."""
    from kfrl.engines import kernels

    for setting in settings:
        name, value = setting.split("=")
        if not hasattr(kernels, name):
            raise SystemExit(f"kfrl.engines.kernels has no {name}")
        setattr(kernels, name, int(value))


class StageIO:
    """Seconds a stage spends in reading its input groups, writing its column group and committing (kfrl's
    functions for those, wrapped in this process; the rest of a stage's wall time is its own work), so
    that a stage that is slow in one iteration shows which of the three, or none, it waited in; and the
    cyclic collections that ran during it (``count_collections``)."""

    def __init__(self) -> None:
        import collections

        self.seconds: dict[str, float] = collections.Counter()
        self._depth: dict[str, int] = collections.Counter()
        self.gc_seconds = 0.0
        self.gc_full = 0

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():  # a background commit: not a stage's
                return original(*args, **kwargs)
            self._depth[label] += 1
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._depth[label] -= 1
                if self._depth[label] == 0:  # the outermost call of a recursive one counts once
                    self.seconds[label] += time.perf_counter() - started

        setattr(owner, name, timed)

    def count_collections(self) -> None:
        """Python's cyclic collections during each stage, whatever thread ran them (a collection holds the
        GIL, so every thread of the process waits): their seconds (``gc_s``) and the full ones (``gc_full``)."""
        import gc

        started = {}

        def callback(phase: str, info: dict) -> None:
            if phase == "start":
                started["at"] = time.perf_counter()
            elif "at" in started:
                self.gc_seconds += time.perf_counter() - started.pop("at")
                self.gc_full += info["generation"] == 2

        gc.callbacks.append(callback)

    def take(self) -> dict[str, float]:
        taken = {f"io_{label}_s": round(seconds, 4) for label, seconds in self.seconds.items()}
        taken.update(gc_s=round(self.gc_seconds, 4), gc_full=self.gc_full)
        self.seconds.clear()
        self.gc_seconds, self.gc_full = 0.0, 0
        return taken

    @classmethod
    def installed(cls) -> "StageIO":
        from kfrl import batch
        from kfrl.stages.context import StageContext
        from kfrl.store import Attempt

        io = cls()
        io.count_collections()
        io.wrap(StageContext, "read_groups", "read")
        io.wrap(batch, "write_group", "write")
        io.wrap(Attempt, "commit", "commit")
        return io


def gpu_kernel_profile(fn, top: int = 25):
    """(fn(), profile): ``fn`` run under torch.profiler; its wall seconds, the sum of its GPU kernels' times
    (the GPU's busy time where kernels do not overlap: what the wall time would be with no gaps), their
    count, and the ``top`` kernels by total time (name, ms, calls)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    wall = time.perf_counter() - started
    kernels = [e for e in prof.key_averages() if getattr(e, "device_type", None) == DeviceType.CUDA]

    def device_us(event) -> float:
        return float(getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0))

    kernels.sort(key=device_us, reverse=True)
    busy = sum(device_us(e) for e in kernels) / 1e6
    # The host side of the same stage: time spent inside CUDA runtime calls (launches, copies, waits).
    # A large share in synchronising calls means the host waits for the GPU; a small one with a low
    # busy fraction means the host's own work (Python, dispatch) is what the GPU waits for.
    runtime = sorted((e for e in prof.key_averages() if e.key.startswith(("cuda", "cu")) and
                      getattr(e, "device_type", None) != DeviceType.CUDA),
                     key=lambda e: e.self_cpu_time_total, reverse=True)
    return result, {"wall_s": round(wall, 3), "kernel_sum_s": round(busy, 3), "busy_fraction": round(busy / wall, 3),
                    "kernel_calls": sum(e.count for e in kernels),
                    "top": [{"name": e.key[:110], "ms": round(device_us(e) / 1e3, 2), "calls": e.count}
                            for e in kernels[:top]],
                    "host_runtime_calls": [{"name": e.key, "ms": round(e.self_cpu_time_total / 1e3, 2),
                                            "calls": e.count} for e in runtime[:8]]}


def synchronizing_sites(fn, top: int = 15):
    """(fn(), sites): ``fn`` run with CUDA's sync debug mode on, and the Python lines (the innermost three
    frames of kfrl, transformers, liger or this bench) whose operations made the host wait for the GPU,
    with their counts: what stalls the launch queue inside a stage."""
    import collections
    import traceback
    import warnings

    import torch

    counts: collections.Counter = collections.Counter()

    def tally(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1]
                  if any(part in f.filename for part in ("/kfrl/", "/transformers/", "/liger_kernel/", "/bench/"))]
        counts[" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-3:]))] += 1

    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = tally
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    return result, {"synchronizing_calls": sum(counts.values()),
                    "sites": [{"where": where, "calls": n} for where, n in counts.most_common(top)]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b", help="the random-init model's shape")
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
                        help="stages (comma-separated) to run under cProfile at --profile-iteration (top functions go "
                             "in the JSON)")
    parser.add_argument("--profile-iteration", type=int, default=3,
                        help="the iteration --profile-stage and --torch-profile-stage look at (--sync-sites-stage: "
                             "the one after)")
    parser.add_argument("--torch-profile-stage", default="",
                        help="stages (comma-separated) to run under torch.profiler at --profile-iteration: the sum "
                             "of their GPU kernels' times against the stage's wall time, the top kernels and the host's "
                             "CUDA runtime calls go in the JSON")
    parser.add_argument("--sync-sites-stage", default="",
                        help="stages (comma-separated) to run with CUDA's sync debug mode after --profile-iteration: "
                             "the Python lines whose operations made the host wait for the GPU, counted, go in the JSON")
    parser.add_argument("--kernel-setting", action="append", default=[], metavar="NAME=VALUE",
                        help="set an integer constant of kfrl.engines.kernels (e.g. ATTENTION_SPLITS=2) first")
    parser.add_argument("--keep-weights", type=int, default=0,
                        help="delete the policy weights of iterations older than the newest K as the run goes "
                             "(0: keep all); for shapes whose 20 iterations of weights fill the disk")
    parser.add_argument("--no-state-reserve", action="store_true",
                        help="do not build the trainer-state snapshot's host buffers on a thread ahead of it "
                             "(HostBuffers.reserve): to see what that thread costs the stages beside it")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="a model folder built before (build_model_dir) instead of a new one")
    parser.add_argument("--smoke", action="store_true", help="the smoke shape and a small batch, on the CPU when no GPU "
                        "is present: checks the script runs")
    parser.add_argument("overrides", nargs="*", help="extra config overrides, e.g. algorithm.adv_estimator=gae")
    args = parser.parse_args()
    if args.smoke:
        args.shape, args.prompts, args.n, args.response_length = "smoke", 4, 2, 8
        args.prompt_tokens = min(args.prompt_tokens, 40)

    import torch

    from kfrl.config import load_config
    from kfrl.stages import STAGES, context, run_stage, update
    from kfrl.stages.prepare import prepare_run
    from kfrl.store import Store

    cuda = torch.cuda.is_available()
    # The smoke shape runs on the CPU too: with --smoke as a check that the script runs, without it at the
    # workload's batch shape, which times the stages' host work (scoring, advantages, the store).
    assert cuda or args.shape == "smoke", "this benchmark needs a CUDA device (or --shape smoke)"
    if not cuda:  # CUDA's memory statistics read as zero
        for name in ("reset_peak_memory_stats", "synchronize"):
            setattr(torch.cuda, name, lambda *a, **k: None)
        for name in ("max_memory_allocated", "memory_allocated", "memory_reserved"):
            setattr(torch.cuda, name, lambda *a, **k: 0)
        torch.cuda.get_device_name = lambda *a, **k: "cpu"
    apply_kernel_settings(args.kernel_setting)
    if args.cudnn_attention:
        from kfrl.engines import inference

        inference.AVOID_CUDNN_ATTENTION = False
    work = Path(tempfile.mkdtemp(prefix="kfrl-bench-"))
    t0 = time.perf_counter()
    model_dir = args.model_dir or build_model_dir(work / "model", args.shape)
    build_s = time.perf_counter() - t0
    params = model_parameters(model_dir)
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
            *([f"actor.ppo_mini_batch_size={max(1, args.prompts // 4)}",  # 4 mini-batches (16 of the 64 prompts)
               f"actor.ppo_micro_batch_size_per_gpu={max(1, args.prompts // 4)}", "actor.use_kl_loss=true"]
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

    from transformers import AutoConfig

    shape = AutoConfig.from_pretrained(model_dir)
    update.write_states_in_background(not args.per_task)
    if args.no_state_reserve:  # the trainer-state buffers built when the first snapshot is due, not ahead
        update.reserve_state_buffers = lambda *a, **k: False
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "model": f"Qwen2.5-{args.shape.upper()} shape, random init" if args.shape != "smoke" else "smoke shape",
               "params": params, "shape": {k: getattr(shape, k, None) for k in SHAPES[args.shape]},
               "config": str(args.config) if args.config else None, "workload": args.workload,
               "mode": "per_task" if args.per_task else "resident", "cudnn_attention": args.cudnn_attention,
               "trainer_state_freq": cfg.trainer.trainer_state_freq, "state_reserve": not args.no_state_reserve,
               "build_model_s": build_s, "prepare_s": prepare_s, "overrides": overrides, "iterations": []}
    # An iteration's wall time runs from its start to the next one's start: whatever the process waits
    # for in between (a trainer-state snapshot, a background commit, this script's own bookkeeping)
    # belongs to some iteration. The last one ends with its stages; the final wait for its background
    # writes (the last trainer state, written at the end of every run) is the run's, reported as drain_s
    # and counted in run_s.
    starts: list[float] = []
    stage_io = StageIO.installed()
    profiled = min(args.profile_iteration, args.iterations)  # the sync sites: the iteration after it

    def asked(stages_option: str, stage: str, iteration: int, at: int) -> bool:
        return stage in stages_option.split(",") and iteration == min(at, args.iterations)

    def sync_stages() -> None:
        if cuda:
            torch.cuda.current_stream().synchronize()

    for iteration in range(1, args.iterations + 1):
        stages = {}
        starts.append(time.perf_counter())
        for stage in STAGES:
            torch.cuda.reset_peak_memory_stats()
            # The stream the stages queue their kernels on, not the device: a copy to the host memory
            # (the weights of the last update, a trainer state) runs beside them on its own stream.
            sync_stages()
            t0 = time.perf_counter()
            if asked(args.profile_stage, stage, iteration, profiled):
                import cProfile
                import io
                import pstats

                profiler = cProfile.Profile()
                result = profiler.runcall(run_stage, stage, run.uri, iteration)
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
                results.setdefault("profiles", {})[f"{stage}@{iteration}"] = text.getvalue()[-16000:]
            elif asked(args.torch_profile_stage, stage, iteration, profiled):
                result, kernels = gpu_kernel_profile(lambda: run_stage(stage, run.uri, iteration))
                results.setdefault("kernel_profiles", {})[f"{stage}@{iteration}"] = kernels
            elif asked(args.sync_sites_stage, stage, iteration, profiled + 1):
                result, sites = synchronizing_sites(lambda: run_stage(stage, run.uri, iteration))
                results.setdefault("sync_sites", {})[f"{stage}@{iteration}"] = sites
            else:
                result = run_stage(stage, run.uri, iteration)
            if args.per_task:
                update.drain()
                update._RESIDENT_TRAINERS.clear()
                context._MODEL_CACHE.clear()
                context._MODEL_SLOTS.clear()
                torch.cuda.empty_cache()
            sync_stages()
            stages[stage] = {"wall_s": round(time.perf_counter() - t0, 3),
                             "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                             "skipped": result.skipped or None, **stage_io.take()}
            stages[stage].update({k: round(v, 4) for k, v in result.metrics.items()
                                  if k.startswith(("timing_s/", "response_length/mean", "perf/", "actor/grad_norm",
                                                   "critic/score/mean", "val-core/"))})
            if stage == "rollout":
                from kfrl.stages.context import StageContext

                stages[stage]["backend"] = StageContext.open(run.uri, iteration).manifest("rollout").info.get(
                    "rollout_backend")
        gen = stages["rollout"]
        record = {
            "iteration": iteration, "stages_s": round(time.perf_counter() - starts[-1], 2), "stages": stages,
            "rollout_tokens_per_s": round(gen["perf/response_tokens"] / gen["wall_s"], 1),
            "update_mfu": update_mfu(run, iteration, stages["update_actor"], params,
                                     4 if cfg.model.lora_rank else 6),
            "allocated_gib_after": round(torch.cuda.memory_allocated() / 2**30, 3),
            "reserved_gib_after": round(torch.cuda.memory_reserved() / 2**30, 3),
            "peak_gib": max(stage["peak_mem_gib"] for stage in stages.values()),
            "max_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
        }
        results["iterations"].append(record)
        if args.keep_weights and iteration - args.keep_weights >= 1:
            from kfrl.run import stage_prefix

            run.remove_commit(stage_prefix(iteration - args.keep_weights, "update_actor"))
        if iteration > 1:
            previous = results["iterations"][-2]
            previous["wall_s"] = round(starts[-1] - starts[-2], 3)
            print(json.dumps({k: v for k, v in previous.items() if k != "stages"}), flush=True)
    started = time.perf_counter()
    last = results["iterations"][-1]
    last["wall_s"] = round(started - starts[-1], 3)
    update.drain()
    ended = time.perf_counter()
    results["drain_s"] = round(ended - started, 2)
    print(json.dumps({k: v for k, v in last.items() if k != "stages"}), flush=True)
    walls = [r["wall_s"] for r in results["iterations"]]
    results["iteration_wall"] = {"first_s": walls[0], "after_first": wall_summary(walls[1:]),
                                 "all": wall_summary(walls)}
    results["run_s"] = round(ended - starts[0], 2)
    text = json.dumps(results, indent=2)
    print(text)
    import statistics

    warm = results["iterations"][1:] or results["iterations"]
    stage_median = {stage: round(statistics.median(r["stages"][stage]["wall_s"] for r in warm), 3)
                    for stage in ("rollout", "update_actor")}
    print("SUMMARY " + json.dumps({"shape": args.shape, "params": params, "iterations": args.iterations,
                                   "lora_rank": cfg.model.lora_rank, "master_dtype": cfg.actor.master_dtype,
                                   "optimizer": cfg.actor.optimizer,
                                   "offload": [cfg.actor.param_offload, cfg.actor.optimizer_offload],
                                   "stage_median_s": stage_median,
                                   "max_reserved_gib": max(r["max_reserved_gib"] for r in results["iterations"]),
                                   "trainer_state_freq": cfg.trainer.trainer_state_freq,
                                   "wall": results["iteration_wall"], "drain_s": results["drain_s"],
                                   "rollout_tok_s": round(sum(r["rollout_tokens_per_s"] for r in results["iterations"][1:])
                                                          / max(1, len(walls) - 1)),
                                   "update_mfu": [r["update_mfu"] for r in results["iterations"]],
                                   "peak_gib": max(r["peak_gib"] for r in results["iterations"])}), flush=True)
    if args.out:
        args.out.write_text(text)
    import shutil

    shutil.rmtree(work, ignore_errors=True)  # tens of GB of checkpoints at the larger shapes


if __name__ == "__main__":
    main()
