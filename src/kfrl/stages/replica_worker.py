"""One replica of a rollout or log-prob stage: ``python -m kfrl.stages.replica_worker --requests DIR``
under RANK / LOCAL_RANK (``kfrl.distributed.launch``). It reads ``DIR/request-<RANK>.pkl`` (the run, the
iteration, a function "module:name" and its keyword arguments), calls ``function(ctx, **kwargs)`` on
its device (``cuda:<LOCAL_RANK>``, or the CPU) and writes the result to ``DIR/result-<RANK>.pkl``."""
from __future__ import annotations

import argparse
import importlib
import os
import pickle
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kfrl.stages.replica_worker")
    parser.add_argument("--requests", required=True, help="the folder holding request-<rank>.pkl")
    args = parser.parse_args(argv)
    from kfrl.distributed.replicas import REPLICA_ENV

    os.environ[REPLICA_ENV] = "1"  # the stage code called below computes here, it starts no replicas
    rank = int(os.environ.get("RANK", "0"))
    folder = Path(args.requests)
    request = pickle.loads((folder / f"request-{rank}.pkl").read_bytes())
    from kfrl.stages.context import StageContext

    ctx = StageContext.open(request["run_uri"], request["iteration"])
    if ctx.device == "cuda":
        import torch

        # The launcher leaves one GPU visible to a replica; without that, the one of its local rank.
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank if torch.cuda.device_count() > local_rank else 0)
    module, _, name = request["function"].partition(":")
    result = getattr(importlib.import_module(module), name)(ctx, **request["kwargs"])
    partial = folder / f"result-{rank}.pkl.tmp"
    partial.write_bytes(pickle.dumps(result))
    partial.replace(folder / f"result-{rank}.pkl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
