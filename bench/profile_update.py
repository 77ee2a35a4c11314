"""Where the actor update's and the weights commit's seconds go, on one GPU (Qwen2.5-0.5B shape).

    python bench/profile_update.py --out profile.json [--rows 256] [--micro 32] [--prompt 133] [--response 256]

Times ``kfrl.engines.actor.update_actor`` on a synthetic batch (one optimizer step over all rows,
TRL's workload by default) in variants that isolate one cost each, prints the CUDA kernels that
take the most time under ``torch.profiler``, and times the parts of the weights commit
(``kfrl.stages.update.save_weights``): the bf16 cast and copy to the host, the safetensors files, the
tokenizer, the MLmodel file, hashing, and the manifest commit, alone and with a 6 GB write running
beside it (what the background trainer-state write does). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        _sync()
        started = time.perf_counter()
        fn()
        _sync()
        best = min(best, time.perf_counter() - started)
    return round(best, 4)


def profile_update(model, args) -> dict:
    import torch

    from kfrl.config import load_config
    from kfrl.engines import inference
    from kfrl.engines.actor import update_actor
    from kfrl.stages.update import make_optimizer
    from kfrl.trajectory import Trajectories

    cfg = load_config(None, ["actor.lr=1e-6", f"actor.ppo_micro_batch_size_per_gpu={args.micro}"])
    optimizer = make_optimizer(model, cfg.actor)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (args.rows, args.prompt), generator=gen).tolist()
    responses = torch.randint(3, vocab, (args.rows, args.response), generator=gen).tolist()
    advantages = torch.randn(args.rows, generator=gen)
    fields = {"advantages": [[float(a)] * args.response for a in advantages]}
    on_policy = Trajectories.from_lists(prompts, responses, pad_id=0, fields=fields)
    fields["old_logprobs"] = [[-11.9] * args.response for _ in range(args.rows)]
    off_policy = Trajectories.from_lists(prompts, responses, pad_id=0, fields=fields)
    tokens = args.rows * (args.prompt + args.response)
    flops = 6 * sum(p.numel() for p in model.parameters()) * tokens

    def step(trajectories, actor_cfg=cfg.actor):
        return lambda: update_actor(model, optimizer, trajectories, actor_cfg, mini_batch_size=args.rows,
                                    temperature=1.0, autocast_dtype=torch.bfloat16, seed=0)

    out = {"tokens": tokens, "model_flops_per_step": flops}
    variants = {
        "on-policy, entropy computed (TRL workload)": step(on_policy),
        "off-policy, no entropy": step(off_policy),
    }
    for name, fn in variants.items():
        fn()  # warm-up
        seconds = _timed(fn)
        out[name] = {"s": seconds, "mfu": round(flops / seconds / 989e12, 3)}
        print(name, out[name], flush=True)
    for micro in (args.micro * 2, args.micro * 4):
        if micro > args.rows:
            continue
        bigger = cfg.actor.model_copy(update={"ppo_micro_batch_size_per_gpu": micro})
        fn = step(on_policy, bigger)
        fn()
        seconds = _timed(fn)
        out[f"on-policy, micro-batch {micro}"] = {"s": seconds, "mfu": round(flops / seconds / 989e12, 3)}
        print(f"micro-batch {micro}", out[f"on-policy, micro-batch {micro}"], flush=True)
    for micro in (args.micro, args.micro * 4):
        out[f"GEMM ceiling, micro-batch {micro}"] = gemm_ceiling(model, micro * (args.prompt + args.response))
        print(f"GEMM ceiling, micro-batch {micro}", out[f"GEMM ceiling, micro-batch {micro}"], flush=True)
    unfused = inference.fused_applies
    inference.fused_applies = lambda *args: False
    seconds = _timed(step(on_policy))
    out["on-policy, unfused LM head (before)"] = {"s": seconds, "mfu": round(flops / seconds / 989e12, 3)}
    inference.fused_applies = unfused
    out["fused vs unfused LM head, one micro-batch"] = compare_fused(model, on_policy.select(slice(0, args.micro)))
    print(out["fused vs unfused LM head, one micro-batch"], flush=True)
    saved = inference.LOGIT_CHUNK_ELEMENTS
    for elements in (2**26, 2**30):
        inference.LOGIT_CHUNK_ELEMENTS = elements
        seconds = _timed(step(on_policy))
        out[f"on-policy, logit chunk 2^{elements.bit_length() - 1}"] = {"s": seconds}
    inference.LOGIT_CHUNK_ELEMENTS = saved

    from kfrl.stages.update import compile_layers

    if torch.cuda.is_available():
        compile_layers(model)
        started = time.perf_counter()
        step(on_policy)()
        _sync()
        out["torch.compile: first update (compiles)"] = {"s": round(time.perf_counter() - started, 2)}
        seconds = _timed(step(on_policy))
        out["on-policy, torch.compile blocks"] = {"s": seconds, "mfu": round(flops / seconds / 989e12, 3)}
        print(out["on-policy, torch.compile blocks"], flush=True)

    # Forward+backward of the body alone (no LM head): the transformer's share.
    device = next(model.parameters()).device
    batch = on_policy.to(device).select(slice(0, args.micro))

    def body():
        with torch.autocast(device.type, torch.bfloat16):
            hidden = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        hidden.float().pow(2).mean().backward()
    out["body fwd+bwd per micro-batch"] = {"s": _timed(body)}

    def body_nomask():
        with torch.autocast(device.type, torch.bfloat16):
            hidden = model.get_decoder()(input_ids=batch.input_ids).last_hidden_state
        hidden.float().pow(2).mean().backward()
    out["body fwd+bwd per micro-batch, no attention mask"] = {"s": _timed(body_nomask)}
    model.zero_grad(set_to_none=True)

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step(on_policy)()
        _sync()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    print(table, flush=True)
    out["profile_top"] = table
    return out


def gemm_ceiling(model, tokens: int) -> dict:
    """The model's own matrix products at one micro-batch of ``tokens`` tokens (each linear layer's
    forward, input-gradient and weight-gradient product, bf16, as many times as the model has them),
    timed alone: the update's MFU cannot pass what these reach on this GPU, whatever else is fused."""
    import torch

    config = model.config
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * hidden // config.num_attention_heads
    counts = {(hidden, hidden): 2 * layers, (hidden, kv): 2 * layers, (hidden, inter): 2 * layers,
              (inter, hidden): layers, (hidden, config.vocab_size): 1}
    device = next(model.parameters()).device
    total_s, total_flops, out = 0.0, 0, {}
    for (k, n), count in counts.items():
        x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        g = torch.randn(tokens, n, device=device, dtype=torch.bfloat16)
        seconds = _timed(lambda: (x @ w, g @ w.T, x.T @ g), repeats=5)
        total_s += seconds * count
        total_flops += 6 * tokens * k * n * count
        out[f"{k}x{n}"] = round(6 * tokens * k * n / seconds / 1e12, 1)
    return {"tokens": tokens, "tflops_per_shape": out, "s_per_micro_batch": round(total_s, 4),
            "mfu_ceiling": round(total_flops / total_s / 989e12, 3)}


