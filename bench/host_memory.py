"""What host memory for a snapshot costs on this machine, and what it does to a thread beside it.

    python bench/host_memory.py [--gib 2] [--out host_memory.json]

A trainer-state snapshot copies 12 bytes per parameter off the GPU. Before the first snapshot the
process holds no host memory of that size: it must be allocated, touched (on a VM whose memory grows
as it is used, the first touch of a page is what is slow) and, for fast asynchronous copies, page-locked
(pinned). This times each way of getting such memory, the copy into it, and the longest gap a main
thread that keeps launching small GPU kernels sees while another thread does it. Each row uses memory
the process has not touched before (``fresh``) or memory freed just before (``reused``).
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=2.0, help="size of each buffer")
    parser.add_argument("--piece-mib", type=int, default=64, help="piece size of the piecewise variants")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch

    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    nbytes = int(args.gib * 2**30)
    piece = args.piece_mib * 2**20
    device_src = torch.randn(nbytes // 4, device="cuda")
    side = torch.cuda.Stream()
    cudart = torch.cuda.cudart()
    work = torch.randn(2048, 2048, device="cuda")

    def main_thread_gaps(action) -> tuple[float, float, float]:
        """(seconds the action took on a thread, the main thread's longest gap between two launches
        of a small GPU op with a sync, the median gap)."""
        done = threading.Event()
        result = {}

        def run():
            started = time.perf_counter()
            action()
            result["s"] = time.perf_counter() - started
            done.set()

        gaps = []
        thread = threading.Thread(target=run)
        last = time.perf_counter()
        thread.start()
        while not done.is_set():
            torch.mm(work, work, out=work.new_empty(work.shape))
            torch.cuda.synchronize()
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        thread.join()
        gaps.sort()
        return result["s"], max(gaps), gaps[len(gaps) // 2]

    held: list = []

    def pageable_touch():
        t = torch.empty(nbytes, dtype=torch.uint8)
        t.fill_(1)
        held.append(t)

    def pageable_touch_pieces():
        for start in range(0, nbytes, piece):
            t = torch.empty(min(piece, nbytes - start), dtype=torch.uint8)
            t.fill_(1)
            held.append(t)

    def pinned_alloc():
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        t.fill_(1)
        held.append(t)

    def touched_then_registered(pieces: bool):
        def action():
            t = torch.empty(nbytes, dtype=torch.uint8)
            t.fill_(1)
            step = piece if pieces else nbytes
            for start in range(0, nbytes, step):
                size = min(step, nbytes - start)
                assert cudart.cudaHostRegister(t.data_ptr() + start, size, 0) == 0
            held.append(("registered", t, step))
        return action

    def release():
        for item in held:
            if isinstance(item, tuple):
                _, t, step = item
                for start in range(0, t.numel(), step):
                    cudart.cudaHostUnregister(t.data_ptr() + start)
        held.clear()

    def copy_into(host):
        def action():
            with torch.cuda.stream(side):
                host.copy_(device_src.view(torch.uint8), non_blocking=True)
                side.synchronize()
        return action

    rows = []

    def measure(name, action, memory):
        seconds, worst_gap, median_gap = main_thread_gaps(action)
        rows.append({"what": name, "memory": memory, "gib": args.gib, "s": round(seconds, 3),
                     "gib_per_s": round(args.gib / seconds, 2) if seconds > 0 else None,
                     "main_thread_worst_gap_s": round(worst_gap, 4), "main_thread_median_gap_s": round(median_gap, 5)})
        print(json.dumps(rows[-1]), flush=True)

    # Fresh memory each: the process's footprint grows by one buffer per row.
    measure("pageable alloc + touch (one buffer)", pageable_touch, "fresh")
    measure(f"pageable alloc + touch ({args.piece_mib} MiB pieces)", pageable_touch_pieces, "fresh")
    measure("pinned alloc (torch pin_memory) + touch", pinned_alloc, "fresh")
    measure("touch, then cudaHostRegister whole", touched_then_registered(False), "fresh")
    measure(f"touch, then cudaHostRegister in {args.piece_mib} MiB pieces", touched_then_registered(True), "fresh")
    release()
    # The same sizes again: pages the guest has already been given.
    measure("pageable alloc + touch (one buffer)", pageable_touch, "reused")
    measure("pinned alloc (torch pin_memory) + touch", pinned_alloc, "reused")
    measure("touch, then cudaHostRegister whole", touched_then_registered(False), "reused")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.fill_(0)
    registered = torch.empty(nbytes, dtype=torch.uint8)
    registered.fill_(0)
    assert cudart.cudaHostRegister(registered.data_ptr(), nbytes, 0) == 0
    for _ in range(2):
        measure("D2H copy into pinned (side stream)", copy_into(pinned), "held")
        measure("D2H copy into registered (side stream)", copy_into(registered), "held")
        measure("D2H copy into pageable, touched (side stream)", copy_into(pageable), "held")
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
