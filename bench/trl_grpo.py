"""TRL's GRPOTrainer on the workload of ``gpu_iteration.py --workload trl``: the peer, measured in the
same device call as kfrl.

    python bench/trl_grpo.py --shape 0.5b --steps 10 --prompt-tokens 133 [--out trl.json]

Same model (``gpu_iteration.build_model_dir``: a random-init Qwen2.5 shape, the same word-level
tokenizer), same prompts (the arithmetic task with filler words, cut on the left to exactly
``--prompt-tokens`` tokens, as kfrl's ``data.truncation=left`` cuts them), 64 prompts x 4 samples of
up to 256 new tokens at temperature 1, GRPO without a KL term (TRL's default ``beta=0``), one
optimizer step per generation batch (micro-batches of 32, 8 accumulation steps), the same reward
(kfrl's rule for the task: ``#### <sum>``). TRL generates with transformers ``generate`` (no vLLM:
it cannot be installed on the device). Weights and AdamW state in bf16 unless ``--fp32-master``.

Each step's wall time runs from its start to the next step's start (TRL's callback hooks), so every
wait counts; the first step is reported apart (warm-up). Prints one JSON object and a SUMMARY line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def exact_length_prompts(model_dir: Path, prompt_tokens: int, rows: int) -> tuple[list[str], list[str]]:
    """(prompt texts, ground truths): each text encodes to exactly ``prompt_tokens`` tokens, the chat
    template included; the same token ids kfrl's rollout feeds the model."""
    import pyarrow.parquet as pq

    from gpu_iteration import write_long_prompts
    from kfrl.data.dataset import ground_truth_of, tokenize_prompts
    from kfrl.models.hf_io import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    path = write_long_prompts(Path(tempfile.mkdtemp(prefix="trl-data-")), prompt_tokens, rows)
    table = pq.read_table(path).to_pylist()
    ids = tokenize_prompts(tokenizer, [r["prompt"] for r in table], prompt_tokens, ["bench"] * len(table), "left")
    texts = [tokenizer.decode(x, skip_special_tokens=False) for x in ids]
    for text, expected in zip(texts[:8], ids[:8]):
        again = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert again == expected, "decoded prompts must encode back to the same tokens"
    return texts, [ground_truth_of(r) for r in table]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="0.5b")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--micro", type=int, default=32)
    parser.add_argument("--response-length", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=133)
    parser.add_argument("--fp32-master", action="store_true", help="load fp32 weights (autocast bf16), as kfrl keeps them")
    parser.add_argument("--lora-rank", type=int, default=0, help="train a LoRA adapter (peft, all-linear) of this rank")
    parser.add_argument("--lora-alpha", type=float, default=16)
    parser.add_argument("--model-dir", type=Path, default=None, help="a model folder built before (build_model_dir)")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape and batch on the CPU: checks the script runs")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.smoke:
        args.shape, args.steps, args.prompts, args.n, args.micro = "smoke", 3, 4, 2, 4
        args.response_length, args.prompt_tokens, args.fp32_master = 8, 40, True

    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from gpu_iteration import build_model_dir, model_parameters, wall_summary
    from kfrl.rewards.gsm8k import compute_score

    assert torch.cuda.is_available() or args.smoke, "this benchmark needs a CUDA device"
    cuda = torch.cuda.is_available()
    work = Path(tempfile.mkdtemp(prefix="trl-bench-"))
    model_dir = args.model_dir or build_model_dir(work / "model", args.shape)
    texts, truths = exact_length_prompts(model_dir, args.prompt_tokens, args.prompts * (args.steps + 2))
    dataset = Dataset.from_dict({"prompt": texts, "ground_truth": truths})

    def arith_reward(completions, ground_truth, **_):
        return [float(compute_score(c, g)) for c, g in zip(completions, ground_truth)]

    rows = args.prompts * args.n
    accumulation = rows // args.micro
    config = GRPOConfig(
        output_dir=str(work / "out"), max_steps=args.steps, per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=accumulation, num_generations=args.n,
        max_completion_length=args.response_length, temperature=1.0, learning_rate=1e-6, beta=0.0,
        bf16=cuda, use_cpu=not cuda, logging_steps=1, save_strategy="no", report_to="none", shuffle_dataset=False,
        model_init_kwargs={"dtype": torch.float32 if args.fp32_master else torch.bfloat16},
        disable_tqdm=True, seed=1)

    class StepClock(TrainerCallback):
        def __init__(self):
            self.starts: list[float] = []
            self.ended = 0.0
            self.logs: list[dict] = []

        def on_step_begin(self, *_, **__):
            self.starts.append(time.perf_counter())

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs:
                self.logs.append(dict(logs))

        def on_train_end(self, *_, **__):
            if cuda:
                torch.cuda.synchronize()
            self.ended = time.perf_counter()

    clock = StepClock()
    peft_config = None
    if args.lora_rank:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, target_modules="all-linear",
                                 lora_dropout=0.0, task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=arith_reward, args=config, train_dataset=dataset,
                          callbacks=[clock], peft_config=peft_config)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    trainer.train()
    run_s = time.perf_counter() - started
    bounds = clock.starts + [clock.ended]
    walls = [round(b - a, 3) for a, b in zip(bounds, bounds[1:])]
    lengths = [log.get("completions/mean_length") for log in clock.logs if "completions/mean_length" in log]
    steps = [{"step": i + 1, "wall_s": w, **({"completion_mean_length": lengths[i]} if i < len(lengths) else {})}
             for i, w in enumerate(walls)]
    result = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__, "trl": trl.__version__,
              "shape": args.shape, "params": model_parameters(model_dir),
              "master_dtype": "float32" if args.fp32_master else "bfloat16", "lora_rank": args.lora_rank,
              "gradient_checkpointing": config.gradient_checkpointing,
              "workload": {"prompts": args.prompts, "n": args.n, "prompt_tokens": args.prompt_tokens,
                           "response_length": args.response_length, "micro_batch": args.micro,
                           "accumulation": accumulation},
              "steps": steps, "step_wall": {"first_s": walls[0] if walls else None,
                                            "after_first": wall_summary(walls[1:]), "all": wall_summary(walls)},
              "completion_mean_length": round(statistics.fmean(lengths), 1) if lengths else None,
              "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None, "run_s": round(run_s, 2),
              "logs": clock.logs}
    text = json.dumps(result, indent=2)
    print(text)
    print("SUMMARY " + json.dumps({"peer": "trl", "shape": args.shape, "lora_rank": args.lora_rank, "steps": args.steps, "wall": result["step_wall"],
                                   "completion_mean_length": result["completion_mean_length"],
                                   "peak_gib": result["peak_gib"]}), flush=True)
    if args.out:
        args.out.write_text(text)
    import shutil

    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
