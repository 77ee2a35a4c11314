"""One update micro-batch with and without ``model.share_prompt_forward``: forward (log-probs of the
responses through kfrl's LM-head pass) and backward of a random-init Qwen2 of a ``gpu_iteration.SHAPES``
shape, the rows of TRL's workload (prompts x 4 samples, 133 + 256 tokens), alternating the two passes.

    python bench/shared_prompt.py --shape 1.5b --rows 32 --out shared.json          # on a GPU (bf16)
    python bench/shared_prompt.py --shape cpu --rows 16 --repeats 5 --device cpu    # on the CPU (fp32)

Reports the seconds per pass (median after the first of each), the tokens each computes, and the
largest difference between the two passes' log-probs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPT, RESPONSE, SAMPLES = 133, 256, 4
# A shape for the 2-core CPU machine: the FLOPs of the linear layers dominate, as at the real shapes.
CPU_SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=4096, max_position_embeddings=1024, rope_theta=1_000_000.0,
                 tie_word_embeddings=True, rms_norm_eps=1e-6)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="cpu", help="'cpu' or a gpu_iteration.SHAPES key (0.5b, 1.5b, 7b)")
    parser.add_argument("--rows", type=int, default=32, help="rows of the micro-batch (a multiple of 4)")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile", action="store_true", help="print each pass's top GPU kernels")
    args = parser.parse_args()

    import torch
    import transformers

    from gpu_iteration import SHAPES
    from kfrl.engines import inference
    from kfrl.trajectory import Trajectories

    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = CPU_SHAPE if args.shape == "cpu" else SHAPES[args.shape]
    config = transformers.Qwen2Config(**shape, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(args.device):
        model = transformers.Qwen2ForCausalLM(config).to(dtype).train()
    if args.gradient_checkpointing:  # as the update enables it (actor.gradient_checkpointing)
        from kfrl.stages.update import enable_gradient_checkpointing

        enable_gradient_checkpointing(model, "cuda" if cuda else "cpu")
    g = torch.Generator().manual_seed(0)
    vocab = shape["vocab_size"]
    prompts = [torch.randint(10, vocab, (PROMPT,), generator=g).tolist() for _ in range(args.rows // SAMPLES)]
    rows = [p for p in prompts for _ in range(SAMPLES)]
    responses = [torch.randint(10, vocab, (RESPONSE,), generator=g).tolist() for _ in rows]
    batch = Trajectories.from_lists(rows, responses, pad_id=0).to(args.device)
    layout = inference.prompt_sharing(model, batch, True)(torch.arange(len(rows)), batch)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def one_pass(name):
        use_layout = name == "shared"
        model.zero_grad(set_to_none=True)
        sync()
        start = time.perf_counter()
        log_probs, _ = inference.forward_response(model, batch, 1.0, False, layout=layout if use_layout else None)
        (log_probs * batch.response_mask).sum().backward()
        sync()
        return time.perf_counter() - start, log_probs.detach()

    times: dict[str, list[float]] = {"rows": [], "shared": []}
    log_probs_of, errors = {}, {}
    for _ in range(args.repeats):
        for name in list(times):
            if name in errors:
                continue
            try:
                seconds, log_probs_of[name] = one_pass(name)
            except Exception as error:  # a failing variant is reported, the others still measured
                errors[name] = f"{type(error).__name__}: {error}"[:2000]
                print(f"{name}: {errors[name]}", flush=True)
                continue
            times[name].append(seconds)
    if args.profile and cuda:
        from torch.profiler import ProfilerActivity, profile

        for name in times:
            if name in errors:
                continue
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                one_pass(name)
            print(f"PROFILE {name}\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                                                     max_name_column_width=60), flush=True)
    times = {name: values for name, values in times.items() if len(values) > 1}
    median = {name: statistics.median(values[1:]) for name, values in times.items()}
    plain = log_probs_of.get("rows")
    result = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "shape": args.shape, "dtype": str(dtype),
              "rows": args.rows, "gradient_checkpointing": args.gradient_checkpointing, "torch": torch.__version__,
              "tokens": {"rows": batch.input_ids.numel(), "shared": layout.source_rows.numel()},
              "seconds": {name: [round(v, 4) for v in values] for name, values in times.items()},
              "median_s": {name: round(v, 4) for name, v in median.items()},
              "over_rows": {name: round(v / median["rows"], 3) for name, v in median.items()},
              "max_logprob_difference": {name: float((lp - plain).abs().max()) for name, lp in log_probs_of.items()},
              "errors": errors}
    print("SUMMARY " + json.dumps({k: v for k, v in result.items() if k != "seconds"}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
