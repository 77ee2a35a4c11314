"""A long-lived stage process freezes its heap once, after its first iteration (kfrl.heap)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CHECK = textwrap.dedent(r"""
    import gc, json
    from kfrl import heap

    keep = [[i] for i in range(50_000)]  # long-lived containers the collector would walk in every full pass
    calls = [heap.settle_after_first_iteration(it) for it in (3, 3, 2)]  # a resumed run: first iteration 3
    frozen_before = gc.get_freeze_count()
    calls.append(heap.settle_after_first_iteration(4))
    frozen_after = gc.get_freeze_count()
    calls.append(heap.settle_after_first_iteration(5))
    print(json.dumps({"calls": calls, "before": frozen_before, "after": frozen_after,
                      "again": gc.get_freeze_count(), "seconds": heap.frozen_seconds()}))
""")


def run_check(**env) -> dict:
    import json

    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120,
                            env={**os.environ, **env})
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_heap_is_frozen_once_when_the_second_iteration_of_the_process_starts():
    seen = run_check()
    # Nothing while the process's first iteration (3, here: a resumed run) or an earlier one runs.
    assert seen["calls"][:3] == [None, None, None] and seen["before"] == 0
    # At iteration 4 everything alive is frozen, the 50,000 lists included; once only.
    assert isinstance(seen["calls"][3], float) and seen["seconds"] == seen["calls"][3]
    assert seen["after"] >= 50_000 and seen["calls"][4] is None and seen["again"] == seen["after"]


def test_kfrl_gc_freeze_0_leaves_the_collector_alone():
    seen = run_check(KFRL_GC_FREEZE="0")
    assert seen["calls"] == [None] * 5 and seen["after"] == 0 and seen["seconds"] is None
