"""How long a small committed file (written, fsync'd: what a stage's manifest costs) takes while a
multi-GB file is written beside it, with the big write flushed only at its end or every few chunks.

    python bench/fsync_beside_write.py [--dir DIR] [--gib 6] [--out result.json]

On ext4 (data=ordered) an fsync commits the journal, which first writes out the data blocks other
files have dirtied: a manifest fsync'd beside a 6 GB trainer-state write waits for much of that write.
Flushing the big file as it goes (``os.fdatasync`` every ``--flush-mib``) bounds what can pile up;
``streaming`` starts the write-out of each chunk as it is written and waits for the one before
(``sync_file_range``), so at most two chunks are ever dirty; ``direct`` writes with ``O_DIRECT``, past
the page cache, so no journal commit has the big file's data to write out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

CHUNK = 64 * 2**20


def _sync_file_range():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    call = libc.sync_file_range
    call.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    return call


SYNC_WAIT_BEFORE, SYNC_WRITE, SYNC_WAIT_AFTER = 1, 2, 4


def big_write(path: Path, gib: float, flush_every: int, done: threading.Event, mode: str = "buffered") -> float:
    import mmap

    data = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
    data.write(os.urandom(CHUNK))
    started = time.perf_counter()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if mode == "direct" else 0)
    fd = os.open(path, flags, 0o644)
    sync_range = _sync_file_range() if mode == "streaming" else None
    try:
        for k in range(int(gib * 2**30 // CHUNK)):
            os.pwrite(fd, data, k * CHUNK)
            if sync_range is not None:
                sync_range(fd, k * CHUNK, CHUNK, SYNC_WRITE)
                if k:
                    sync_range(fd, (k - 1) * CHUNK, CHUNK, SYNC_WAIT_BEFORE | SYNC_WRITE | SYNC_WAIT_AFTER)
                    os.posix_fadvise(fd, (k - 1) * CHUNK, CHUNK, os.POSIX_FADV_DONTNEED)
            if flush_every and (k + 1) % flush_every == 0:
                os.fdatasync(fd)
        os.fsync(fd)
    finally:
        os.close(fd)
        done.set()
    return time.perf_counter() - started


def small_commits(folder: Path, done: threading.Event) -> list[float]:
    latencies = []
    k = 0
    while not done.is_set():
        started = time.perf_counter()
        path = folder / f"manifest-{k}.json"
        with open(path, "w") as fh:
            fh.write(json.dumps({"k": k, "files": ["x"] * 20}))
            fh.flush()
            os.fsync(fh.fileno())
        latencies.append(time.perf_counter() - started)
        k += 1
        time.sleep(0.05)
    return latencies


def trial(folder: Path, gib: float, flush_every: int, mode: str = "buffered") -> dict:
    done = threading.Event()
    out = {}
    writer = threading.Thread(target=lambda: out.setdefault("big_write_s", big_write(folder / "big.bin", gib, flush_every,
                                                                                      done, mode)))
    writer.start()
    latencies = small_commits(folder, done)
    writer.join()
    (folder / "big.bin").unlink()
    for p in folder.glob("manifest-*.json"):
        p.unlink()
    return {"big_write_s": round(out["big_write_s"], 2), "commits": len(latencies),
            "commit_median_s": round(statistics.median(latencies), 4), "commit_max_s": round(max(latencies), 4),
            "commit_mean_s": round(statistics.mean(latencies), 4)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--gib", type=float, default=6.0)
    parser.add_argument("--modes", default="buffered:0,buffered:256,buffered:1024,buffered:0",
                        help="comma-separated MODE:FLUSH_MIB (MODE: buffered, streaming, direct)")
    parser.add_argument("--chunk-mib", type=int, default=64, help="the big write's chunk")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    global CHUNK
    CHUNK = args.chunk_mib * 2**20
    folder = Path(tempfile.mkdtemp(prefix="kfrl-fsync-", dir=args.dir))
    result = {"dir": str(folder), "chunk_mib": args.chunk_mib}
    for item in args.modes.split(","):
        mode, flush_mib = item.split(":")
        flush_mib = int(flush_mib)
        name = mode + (f", flush every {flush_mib} MiB" if flush_mib else ", flush at the end")
        while name in result:
            name += " (again)"
        result[name] = trial(folder, args.gib, flush_mib * 2**20 // CHUNK, mode)
        print(name, result[name], flush=True)
    folder.rmdir()
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
