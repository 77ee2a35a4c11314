"""torch's intra-op threads in a process whose models run on a GPU.

In such a process torch's CPU work is small: the advantage and score stages' math over a batch of a few
hundred rows, tables turned into tensors before they go to the device. An ATen op over more elements than
its grain parallelises over OpenMP threads and returns when the slowest has finished; beside the process's
own busy threads (the weights and trainer-state writers, the host-buffer builder) a thread that was asleep
or lost its core costs milliseconds per op. On an H100 machine (16 cores) the advantage stage of a 0.5B
iteration took 0.05-0.34 s for the same 256 rows with torch's 16 threads, 0.05-0.09 s with one
(docs/performance.md). vLLM's workers run torch's CPU ops on one thread for the same reason.

So the first stage of a process that runs on CUDA sets torch's intra-op threads to ``KFRL_HOST_THREADS``
(default 1; ``0`` leaves torch's default). A process on the CPU keeps all its threads: there the model's
own work is CPU work.
"""
from __future__ import annotations

import os
import threading

_LOCK = threading.Lock()
_SETTLED: dict = {"threads": None}


def host_threads_wanted() -> int:
    """KFRL_HOST_THREADS as a count (0: leave torch as it is)."""
    raw = os.environ.get("KFRL_HOST_THREADS", "1").strip()
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"KFRL_HOST_THREADS must be a whole number of threads (0 leaves torch's default), "
                         f"not {raw!r}") from None
    if value < 0:
        raise ValueError(f"KFRL_HOST_THREADS must be 0 or more, not {value}")
    return value


def settle_host_threads(device: str) -> int | None:
    """Once per process, for a stage on ``device``: torch's intra-op threads set for a GPU process.
    Returns the thread count set (None when nothing was changed)."""
    if not str(device).startswith("cuda"):
        return None
    with _LOCK:
        if _SETTLED["threads"] is not None:
            return None
        wanted = host_threads_wanted()
        _SETTLED["threads"] = wanted
        if wanted == 0:
            return None
        import torch

        torch.set_num_threads(wanted)
        return wanted
