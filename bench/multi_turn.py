"""What a tool turn costs the torch rollout backend: one turn of R tokens against two turns of R/2
with a T-token tool answer between them, on the same prompts and model, in one process.

    python bench/multi_turn.py --shape 0.5b --device cuda --out results.json
    python bench/multi_turn.py --shape tiny --device cpu      # a smoke figure on CPU

Three runs (every sequence runs its full budget: a random-init model never emits EOS):
- ``single``: ``generate_responses``, R new tokens per sequence;
- ``kv_cache``: ``TorchTurns`` (the multi-turn session): R/2 tokens, then the T-token answer appended
  to the KV cache (``Decoder.extend``), then R/2 more;
- ``resubmit``: what a backend without a session does (``ResubmitTurns``): the second turn re-prefills
  the whole conversation.
Model tokens are the same in all three (R per sequence); the figure is model tokens per second, the
second of two runs (the first warms kernels and captures graphs). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="0.5b", help="a gpu_iteration.SHAPES key, or 'tiny' (the builtin tools model)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=133)
    parser.add_argument("--response-tokens", type=int, default=256)
    parser.add_argument("--tool-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    from kfrl.agent.loop import ResubmitTurns
    from kfrl.engines.decoder import Decoder
    from kfrl.engines.rollout import SamplingParams
    from kfrl.engines.rollout_torch import TorchRollout

    if args.shape == "tiny":
        from kfrl.models.tiny import materialize_builtin

        model_dir = materialize_builtin("tiny-qwen2-arith-tools")
        vocab = 100
    else:
        from gpu_iteration import SHAPES, build_model_dir

        model_dir = build_model_dir(Path(tempfile.mkdtemp()) / "model", args.shape)
        vocab = SHAPES[args.shape]["vocab_size"]
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    decoder = Decoder.from_pretrained(model_dir, device=args.device, dtype=dtype)
    # No EOS among the ids a random model samples: every sequence runs its whole budget.
    engine = TorchRollout(decoder, {vocab + 10**6}, 0)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (args.prompts, args.prompt_tokens), generator=generator).tolist()
    answer = torch.randint(3, vocab, (args.tool_tokens,), generator=generator).tolist()
    half = args.response_tokens // 2
    rows = args.prompts * args.n

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    def single():
        engine.generate_responses(prompts, SamplingParams(n=args.n, max_new_tokens=args.response_tokens), seed=1)

    def two_turns(turns):
        ignore = lambda row, generation: None  # noqa: E731
        turns.first(prompts, SamplingParams(n=args.n, max_new_tokens=half), 1, ignore)
        turns.next(list(range(rows)), [answer] * rows, [half] * rows, SamplingParams(n=args.n, max_new_tokens=half),
                   2, ignore)

    runs = {"single": single, "kv_cache": lambda: two_turns(engine.turns()),
            "resubmit": lambda: two_turns(ResubmitTurns(engine))}
    results = {"shape": args.shape, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "sequences": rows, "prompt_tokens": args.prompt_tokens, "response_tokens": args.response_tokens,
               "tool_tokens": args.tool_tokens, "runs": {}}
    for name, run in runs.items():
        seconds = []
        for _ in range(2):
            sync()
            started = time.perf_counter()
            run()
            sync()
            seconds.append(time.perf_counter() - started)
        results["runs"][name] = {"seconds": round(seconds[-1], 3),
                                 "model_tokens_per_s": round(rows * args.response_tokens / seconds[-1])}
        print(name, results["runs"][name], flush=True)
    base = results["runs"]["single"]["seconds"]
    for name in ("kv_cache", "resubmit"):
        results["runs"][name]["time_vs_single"] = round(results["runs"][name]["seconds"] / base, 3)
    print(json.dumps(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