def compare_fused(model, batch) -> dict:
    """Relative differences of log-probs, entropies and parameter gradients, fused against unfused."""
    import torch

    from kfrl.engines import inference

    batch = batch.to(next(model.parameters()).device)
    results = []
    fused = inference.fused_applies
    for use_fused in (True, False):
        inference.fused_applies = fused if use_fused else (lambda *args: False)
        model.zero_grad(set_to_none=True)
        logp, entropy = inference.forward_response(model, batch, 0.9, True, torch.bfloat16)
        (logp.mean() + 0.1 * entropy.mean()).backward()
        results.append((logp.detach(), entropy.detach(),
                        torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])))
    inference.fused_applies = fused
    model.zero_grad(set_to_none=True)

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    return {name: round(rel(a, b), 6) for name, a, b in zip(("logp", "entropy", "grads"), *results)}


def write_speeds(work: Path) -> dict:
    """Seconds to write 1 GiB (a bf16 0.5B checkpoint) from host memory with 1 or 4 threads (pwrite at
    disjoint offsets), into the benchmark's folder and into /dev/shm: what the file system allows."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    data = memoryview(bytearray(os.urandom(1 << 20) * 1024))
    out = {}
    for where in (work, Path("/dev/shm")):
        if not where.is_dir():
            continue
        for threads in (1, 4):
            path = where / f"speed-{threads}.bin"
            started = time.perf_counter()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            step = len(data) // threads
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda k: os.pwrite(fd, data[k * step:(k + 1) * step], k * step), range(threads)))
            os.close(fd)
            out[f"{where} x{threads}"] = round(time.perf_counter() - started, 3)
            path.unlink()
    import torch

    from kfrl.models.hf_io import write_safetensors

    pageable = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    pinned = torch.empty(len(data), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    pinned.copy_(pageable)
    for name, tensor in (("pageable", pageable), ("pinned", pinned)):
        for repeat in range(2):
            started = time.perf_counter()
            write_safetensors({"w": tensor}, work / f"st-{name}-{repeat}")
            out[f"write_safetensors 1 GiB from {name} memory, run {repeat + 1}"] = round(time.perf_counter() - started, 3)
    return out


def profile_commit(model, tokenizer, work: Path) -> dict:
    import torch

    from kfrl.models.hf_io import save_hf
    from kfrl.models.host_memory import on_host
    from kfrl.models.mlmodel import write_mlmodel
    from kfrl.store import Store

    out = {}
    store = Store(str(work / "store"))

    def parts(tag: str):
        folder = work / f"w-{tag}"
        timings = {}
        t0 = time.perf_counter()
        state = on_host(model.state_dict(), torch.bfloat16)
        timings["cast+to host (pinned, reused)"] = time.perf_counter() - t0
        del state
        t0 = time.perf_counter()
        save_hf(model, None, folder, dtype=torch.bfloat16)
        timings["save_hf (weights)"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        tokenizer.save_pretrained(folder, save_jinja_files=False)
        timings["tokenizer"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        write_mlmodel(folder, tokenizer, torch.bfloat16)
        timings["mlmodel (+ tokenizer copy)"] = time.perf_counter() - t0
        attempt = store.open_attempt(f"iter-000001/commit-{tag}")
        t0 = time.perf_counter()
        with attempt.staged_dir() as staged:
            save_hf(model, tokenizer, staged, dtype=torch.bfloat16)
            write_mlmodel(staged, tokenizer, torch.bfloat16)
        timings["whole staged_dir (save + hash)"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        attempt.commit(info={})
        timings["manifest commit"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        store.open_attempt(f"iter-000001/empty-{tag}").commit(info={"skipped": "x"})
        timings["empty commit (a skipped stage)"] = time.perf_counter() - t0
        return {k: round(v, 4) for k, v in timings.items()}

    parts("warm")
    out["alone"] = parts("alone")
    out["write 1 GiB from host memory"] = write_speeds(work)
    big = work / "big.bin"
    stop = threading.Event()

    def writer():
        chunk = bytes(64 << 20)
        with open(big, "wb") as fh:
            for _ in range(96):  # 6 GiB
                if stop.is_set():
                    break
                fh.write(chunk)
            fh.flush()
            import os

            os.fsync(fh.fileno())

    thread = threading.Thread(target=writer)
    thread.start()
    time.sleep(0.5)
    out["beside a 6 GiB write"] = parts("busy")
    stop.set()
    thread.join()
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--micro", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=133)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: checks the script runs")
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from gpu_iteration import build_model_dir

    work = Path(tempfile.mkdtemp(prefix="kfrl-bench-"))
    model_dir = build_model_dir(work / "model", "smoke" if args.smoke else "0.5b")
    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.cuda() if torch.cuda.is_available() else model
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    result = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
              "commit": profile_commit(model, tokenizer, work), "update": profile_update(model, args)}
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
