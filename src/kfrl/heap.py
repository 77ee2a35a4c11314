"""The Python heap of a process that runs stages for many iterations (the resident engine, the inline
runner, a cluster engine).

Such a process holds a few hundred thousand long-lived objects once its first iteration has run: the
modules of torch and transformers, the models, the tokenizers, compiled graphs. Python's cyclic
collector walks all of them in every full (generation-2) collection, and the allocations of an ordinary
stage (lists of a batch's values, Arrow conversions) trigger one now and then: in a smoke run of
``bench/gpu_iteration.py`` on 2 CPU cores, 7 full collections took 718 ms in all, the longest 233 ms, in
the middle of whichever stage happened to allocate (the advantage stage's spread of 0.04-0.36 s between
iterations of the same work, on GPU machines).

Once the first iteration is over, everything alive then is frozen (``gc.freeze``: moved to a generation
the collector does not walk), after one full collection so that no garbage is frozen with it. Later
collections walk only what later iterations create. Objects frozen here are never freed by the cyclic
collector until the process exits, so this happens once per process, after the iteration that loads what the process keeps.
``KFRL_GC_FREEZE=0`` leaves the collector as Python has it.
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
