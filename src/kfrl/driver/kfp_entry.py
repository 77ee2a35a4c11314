"""What a KFP component body calls: run the stage (on the run's resident engine when one answers,
else in this task), mirror its metrics into the KFP Metrics artifact."""
from __future__ import annotations

import math

from kfrl.redaction import redact


def run_for_kfp(stage: str, run_uri: str, iteration: int, metrics_artifact) -> str:
    from kfrl.driver.engine.client import dispatch

    return _report(dispatch(stage, run_uri, int(iteration)), iteration, metrics_artifact)


def run_group_for_kfp(group: str, run_uri: str, iteration: int, metrics_artifact) -> str:
    """A fused component: the group's stages in one process; returns the last stage's URI."""
    from kfrl.driver.engine.client import dispatch_group

    uri = ""
    for result in dispatch_group(group, run_uri, int(iteration)):
        uri = _report(result, iteration, metrics_artifact)
    metrics_artifact.metadata["stage"] = group
    return uri


def _report(result, iteration: int, metrics_artifact) -> str:
    stage = result.stage
    for key, value in result.metrics.items():
        if isinstance(value, (int, float)) and math.isfinite(value):
            # KFP metric names may not contain "/" in every UI version; keep veRL's name readable.
            metrics_artifact.log_metric(key.replace("/", "."), float(value))
    metrics_artifact.metadata["stage"] = stage
    metrics_artifact.metadata["cached"] = result.cached
    if result.skipped:
        metrics_artifact.metadata["skipped"] = result.skipped
    status = "skipped: " + result.skipped if result.skipped else ("already committed" if result.cached else "done")
    print(f"[kfrl] iteration {iteration} {stage}: {status} -> {redact(result.uri)}")
    return result.uri


def read_config_text(uri: str) -> str:
    """A config file's text from the store (s3://.../configs/x.yaml) or a path the task can read."""
    import posixpath

    from kfrl.store import Store, StoreNotFoundError

    folder, name = posixpath.split(uri.rstrip("/"))
    try:
        return Store(folder).read_text(name)
    except StoreNotFoundError as err:
        raise FileNotFoundError(f"config_uri {redact(uri)}: no such config in the store ({err}); `kfrl submit` and "
                                "`kfrl schedule` put one there, or copy a configs/*.yaml file there") from err


# The KFP API inside a cluster with KFP installed standalone (the kubeflow namespace).
IN_CLUSTER_KFP_HOST = "http://ml-pipeline.kubeflow.svc.cluster.local:8888"


