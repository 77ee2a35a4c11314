"""`kfrl submit` and `kfrl schedule`: the training pipeline (rl_train) on a KFP cluster, once or on a
cron schedule, from a laptop or CI. The pipeline is compiled for the cluster from the config's
``cluster`` section and the config itself travels as the ``config_yaml`` parameter, so the run the
cluster executes is the run `kfrl train --config ...` would be."""
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


def pipeline_arguments(config: Config, *, overrides: list[str], iterations: int | None, run_id: str = "",
                       promote_alias: str = "") -> dict:
    """The rl_train parameters that reproduce this config on the cluster. The config goes whole (YAML)
    with the execution keys the cluster decides left to the pipeline (runner kfp, the in-cluster API).
    Credentials are redacted: a run parameter is visible to everyone who can read the pipeline, so
    they reach the cluster's tasks through ``cluster.secret`` only."""
    from kfrl.redaction import redact

    tree = config.redacted_tree()
    tree["pipeline"].pop("runner", None)
    tree["pipeline"].pop("host", None)
    import yaml

    return {"config_yaml": yaml.safe_dump(tree, sort_keys=False), "overrides": redact(" ".join(shlex.quote(o) for o in overrides)),
            "iterations": int(iterations or 0), "run_id": run_id, "promote_alias": promote_alias, "runner": "kfp"}


def compiled_train_pipeline(config: Config, folder: Path) -> Path:
    from kfrl.pipelines.compile import compile_pipelines

    return next(path for path in compile_pipelines(folder, config) if path.stem == "rl_train")


def submit(config: Config, arguments: dict, *, run_name: str) -> str:
    """Start one rl_train run; returns the KFP run id."""
    from kfrl.runners import kfp_client

    client = kfp_client(config.pipeline)
    with tempfile.TemporaryDirectory(prefix="kfrl-compile-") as tmp:
        package = compiled_train_pipeline(config, Path(tmp))
        result = client.create_run_from_pipeline_package(
            str(package), arguments=arguments, run_name=run_name, experiment_name=config.trainer.project_name,
            namespace=config.pipeline.namespace or None, enable_caching=False)
    return result.run_id


def schedule(config: Config, arguments: dict, *, cron: str, name: str) -> str:
    """A KFP recurring run of rl_train (one run at a time, no catch-up of missed nights); returns its id."""
    from kfrl.runners import kfp_client

    client = kfp_client(config.pipeline)
    experiment = client.create_experiment(config.trainer.project_name, namespace=config.pipeline.namespace or None)
    with tempfile.TemporaryDirectory(prefix="kfrl-compile-") as tmp:
        package = compiled_train_pipeline(config, Path(tmp))
        job = client.create_recurring_run(
            experiment_id=experiment.experiment_id, job_name=name, cron_expression=kfp_cron(cron),
            max_concurrency=1, no_catchup=True, params=arguments, pipeline_package_path=str(package),
            enable_caching=False,
            description=f"kfrl: {config.trainer.experiment_name} on the schedule {cron!r}")
    return job.recurring_run_id
