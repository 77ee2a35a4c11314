"""Iterations on this machine: the stages called in this process (inline), or KFP's local runner.

Each ``run`` returns when the iteration's stages are committed, or raises ``IterationFailed`` naming
where to look. The cluster's runner is ``kfrl.driver.cluster``.
"""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

from kfrl.driver import IterationFailed


class InlineRunner:
    """Stages called directly, in order, in this process (no KFP). Fast; for tests and debugging."""

    name = "inline"

    def run(self, run_uri: str, iteration: int, log_path: Path, pipeline: str = "iteration") -> None:
        from kfrl.stages import STAGES, run_stage, update

        update.write_states_in_background(True)  # the controller drains them (``close``) before it ends
        for stage in STAGES if pipeline == "iteration" else ("validate",):
            try:
                run_stage(stage, run_uri, iteration)
            except Exception as err:
                raise IterationFailed(f"iteration {iteration}, stage {stage}: {type(err).__name__}: {err}") from err

    def close(self) -> None:
        """Finish the trainer-state writes still running in this process; stages called here later
        (not through this runner) write theirs before they return again."""
        from kfrl.stages import update

        update.drain()
        update.write_states_in_background(False)


_LOCAL_ROOT: str | None = None


class LocalKfpRunner:
    """The embedded default: KFP's local SubprocessRunner, one subprocess per stage, no cluster.

    KFP prints every task's executor input and output; that goes to a log file per iteration so the
    terminal keeps kfrl's own progress lines.
    """

    name = "local"

    def __init__(self, pipeline_root: str, fuse: str = "none"):
        self.pipeline_root = str(Path(pipeline_root).expanduser().resolve())
        self.fuse = fuse

    def _init(self) -> None:
        global _LOCAL_ROOT
        if _LOCAL_ROOT == self.pipeline_root:
            return
        from kfp import local

        Path(self.pipeline_root).mkdir(parents=True, exist_ok=True)
        local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=self.pipeline_root,
                   raise_on_error=True)
        _LOCAL_ROOT = self.pipeline_root

    def run(self, run_uri: str, iteration: int, log_path: Path, pipeline: str = "iteration") -> None:
        import logging

        from kfrl.pipelines.rl_iteration import PIPELINES, pipeline_for

        pipeline = PIPELINES[pipeline_for(self.fuse, pipeline)]
        self._init()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a") as log, _quiet_kfp(log), warnings.catch_warnings():
            # Cluster-only task settings (display names, retries' pod policy) are no-ops locally.
            warnings.filterwarnings("ignore", message=".*no effect in the current local runner.*")
            try:
                pipeline(run_uri=run_uri, iteration=iteration)
            except Exception as err:
                logging.getLogger(__name__).debug("pipeline failed", exc_info=True)
                tail = _tail(log_path)
                raise IterationFailed(
                    f"iteration {iteration}: the KFP pipeline failed ({_strip_ansi(str(err))}). "
                    f"Full log: {log_path}\n--- last lines ---\n{tail}") from err


@contextlib.contextmanager
def _quiet_kfp(log):
    """Send KFP's task output (printed by the local runner) and its log records to ``log``."""
    import logging

    handler = logging.StreamHandler(log)
    loggers = [logging.getLogger(), logging.getLogger("kfp")]
    saved = [(lg, list(lg.handlers), lg.propagate) for lg in loggers]
    for lg in loggers:
        for h in list(lg.handlers):
            lg.removeHandler(h)
        lg.addHandler(handler)
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            yield
    finally:
        log.flush()
        for lg, handlers, propagate in saved:
            lg.removeHandler(handler)
            for h in handlers:
                lg.addHandler(h)
            lg.propagate = propagate


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return _strip_ansi("\n".join(text[-lines:]))


def _strip_ansi(text: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)


__all__ = ["InlineRunner", "LocalKfpRunner"]
