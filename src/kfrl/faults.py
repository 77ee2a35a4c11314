"""Named kill points for crash testing (like etcd's failpoints): ``KFRL_KILL_AT=commit@3`` makes the
process SIGKILL itself the third time it reaches ``failpoint("commit")``.

Nothing happens unless the variable is set; the chaos test (tests/test_chaos.py) uses it to kill a
run at exactly the moments that matter (MLflow database creation, a half-uploaded checkpoint, a
manifest about to be published, a version registered but LATEST not yet moved) and checks that
resuming loses and repeats nothing. Several points may be listed, comma-separated.
"""
from __future__ import annotations

import os
import signal
import threading
from collections import Counter

ENV = "KFRL_KILL_AT"
POINTS = ("startup", "mlflow_init", "upload", "commit", "registration", "latest", "trainer_state")
_hits: Counter = Counter()
# Commits also run on background threads (weights and trainer state): the count must not skip a hit.
_LOCK = threading.Lock()


def _wanted() -> dict[str, int]:
    wanted = {}
    for item in filter(None, (part.strip() for part in os.environ.get(ENV, "").split(","))):
        name, _, nth = item.partition("@")
        if name not in POINTS:
            raise ValueError(f"{ENV}={os.environ[ENV]!r}: unknown kill point {name!r}; known: {', '.join(POINTS)}")
        wanted[name] = int(nth or 1)
    return wanted


def failpoint(name: str) -> None:
    """SIGKILL this process here when ``KFRL_KILL_AT`` asks for it (see the module docstring)."""
    if ENV not in os.environ:
        return
    with _LOCK:
        _hits[name] += 1
        hit = _hits[name]
    if _wanted().get(name) == hit:
        os.kill(os.getpid(), signal.SIGKILL)
