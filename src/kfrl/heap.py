"""The Python heap of a process that runs stages for many iterations (the resident engine, the inline
runner, a cluster engine).

Such a process holds a few hundred thousand long-lived objects once its first iteration has run: the
modules of torch and transformers, the models, the tokenizers, compiled graphs (~525k in a CPU run of
``bench/gpu_iteration.py``). Python's cyclic collector walks all of them in every full (generation-2)
collection, which the allocations of ordinary stages trigger now and then, in the middle of whichever stage
happened to allocate: one took 0.42 s inside a 0.5B update on an H100 (docs/performance.md).

Once the first iteration is over, everything alive then is frozen (``gc.freeze``: moved to a generation
the collector does not walk), after one full collection so that no garbage is frozen with it. Later
collections walk only what later iterations create. Objects frozen here are not freed by the cyclic
collector until the process exits, so this happens once per process, after the iteration that loads what
the process keeps. ``KFRL_GC_FREEZE=0`` leaves the collector as Python has it.
"""
from __future__ import annotations

import atexit
import gc
import os
import threading
import time

_LOCK = threading.Lock()
_STATE: dict = {"first_iteration": None, "frozen": None}


def freeze_enabled() -> bool:
    return os.environ.get("KFRL_GC_FREEZE", "1") != "0"


def settle_after_first_iteration(iteration: int) -> float | None:
    """Called before a stage of ``iteration`` runs in this process: the first time a later iteration than
    the process's first one comes, collects and freezes what is alive. Returns the seconds that took
    (None when nothing was done)."""
    with _LOCK:
        first = _STATE["first_iteration"]
        if first is None:
            _STATE["first_iteration"] = iteration
            return None
        if iteration <= first or _STATE["frozen"] is not None or not freeze_enabled():
            return None
        started = time.perf_counter()
        gc.collect()
        gc.freeze()
        # Thawed at exit, so that the interpreter's last collections free what was frozen (extension
        # modules such as Triton's report objects still alive at their teardown as leaks).
        atexit.register(gc.unfreeze)
        _STATE["frozen"] = time.perf_counter() - started
        return _STATE["frozen"]


def frozen_seconds() -> float | None:
    """How long this process's freeze took, or None if it has not frozen."""
    return _STATE["frozen"]
