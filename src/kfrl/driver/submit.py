"""`kfrl submit` and `kfrl schedule`: the training pipeline (rl_train) on a KFP cluster, once or on a
cron schedule, from a laptop or CI. The pipeline is compiled for the cluster from the config's
``cluster`` section; the config itself is put in the store (``configs/<experiment>-<digest>.yaml``,
credentials redacted) and travels as its URI, the ``config_uri`` parameter, so the run the cluster
executes is the run `kfrl train --config ...` would be, and the KFP UI shows a one-line URI."""
from __future__ import annotations

import shlex
import tempfile
from pathlib import Path

from kfrl.config import Config


def kfp_cron(expression: str) -> str:
    """KFP's cron has a seconds field first: ``0 2 * * *`` (five fields, as crontab) → ``0 0 2 * * *``."""
    fields = expression.split()
    if len(fields) == 5:
        return "0 " + " ".join(fields)
    if len(fields) == 6:
        return " ".join(fields)
    raise ValueError(f"--cron {expression!r}: give five fields (minute hour day month weekday), e.g. '0 2 * * *'")


CONFIGS = "configs"  # under the store's root: configs submitted to the cluster


def submitted_config_text(config: Config) -> str:
    """The config as the cluster gets it: YAML, credentials redacted (a run parameter and the store are
    visible to everyone who can read them; credentials reach the tasks through ``cluster.secret``
    only), the execution keys the cluster decides left out (runner kfp, the in-cluster API)."""
    import yaml

    tree = config.redacted_tree()
    tree["pipeline"].pop("runner", None)
    tree["pipeline"].pop("host", None)
    return yaml.safe_dump(tree, sort_keys=False)


def upload_config(config: Config) -> str:
    """``submitted_config_text`` in the store at ``configs/<experiment>-<sha256[:12]>.yaml`` (the same
    config, the same object: submitting again writes nothing); returns its URI."""
    import hashlib

    from kfrl.store import Store

    text = submitted_config_text(config)
    name = f"{CONFIGS}/{config.trainer.experiment_name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.yaml"
    store = Store(config.store.uri, **config.store.options())
    if not store.exists(name):
        store.write_text(name, text)
    return store.url(name)


def cluster_input_problems(config: Config) -> list[str]:
    """What makes a config unfit to run on a cluster, each a sentence a user can act on: a store the
    cluster's pods cannot see, the builtin demo model."""
    problems = []
    if "://" not in config.store.uri or config.store.uri.startswith("file://"):
        problems.append(f"store.uri={config.store.uri!r} is a folder of this machine, which the cluster's pods "
                        "cannot see: give an object store, --store s3://bucket/prefix (terraform output store_uri)")
    if config.model.path.startswith("builtin:"):
        problems.append(f"model.path={config.model.path!r} is the builtin demo model, built on the CPU for the local "
                        "demo: give the initial policy, model.path=s3://bucket/models/<hf-folder> or "
                        "models:/<name>@<alias>")
    return problems


def pipeline_arguments(*, config_uri: str, overrides: list[str], iterations: int | None, run_id: str = "",
                       promote_alias: str = "") -> dict:
    """The rl_train parameters that reproduce this config on the cluster: the URI of the config in the
    store (``upload_config``), overrides (redacted), iterations, run id, promotion, runner kfp."""
    from kfrl.redaction import redact

    return {"config_uri": config_uri, "overrides": redact(" ".join(shlex.quote(o) for o in overrides)),
            "iterations": int(iterations or 0), "run_id": run_id, "promote_alias": promote_alias, "runner": "kfp"}


def compiled_train_pipeline(config: Config, folder: Path) -> Path:
    from kfrl.pipelines.compile import compile_pipelines

    return next(path for path in compile_pipelines(folder, config) if path.stem == "rl_train")


def submit(config: Config, arguments: dict, *, run_name: str) -> str:
    """Start one rl_train run; returns the KFP run id."""
    from kfrl.driver.cluster import kfp_client

    client = kfp_client(config.pipeline)
    with tempfile.TemporaryDirectory(prefix="kfrl-compile-") as tmp:
        package = compiled_train_pipeline(config, Path(tmp))
        result = client.create_run_from_pipeline_package(
            str(package), arguments=arguments, run_name=run_name, experiment_name=config.trainer.project_name,
            namespace=config.pipeline.namespace or None, enable_caching=False)
    return result.run_id


