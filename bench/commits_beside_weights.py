"""How long the small commits of the stages that run beside an update's background weights commit take
(each a manifest written and fsync'd, as a skipped stage's is), with the weights written buffered or
paced (``PacedWriter``), through kfrl's own store and writer:

    python bench/commits_beside_weights.py [--gib 3] [--dir DIR] [--out result.json]

The weights are a host state dict of bf16 tensors of 64 MiB (a 1.5B model's weights are 3 GiB)."""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from kfrl.models.hf_io import write_hf_dir
from kfrl.store import Store, settle_in_flight


def one_mode(root: Path, weights: dict, paced: bool) -> dict:
    store = Store(str(root / ("paced" if paced else "buffered")))
    done = threading.Event()
    started = time.perf_counter()

    def write(folder):
        write_hf_dir(folder, {}, weights, None, paced=paced)

    attempt = store.open_attempt("iter-000001/update_actor")
    attempt.write_in_background(write)
    attempt.commit()
    waiter = threading.Thread(target=lambda: (settle_in_flight(), done.set()))
    waiter.start()
    commits = []
    k = 0
    while not done.is_set():
        t0 = time.perf_counter()
        store.open_attempt(f"iter-000002/stage{k:03d}").commit()
        commits.append(time.perf_counter() - t0)
        k += 1
        time.sleep(0.05)
    waiter.join()
    return {"weights_commit_s": round(time.perf_counter() - started, 2), "commits": len(commits),
            "commit_median_s": round(statistics.median(commits), 4), "commit_max_s": round(max(commits), 4),
            "commit_mean_s": round(statistics.fmean(commits), 4)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=3.0)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--modes", default="buffered,paced,buffered,paced")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    count = max(1, int(args.gib * 16))
    weights = {f"w{i:04d}": torch.full((32 * 2**20,), float(i), dtype=torch.bfloat16) for i in range(count)}
    root = Path(tempfile.mkdtemp(prefix="kfrl-beside-", dir=args.dir))
    result = {"gib": args.gib, "runs": []}
    for k, mode in enumerate(args.modes.split(",")):
        row = {"mode": mode, **one_mode(root / str(k), weights, paced=mode == "paced")}
        result["runs"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    import shutil
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
