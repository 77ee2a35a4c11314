"""What the first attention pass at a new shape costs, by SDPA backend, on one GPU.

    python bench/sdpa_first_call.py [--out result.json]

The actor update's micro-batches are cut to their longest sequence, and a micro-batch with a padded
row takes an explicit mask where one without takes the causal path: each new (length, mask) pair is
a new shape for the attention kernel. This times forward + backward of
``scaled_dot_product_attention`` (Qwen2.5-0.5B's 14 heads of 64, 32 rows, bf16) at lengths never seen
before in the process, the first call and the second, with PyTorch's default backend choice and with
cuDNN's attention left out (``kfrl.engines.inference.attention_kernels``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path


def first_and_second(length: int, masked: bool, backends) -> tuple[float, float]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    def one() -> float:
        q, k, v = (torch.randn(32, 14, length, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        mask = None
        if masked:
            mask = torch.ones(length, length, device="cuda", dtype=torch.bool).tril()
            mask = mask.expand(32, 1, length, length).clone()
            mask[0, :, :, :5] = False  # one left-padded row
            mask[0, :, :5, :5] = torch.eye(5, device="cuda", dtype=torch.bool)  # padded rows see themselves
        torch.cuda.synchronize()
        started = time.perf_counter()
        with sdpa_kernel(backends) if backends is not None else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        out.float().sum().backward()
        torch.cuda.synchronize()
        return time.perf_counter() - started

    return one(), one()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import torch
    from torch.nn.attention import SDPBackend

    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    first_and_second(128, False, None)  # CUDA context, cuBLAS, allocator: not what is measured
    without_cudnn = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for name, backends, lengths in (("default", None, (389, 388, 381, 300)),
                                    ("without cuDNN", without_cudnn, (387, 386, 379, 301))):
        rows = []
        for length in lengths:
            for masked in (False, True):
                first, second = first_and_second(length, masked, backends)
                rows.append({"length": length, "mask": masked, "first_s": round(first, 4), "second_s": round(second, 4)})
                print(name, rows[-1], flush=True)
        result[name] = rows
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