def schedule(config: Config, arguments: dict, *, cron: str, name: str) -> tuple[str, list[str]]:
    """A KFP recurring run of rl_train (one run at a time, no catch-up of missed nights) called ``name``:
    the recurring runs of rl_train already called so are replaced (the new one is created first, so a
    failure leaves the old schedule running). Returns (its id, the ids it replaced)."""
    from kfrl.driver.cluster import kfp_client

    client = kfp_client(config.pipeline)
    experiment = client.create_experiment(config.trainer.project_name, namespace=config.pipeline.namespace or None)
    replaced = [r.recurring_run_id for r in training_schedules(client, config) if r.display_name == name]
    with tempfile.TemporaryDirectory(prefix="kfrl-compile-") as tmp:
        package = compiled_train_pipeline(config, Path(tmp))
        job = client.create_recurring_run(
            experiment_id=experiment.experiment_id, job_name=name, cron_expression=kfp_cron(cron),
            max_concurrency=1, no_catchup=True, params=arguments, pipeline_package_path=str(package),
            enable_caching=False,
            description=f"kfrl: {config.trainer.experiment_name} on the schedule {cron!r}")
    for recurring_run_id in replaced:
        client.delete_recurring_run(recurring_run_id)
    return job.recurring_run_id, replaced


def training_schedules(client, config: Config) -> list:
    """The recurring runs of the training pipeline (rl_train) in the config's namespace."""
    from kfrl.pipelines.rl_iteration import TRAIN_PIPELINE_NAME

    found, token = [], ""
    while True:
        page = client.list_recurring_runs(page_token=token, page_size=100,
                                          namespace=config.pipeline.namespace or None)
        for recurring in page.recurring_runs or []:
            spec = recurring.pipeline_spec or {}
            spec = spec.get("pipeline_spec", spec)
            if spec.get("pipelineInfo", {}).get("name") == TRAIN_PIPELINE_NAME:
                found.append(recurring)
        token = page.next_page_token
        if not token:
            return found


def schedule_rows(config: Config) -> list[dict]:
    """One row per recurring run of the training pipeline: name, id, cron (crontab's five fields),
    status, created."""
    from kfrl.driver.cluster import kfp_client

    rows = []
    for recurring in training_schedules(kfp_client(config.pipeline), config):
        trigger = recurring.trigger
        cron_schedule = getattr(trigger, "cron_schedule", None) if trigger is not None else None
        cron = getattr(cron_schedule, "cron", "") or ""
        fields = cron.split()
        rows.append({"name": recurring.display_name, "id": recurring.recurring_run_id,
                     "cron": " ".join(fields[1:] if len(fields) == 6 else fields) or "-",
                     "status": str(recurring.status or recurring.mode or "-"), "created": str(recurring.created_at or "-")})
    return sorted(rows, key=lambda row: row["name"])


def delete_schedule(config: Config, name: str) -> list[str]:
    """Delete the recurring runs of the training pipeline called ``name``; returns their ids."""
    from kfrl.driver.cluster import kfp_client

    client = kfp_client(config.pipeline)
    ids = [r.recurring_run_id for r in training_schedules(client, config) if r.display_name == name]
    for recurring_run_id in ids:
        client.delete_recurring_run(recurring_run_id)
    return ids


FINAL_STATES = {"SUCCEEDED", "FAILED", "CANCELED", "CANCELLED", "SKIPPED"}


def wait_for_training_run(config: Config, kfp_run_id: str, *, poll_s: float = 10.0, timeout_s: float | None = None,
                          echo=print) -> str:
    """Follow an rl_train run until it ends, echoing each change of its state with the time since the
    start; returns the final state (or ``TIMEOUT``)."""
    import time

    from kfrl.driver.cluster import kfp_client

    client = kfp_client(config.pipeline)
    started, last = time.monotonic(), None
    while True:
        state = str(getattr(client.get_run(kfp_run_id), "state", "") or "UNKNOWN").upper()
        elapsed = time.monotonic() - started
        if state != last:
            echo(f"[{int(elapsed) // 60:02d}:{int(elapsed) % 60:02d}] KFP run {kfp_run_id}: {state}")
            last = state
        if state in FINAL_STATES:
            return state
        if timeout_s is not None and elapsed > timeout_s:
            return "TIMEOUT"
        time.sleep(poll_s)


def training_summary(config: Config, run_id: str) -> dict | None:
    """The summary the cluster driver left in the run's folder (``summary.json``), or None."""
    import json

    from kfrl.driver.kfp_entry import SUMMARY_FILE
    from kfrl.store import Store, StoreNotFoundError

    store = Store(config.store.uri, **config.store.options())
    try:
        return json.loads(store.read_text(f"{config.trainer.experiment_name}/{run_id}/{SUMMARY_FILE}"))
    except StoreNotFoundError:
        return None