def train_for_kfp(*, config_uri: str, model_path: str, train_files: str, val_files: str, store_uri: str,
                  tracking_uri: str, experiment_name: str, iterations: int, run_id: str, overrides: str,
                  promote_alias: str, runner: str, kfp_run_id: str, metrics_artifact) -> str:
    """The rl_train pipeline's driver: `kfrl train` with the pipeline's parameters, then (with
    ``promote_alias``) the promotion gate. Returns the run's store URI. A retried driver task resumes
    the same run: its id defaults to one derived from the KFP run's id.

    `kfrl train` runs as a child process: KFP's executor imports ``kfp.dsl`` in its runtime-only form
    (``_KFP_RUNTIME``), in which the pipelines `kfrl train` submits cannot be built."""
    import json
    import os
    import shlex
    import subprocess
    import sys
    import tempfile

    extra = shlex.split(overrides or "")
    for key, value in (("model.path", model_path), ("data.train_files", train_files),
                       ("data.val_files", val_files), ("store.uri", store_uri), ("tracking.uri", tracking_uri),
                       ("trainer.experiment_name", experiment_name)):
        if value:
            extra.append(f"{key}={value}")
    extra.append(f"pipeline.runner={runner}")
    if runner == "kfp" and not any(item.startswith("pipeline.host=") for item in extra):
        extra.append(f"pipeline.host={os.environ.get('KF_PIPELINES_ENDPOINT') or IN_CLUSTER_KFP_HOST}")
    run_id = run_id or driver_run_id(kfp_run_id)
    with tempfile.TemporaryDirectory(prefix="kfrl-driver-") as tmp:
        config_file, summary_file = os.path.join(tmp, "config.yaml"), os.path.join(tmp, "summary.json")
        with open(config_file, "w") as fh:
            fh.write(read_config_text(config_uri) if config_uri else "{}\n")
        command = [sys.executable, "-m", "kfrl.cli", "train", "--config", config_file, "--run-id", run_id,
                   "--json", summary_file, *(["--iterations", str(iterations)] if iterations else []), *extra]
        env = {key: value for key, value in os.environ.items() if key != "_KFP_RUNTIME"}
        env["KFRL_KFP_RUN_ID"] = kfp_run_id  # the label of the engine objects the run creates (the exit handler's)
        print(f"[kfrl] {redact(' '.join(shlex.quote(c) for c in command))}", flush=True)
        finished = subprocess.run(command, env=env)
        if finished.returncode != 0:
            raise RuntimeError(f"kfrl train exited with status {finished.returncode} (see the lines above); the "
                               f"run {run_id} resumes where it stopped when this task is retried or the pipeline "
                               f"is started again with run_id={run_id}")
        with open(summary_file) as fh:
            summary = json.load(fh)
    for key, value in summary["final_metrics"].items():
        if isinstance(value, (int, float)) and math.isfinite(value):
            metrics_artifact.log_metric(key.replace("/", "."), float(value))
    metrics_artifact.metadata.update({key: summary[key] for key in ("run_id", "run_uri", "mlflow_run_id",
                                                                      "registered_versions")})
    if promote_alias:
        from kfrl.registry import PromotionRefused, promote

        try:
            result = promote(summary["tracking_uri"], summary["run_id"], alias=promote_alias)
        except PromotionRefused as err:
            print(f"[kfrl] not promoted: {err}", flush=True)
            metrics_artifact.log_metric("promoted", 0.0)
            summary["promotion"] = {"alias": promote_alias, "promoted": False, "reason": str(err)}
        else:
            print(f"[kfrl] promotion @{promote_alias}: {json.dumps(result.to_dict())}", flush=True)
            metrics_artifact.log_metric("promoted", 1.0 if result.promoted else 0.0)
            summary["promotion"] = {"alias": promote_alias, **result.to_dict()}
    # What `kfrl submit --wait` reads back: the run's summary, in its folder.
    from kfrl.run import Run

    Run.at(summary["run_uri"]).store.write_text(SUMMARY_FILE, json.dumps(summary, sort_keys=True, default=str))
    return summary["run_uri"]


def cleanup_for_kfp(*, kfp_run_id: str, runner: str) -> str:
    """rl_train's exit handler: delete the engine objects labelled with this KFP run (the driver deletes
    its engine when it ends; this also covers a driver that was cancelled or killed). Nothing to do
    when the iterations did not run on the cluster, or where no Kubernetes API is reachable."""
    if runner != "kfp":
        return "no cluster engine (runner=" + runner + ")"
    from kfrl.driver.engine.workload import delete_for_kfp_run
    from kfrl.kube import KubernetesUnavailable

    try:
        selector = delete_for_kfp_run(kfp_run_id)
    except KubernetesUnavailable as err:
        print(f"[kfrl] no engine to delete: {err}", flush=True)
        return "no Kubernetes API"
    print(f"[kfrl] engine objects of KFP run {kfp_run_id} deleted ({selector})", flush=True)
    return f"deleted {selector}"


SUMMARY_FILE = "summary.json"  # in a run's folder, written by the cluster driver at its end


def driver_run_id(kfp_run_id: str) -> str:
    """The kfrl run id of an rl_train run started without one: derived from the KFP run's id, so a
    retried driver task resumes the same kfrl run and a client can find it."""
    return f"kfp-{kfp_run_id.replace('-', '')[:12]}"
