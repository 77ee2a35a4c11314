"""Local process groups on one node: ``run_distributed_update`` starts one update worker per device
under a torchrun-style environment and waits for all of them; ``run_processes`` is the launcher itself
(also used by the rollout and log-prob replicas).

Every line a process writes goes to this process's stderr, prefixed with its rank (rank 0's progress
lines as they are). When a process exits non-zero the others are killed at once (a sharded model's
collectives would otherwise wait for the dead one) and one error line names the rank, its exit status
and its last stderr lines. No separate ``torchrun`` is needed: the workers are plain ``python -m``
processes given RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
"""
from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from kfrl.distributed import DistributedUpdateError, strategy_of

TAIL_LINES = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(rank: int, world_size: int, port: int, *, cpu: bool, base: dict | None = None) -> dict[str, str]:
    """The environment of local worker ``rank``: torchrun's variables for one node, the package on the
    path, and on CPU one share of the cores each (as torchrun sets OMP_NUM_THREADS)."""
    env = dict(os.environ if base is None else base)
    src = str(Path(__file__).resolve().parents[2])  # the folder holding the kfrl package
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
               GROUP_RANK="0", NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
    if cpu and "OMP_NUM_THREADS" not in (base or os.environ):
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world_size))
    return env


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def run_processes(argv: list[str], world_size: int, *, what: str, cpu: bool, env: dict | None = None,
                  rank_env=None, poll_s: float = 0.05) -> None:
    """Run ``world_size`` copies of ``argv`` (rank 0..world_size-1) and return when all exit 0; raise
    ``DistributedUpdateError`` naming the first rank that fails (the others are killed). ``rank_env(rank)``
    gives variables of one rank's own."""
    port = free_port()
    failed = None
    tails = [collections.deque(maxlen=TAIL_LINES) for _ in range(world_size)]
    procs: list[subprocess.Popen] = []
    readers: list[threading.Thread] = []

    def pump(rank: int, stream) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            tails[rank].append(line)
            sys.stderr.write((line if rank == 0 and line.startswith("[kfrl]") else f"[rank {rank}] {line}") + "\n")
            sys.stderr.flush()
        stream.close()

    try:
        for rank in range(world_size):
            variables = worker_env(rank, world_size, port, cpu=cpu, base=env)
            variables.update(rank_env(rank) if rank_env is not None else {})
            proc = subprocess.Popen(argv, env=variables,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            procs.append(proc)
            reader = threading.Thread(target=pump, args=(rank, proc.stdout), daemon=True)
            reader.start()
            readers.append(reader)
        while failed is None:
            codes = [proc.poll() for proc in procs]
            failed = next((rank for rank, code in enumerate(codes) if code not in (None, 0)), None)
            if failed is None and all(code == 0 for code in codes):
                break
            if failed is None:
                time.sleep(poll_s)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait()
        for reader in readers:
            reader.join(timeout=5)
    if failed is not None:
        last = " | ".join(line.strip() for line in tails[failed] if line.strip()) or "(no output)"
        raise DistributedUpdateError(f"{what}: rank {failed} of {world_size} {_describe_exit(procs[failed].returncode)} "
                                     f"(the other processes were stopped); its last lines: {last}")


def run_distributed_update(ctx, role_name: str, stage: str, world_size: int) -> None:
    """``stage`` (``update_<role_name>``) of ``ctx``'s iteration over ``world_size`` local processes
    (one per device); returns when rank 0 has committed it."""
    if strategy_of(ctx.config) == "deepspeed":
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            raise DistributedUpdateError("actor.strategy=deepspeed needs DeepSpeed, which is not installed: "
                                         "pip install kfrl[gpu], or use actor.strategy=fsdp2")
    argv = [sys.executable, "-m", "kfrl.stages.update_worker", "--run-uri", ctx.run_uri,
            "--iteration", str(ctx.iteration), "--role", role_name]
    print(f"[kfrl] {stage} of iteration {ctx.iteration}: starting {world_size} worker processes", file=sys.stderr,
          flush=True)
    run_processes(argv, world_size, what=f"distributed {stage} of iteration {ctx.iteration}",
                  cpu=ctx.device != "cuda")
