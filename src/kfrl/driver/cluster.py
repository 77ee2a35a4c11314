"""Iterations on a KFP cluster: one pipeline run per iteration through ``kfp.Client``, the run's own
compiled pipelines, and (``pipeline.engines=resident``) the run's engine as a Kubernetes workload."""
from __future__ import annotations

import os
from pathlib import Path

from kfrl.config import Config
from kfrl.driver import IterationFailed


class ClusterKfpRunner:
    """A KFP cluster: one pipeline run per iteration through ``kfp.Client``, then wait for it.

    What it submits is the run's own pipelines, compiled from its config once and committed in its
    folder (``kfrl.pipelines.compile.run_pipelines``): shaped for the cluster by the ``cluster``
    section, with no task for a stage the algorithm always skips (their skip records are committed
    here, before the run is submitted: no pod starts for them)."""

    name = "kfp"

    poll_s = 5.0  # between reads of an iteration run's state (and checks of the engine)

    def __init__(self, config: Config):
        if not (config.pipeline.host or os.environ.get("KF_PIPELINES_ENDPOINT")):
            raise ValueError("pipeline.runner=kfp needs pipeline.host (the KFP API URL, e.g. http://ml-pipeline-ui:80) "
                             "or $KF_PIPELINES_ENDPOINT")
        self.config = config
        self._client = None
        self._pipelines: dict[str, tuple] = {}  # run URI -> (its store, the manifest of its compiled pipelines)
        self.engine = None  # the run's EngineWorkload, while the driver holds one

    def start_engine(self, run, log_path=None, log=print, metrics_run: tuple[str, str] | None = None):
        """The run's engine on the cluster (``pipeline.engines=resident``): created, owned by this
        driver's pod, and ready before the first iteration is submitted; None with per-task engines
        or a multi-node update (its job is the update's GPU workload). Raises ``IterationFailed``
        when it cannot start: the iteration tasks are CPU-only clients and cannot run without it."""
        if not uses_cluster_engine(self.config):
            return None
        from kfrl.driver.engine.workload import EngineWorkloadError, cluster_engine
        from kfrl.kube import KubernetesUnavailable

        try:
            self.engine = cluster_engine(self.config, run.uri, run.uri.rstrip("/").rsplit("/", 1)[-1], log=log,
                                         metrics_run=metrics_run)
            self.engine.start()
        except (EngineWorkloadError, KubernetesUnavailable) as err:
            if self.engine is not None:
                self.engine.stop(wait_s=30)
            self.engine = None
            raise IterationFailed(f"the run's engine did not start on the cluster: {err}. With "
                                  "pipeline.engines=per_task every GPU stage runs in its own GPU pod instead") from err
        return self.engine

    def pipelines(self, run_uri: str) -> tuple:
        """(the run's store, the manifest of its compiled pipelines: ``pipelines/<digest>`` in its folder)."""
        if run_uri not in self._pipelines:
            from kfrl.driver.engine.workload import EngineBinding
            from kfrl.pipelines.compile import run_pipelines
            from kfrl.run import Run

            store = Run.at(run_uri, **self.config.store.options()).store
            binding = EngineBinding.for_run(run_uri.rstrip("/").rsplit("/", 1)[-1]) \
                if uses_cluster_engine(self.config) else None
            self._pipelines[run_uri] = (store, run_pipelines(store, self.config, binding))
        return self._pipelines[run_uri]

    @property
    def client(self):
        if self._client is None:
            self._client = kfp_client(self.config.pipeline)
        return self._client

    def run(self, run_uri: str, iteration: int, log_path: Path, pipeline: str = "iteration") -> str:
        """Submit the iteration's KFP run and wait for it; returns its KFP run id."""
        import tempfile

        from kfrl.pipelines.rl_iteration import pipeline_for
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
        state = self.wait(result.run_id)
        if "SUCCEEDED" not in state:
            raise IterationFailed(f"iteration {iteration}: KFP run {result.run_id} ended in state {state}; "
                                  f"see the run in the KFP UI at {self.config.pipeline.host}")
        return result.run_id

    def wait(self, kfp_run_id: str) -> str:
        """Poll the iteration run until it ends; meanwhile keep the run's engine alive (a task that finds
        no engine fails and is retried by KFP, so a replaced engine lets the iteration go on)."""
        import time

        deadline = time.monotonic() + self.config.pipeline.run_timeout_s
        while True:
            state = str(getattr(self.client.get_run(kfp_run_id), "state", "")).upper()
            if any(end in state for end in ("SUCCEEDED", "FAILED", "SKIPPED", "CANCELED", "CANCELLED")):
                return state
            if time.monotonic() > deadline:
                raise IterationFailed(f"KFP run {kfp_run_id} did not end within pipeline.run_timeout_s "
                                      f"({self.config.pipeline.run_timeout_s}s); it is still {state or 'unknown'}")
            if self.engine is not None and not self.engine.alive():
                self.engine.restart()
            time.sleep(self.poll_s)


def uses_cluster_engine(config) -> bool:
    """A run on a cluster with ``pipeline.engines=resident`` has its engine as a Kubernetes workload,
    except with a multi-node update (``trainer.nnodes > 1``): then every task loads what it needs."""
    return (config.pipeline.runner == "kfp" and config.pipeline.engines == "resident"
            and config.trainer.nnodes == 1)


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


__all__ = ["ClusterKfpRunner", "kfp_client", "uses_cluster_engine"]
