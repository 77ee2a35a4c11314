"""How one iteration's pipeline is executed: in this process, on KFP's local runner, or on a KFP cluster.

All three run the same stage functions; only the orchestration differs. Each ``run`` returns when
the iteration's stages are committed, or raises ``IterationFailed`` naming where to look.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path

from kfrl.config import Config


class IterationFailed(RuntimeError):
    pass


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


class ClusterKfpRunner:
    """A KFP cluster: one pipeline run per iteration through ``kfp.Client``, then wait for it.

    What it submits is the run's own pipelines, compiled from its config once and committed in its
    folder (``kfrl.pipelines.compile.run_pipelines``): shaped for the cluster by the ``cluster``
    section, with no task for a stage the algorithm always skips (their skip records are committed
    here, before the run is submitted: no pod starts for them)."""

    name = "kfp"

    def __init__(self, config: Config):
        if not (config.pipeline.host or os.environ.get("KF_PIPELINES_ENDPOINT")):
            raise ValueError("pipeline.runner=kfp needs pipeline.host (the KFP API URL, e.g. http://ml-pipeline-ui:80) "
                             "or $KF_PIPELINES_ENDPOINT")
        self.config = config
        self._client = None
        self._pipelines: dict[str, tuple] = {}  # run URI -> (its store, the manifest of its compiled pipelines)

    def pipelines(self, run_uri: str) -> tuple:
        """(the run's store, the manifest of its compiled pipelines: ``pipelines/<digest>`` in its folder)."""
        if run_uri not in self._pipelines:
            from kfrl.pipelines.compile import run_pipelines
            from kfrl.run import Run

            store = Run.at(run_uri, **self.config.store.options()).store
            self._pipelines[run_uri] = (store, run_pipelines(store, self.config))
        return self._pipelines[run_uri]

    @property
    def client(self):
        if self._client is None:
            self._client = kfp_client(self.config.pipeline)
        return self._client

    def run(self, run_uri: str, iteration: int, log_path: Path, pipeline: str = "iteration") -> None:
        import tempfile

        from kfrl.pipelines.rl_iteration import pipeline_for
        from kfrl.run import Run
        from kfrl.stages import always_skipped, run_stage

        name = pipeline_for(self.config.pipeline.fuse, pipeline)
        store, manifest = self.pipelines(run_uri)
        if name == "rl_iteration":  # the per-stage pipeline has no task for these
            for stage in always_skipped(self.config):
                run_stage(stage, run_uri, iteration)
        package = store.read_file(manifest, f"{name}.yaml")
        with tempfile.TemporaryDirectory(prefix="kfrl-submit-") as tmp:
            path = Path(tmp) / f"{name}.yaml"
            path.write_bytes(package)
            result = self.client.create_run_from_pipeline_package(
                str(path), arguments={"run_uri": run_uri, "iteration": iteration},
                run_name=f"{self.config.trainer.experiment_name}-{Path(run_uri).name}-{pipeline}-{iteration}",
                experiment_name=self.config.trainer.project_name, enable_caching=False,
            )
        run = self.client.wait_for_run_completion(result.run_id, timeout=self.config.pipeline.run_timeout_s)
        state = str(getattr(run, "state", "")).upper()
        if "SUCCEEDED" not in state:
            raise IterationFailed(f"iteration {iteration}: KFP run {result.run_id} ended in state {state}; "
                                  f"see the run in the KFP UI at {self.config.pipeline.host}")


SA_TOKEN_PATH = "/var/run/secrets/kubeflow/pipelines/token"


def kfp_client(pipeline):
    """A ``kfp.Client`` for ``pipeline`` (the config section): host from ``pipeline.host`` or
    $KF_PIPELINES_ENDPOINT; namespace from ``pipeline.namespace`` or $KF_PIPELINES_NAMESPACE (multi-user
    Kubeflow); a bearer token from $KF_PIPELINES_TOKEN, else the projected service-account token
    ($KF_PIPELINES_SA_TOKEN_PATH, default /var/run/secrets/kubeflow/pipelines/token) when the file exists."""
    import kfp

    host = pipeline.host or os.environ.get("KF_PIPELINES_ENDPOINT") or None
    namespace = pipeline.namespace or os.environ.get("KF_PIPELINES_NAMESPACE") or "kubeflow"
    token = os.environ.get("KF_PIPELINES_TOKEN") or None
    credentials = None
    token_path = os.environ.get("KF_PIPELINES_SA_TOKEN_PATH", SA_TOKEN_PATH)
    if token is None and Path(token_path).is_file():
        from kfp.client import ServiceAccountTokenVolumeCredentials

        credentials = ServiceAccountTokenVolumeCredentials(path=token_path)
    return kfp.Client(host=host, namespace=namespace, existing_token=token, credentials=credentials)


def make_runner(config: Config):
    kind = config.pipeline.runner
    if kind == "inline":
        return InlineRunner()
    if kind == "local":
        return LocalKfpRunner(config.pipeline.pipeline_root, fuse=config.pipeline.fuse)
    return ClusterKfpRunner(config)


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


__all__ = ["InlineRunner", "LocalKfpRunner", "ClusterKfpRunner", "IterationFailed", "make_runner"]
