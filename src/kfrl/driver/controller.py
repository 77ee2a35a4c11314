"""Drives a training run: new or resumed, one pipeline run per iteration, then records it.

The store is the source of truth. ``LATEST`` names the last iteration whose stages are committed
and whose metrics are recorded; a re-run starts after it, and any stage of the next iteration that
was already committed is not redone.
"""
from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from kfrl.config import Config
from kfrl.faults import failpoint
from kfrl.redaction import redact
from kfrl.models.mlmodel import MLMODEL_FILE
from kfrl.run import POLICY_STAGE, Run, registry_view
from kfrl.stages import METRIC_ORDER, STAGES, TIMING_NAMES, plan, skip_reason
from kfrl.store import Store

FIRST_STAGE = STAGES[0]  # every iteration commits it before anything of the iteration is logged
# Sections that say where and how a run executes, not what it computes: a resumed run takes them
# from the current invocation, everything else from the stored config.
EXECUTION_SECTIONS = ("store", "tracking", "pipeline", "cluster")


class TrainingRefused(ValueError):
    """The run cannot start or go on as asked, found before any stage ran; the message says why and
    what to do (the CLI exits with status 2)."""


def _preparation_input_errors() -> tuple[type[BaseException], ...]:
    from kfrl.batch import BatchError
    from kfrl.data.dataset import DatasetError
    from kfrl.models.hf_io import CorruptWeightsError

    return (BatchError, DatasetError, CorruptWeightsError, FileNotFoundError, ImportError, AttributeError)


def new_run_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


@dataclass
class TrainSummary:
    run_id: str
    run_uri: str
    mlflow_run_id: str
    iterations: dict[int, dict[str, float]] = field(default_factory=dict)
    resumed_from: int = 0
    registered_versions: dict[int, str] = field(default_factory=dict)
    mlflow_run_name: str = ""
    tracking_uri: str = ""
    registered_model: str = ""

    def to_dict(self) -> dict:
        """What ``kfrl train --json`` writes for scripts (CI): ids, where things are, the last metrics."""
        last = max(self.iterations) if self.iterations else None
        return {"run_id": self.run_id, "run_uri": self.run_uri, "mlflow_run_id": self.mlflow_run_id,
                "mlflow_run_name": self.mlflow_run_name, "tracking_uri": self.tracking_uri,
                "resumed_from": self.resumed_from, "iterations": sorted(self.iterations),
                "final_iteration": last, "final_metrics": self.iterations.get(last, {}) if last else {},
                "registered_model": self.registered_model,
                "registered_versions": {str(k): v for k, v in sorted(self.registered_versions.items())}}


def mlflow_run_name(experiment_name: str, run_id: str) -> str:
    """veRL names runs by experiment: ``demo-72b9`` for run ``20261203-065917-72b9`` of experiment demo."""
    return f"{experiment_name}-{run_id.rsplit('-', 1)[-1][:12]}"


def run_tags(config: Config, run_uri: str, environ=None) -> dict[str, str]:
    """Where the run came from: the code (the checkout's git commit, else the commit the image was built
    from: ``KFRL_GIT_COMMIT``), kfrl's version, the config's hash, who ran it and how; in a KFP run the
    run's id and UI link, and the image the driver's pod runs, by digest."""
    import getpass
    import hashlib
    import os
    import subprocess
    from importlib import metadata

    environ = os.environ if environ is None else environ

    tags = {"kfrl.store_uri": run_uri, "kfrl.runner": config.pipeline.runner,
            "kfrl.config_hash": hashlib.sha256(config.to_yaml().encode()).hexdigest()[:16],
            "mlflow.source.name": "kfrl train", "mlflow.source.type": "LOCAL"}
    try:
        tags["kfrl.version"] = metadata.version("kfrl")
    except metadata.PackageNotFoundError:
        pass
    try:
        tags["mlflow.user"] = getpass.getuser()
    except (KeyError, OSError):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        if commit.returncode == 0:
            tags["mlflow.source.git.commit"] = commit.stdout.strip()
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                   text=True, timeout=5)
            tags["kfrl.git_dirty"] = str(bool(dirty.stdout.strip())).lower()
    except (OSError, subprocess.SubprocessError):
        pass
    if "mlflow.source.git.commit" not in tags and environ.get("KFRL_GIT_COMMIT", "unknown") != "unknown":
        tags["mlflow.source.git.commit"] = environ["KFRL_GIT_COMMIT"]
    tags.update(kfp_tags(config, environ))
    return tags


def kfp_tags(config: Config, environ) -> dict[str, str]:
    """The KFP run that drives this one (``rl_train``'s task sets ``KFRL_KFP_RUN_ID``) and the image of
    its pod; {} outside KFP."""
    from kfrl.driver.engine.workload import KFP_RUN_VARIABLE

    kfp_run_id = environ.get(KFP_RUN_VARIABLE, "")
    if not kfp_run_id:
        return {}
    tags = {"kfrl.kfp_run_id": kfp_run_id, "mlflow.source.type": "JOB",
            "mlflow.source.name": f"kfrl rl_train (KFP run {kfp_run_id})"}
    ui = (config.pipeline.ui_url or config.pipeline.host or environ.get("KF_PIPELINES_ENDPOINT", "")).rstrip("/")
    if ui:
        tags["kfrl.kfp_run_url"] = kfp_run_url(ui, kfp_run_id)
    from kfrl.kube import own_pod_image

    image = own_pod_image(config, environ)
    if image:
        tags["kfrl.image"], image_id = image
        if "@sha256:" in image_id:
            tags["kfrl.image_digest"] = "sha256:" + image_id.split("@sha256:", 1)[1]
    return tags


def kfp_run_url(ui: str, kfp_run_id: str) -> str:
    return f"{ui.rstrip('/')}/#/runs/details/{kfp_run_id}"


def log_datasets(run: Run, tracker) -> None:
    """The run's committed training and validation data as MLflow dataset inputs (digest of the
    committed files, the user's source, rows)."""
    import hashlib

    from kfrl.store import entry_digest
    from kfrl.tracking import is_local_uri

    for split, context in (("train", "training"), ("val", "validation")):
        manifest = run.store.manifest(f"data/{split}")
        if manifest is None:
            continue
        source = str(manifest.info.get("source", run.store.url(f"data/{split}")))
        if is_local_uri(source) and not source.startswith("builtin:"):
            source = str(Path(source).expanduser().resolve())
        digest = hashlib.sha256("".join(entry_digest(f) for f in manifest.files).encode()).hexdigest()[:16]
        name = Path(source.rstrip("/")).name if "://" in source or "/" in source else source
        tracker.log_dataset(name=f"{split}:{name}", digest=digest, source=source, context=context,
                            rows=int(manifest.info.get("rows", 0)))


def gpu_present() -> bool:
    """A GPU on this machine, seen without importing torch (the driver process never needs it)."""
    import shutil

    return Path("/proc/driver/nvidia/gpus").is_dir() or shutil.which("nvidia-smi") is not None


def resolve_resume(stored: Config, given: Config, total_iterations: int | None) -> tuple[Config, list[str]]:
    """The config of a resumed run and the differences the user asked for that do not apply. A stored
    value that is the given one with its credentials redacted takes the given one."""
    from kfrl.redaction import is_redacted_form_of

    tree = stored.model_dump(mode="json")
    given_tree = given.model_dump(mode="json")
    ignored = []
    for section, values in given_tree.items():
        if section in EXECUTION_SECTIONS:
            tree[section] = values
            continue
        for key, value in values.items():
            if section == "trainer" and key == "total_iterations":
                continue
            if tree[section].get(key) != value:
                if is_redacted_form_of(tree[section].get(key), value):  # stored without its credentials
                    tree[section][key] = value
                    continue
                ignored.append(f"{section}.{key}")
    tree["trainer"]["total_iterations"] = (total_iterations or given.trainer.total_iterations
                                           or stored.trainer.total_iterations)
    return Config.model_validate(tree), ignored


def check_iterations(run_id: str, latest: int | None, iterations: int | None) -> None:
    """``--iterations`` is the run's total: at least 1, and never below what is already recorded."""
    if iterations is None:
        return
    if iterations < 1:
        raise TrainingRefused(f"--iterations must be at least 1 (got {iterations})")
    if latest is not None and iterations < latest:
        raise TrainingRefused(f"run {run_id} has already recorded {latest} iterations (LATEST); --iterations {iterations} "
                            f"is the run's total and cannot be below that. Give --iterations {latest} or more, or "
                            f"export its policy after iteration {iterations} with `kfrl export --run {run_id} "
                            f"--iteration {iterations}`")


def check_store_matches_tracking(run: Run, run_id: str, latest: int | None, recorded: int, mlflow_run_id: str) -> None:
    """Refuse to recompute what MLflow already recorded when the store is not the one the run wrote to.

    The controller logs an iteration and then moves LATEST, once the commits it made in the background
    (an update's weights, and the data stages that queued behind them) are durable. A kill in between
    leaves MLflow ahead of LATEST with some of those stages uncommitted: on resume they run again (their
    metrics are not logged twice, no version is registered twice), so that is no error. What a kill
    cannot leave: MLflow with iterations while the store has none of them (wiped, or another store), or
    more than one iteration ahead of a store that has not even started the iteration after LATEST."""
    done = latest or 0
    if recorded <= done:
        return
    started = run.is_committed(FIRST_STAGE, done + 1)
    if (latest is None and not started) or (recorded > done + 1 and not started):
        raise TrainingRefused(
            f"MLflow run {mlflow_run_id} of kfrl run {run_id} has recorded iterations up to {recorded}, but the store at "
            f"{run.uri} has {'no LATEST' if latest is None else f'LATEST={latest}'} and lacks iteration {done + 1}'s "
            "commits: the store was wiped or replaced, or this is not the store the run wrote to. Nothing was "
            "recomputed. Point --store at the run's store, or start a new run (without --run-id)")


def resolve_total(run: Run, config: Config) -> Config:
    """Fix trainer.total_iterations (from total_epochs when null: veRL's total_training_steps =
    len(dataloader) x total_epochs, drop_last) and store the config stages will read."""
    from kfrl.data.dataset import steps_per_epoch

    if config.trainer.total_iterations is None:
        manifest = run.store.manifest("data/train")
        rows = int(manifest.info.get("rows", 0)) if manifest is not None else 0
        per_epoch = steps_per_epoch(rows, config.data.train_batch_size)
        if per_epoch == 0:
            raise ValueError(f"the training set has {rows} rows, fewer than data.train_batch_size="
                             f"{config.data.train_batch_size}: not one iteration per epoch")
        config = config.model_copy(update={"trainer": config.trainer.model_copy(
            update={"total_iterations": per_epoch * config.trainer.total_epochs})})
    text = config.to_yaml()
    if run.config_text() != text:
        run.write_config(text)
    return config


def generation_rows(run: Run, iteration: int, limit: int) -> list[dict]:
    """A few (prompt, response, score) rows for the MLflow table."""
    if limit <= 0:
        return []
    from kfrl.stages.context import StageContext

    ctx = StageContext.open(run.uri, iteration)
    table = ctx.read_groups("rollout", "score").slice(0, limit)
    tokenizer = ctx.load_tokenizer(ctx.policy_manifest(0))
    prompts = tokenizer.batch_decode(table.column("prompt_ids").to_pylist(), skip_special_tokens=False)
    response_ids = table.column("response_ids").to_pylist()
    responses = tokenizer.batch_decode(response_ids, skip_special_tokens=False)
    rows = [{"iteration": iteration, "sample_id": s, "uid": u, "policy_version": v, "prompt": p, "response": r,
             "ground_truth": g, "score": sc}
            for s, u, v, p, r, g, sc in zip(
                table.column("sample_id").to_pylist(), table.column("uid").to_pylist(),
                table.column("policy_version").to_pylist(), prompts, responses,
                table.column("ground_truth").to_pylist(), table.column("score").to_pylist())]
    if "turn_offsets" in table.column_names:  # multi-turn: the conversation turn by turn
        for row, ids, offsets, mask, turns in zip(rows, response_ids, table.column("turn_offsets").to_pylist(),
                                                  table.column("response_mask").to_pylist(),
                                                  table.column("num_turns").to_pylist()):
            row["num_turns"] = turns
            row["conversation"] = conversation_text(tokenizer, ids, offsets, mask)
    return rows


def conversation_text(tokenizer, response_ids: list[int], turn_offsets: list[int], response_mask: list[int]) -> str:
    """A multi-turn response as one labelled block per turn: [assistant] what the model wrote, [tool]
    what the loop inserted (response_mask 0)."""
    bounds = list(turn_offsets) + [len(response_ids)]
    parts = []
    for start, end in zip(bounds, bounds[1:]):
        role = "assistant" if start < len(response_mask) and response_mask[start] else "tool"
        parts.append(f"[{role}] {tokenizer.decode(response_ids[start:end], skip_special_tokens=False)}")
    return "\n".join(parts)


class StageWatcher:
    """Polls the store for committed stages so the terminal shows where an iteration is. One request
    per poll (the next stage in order), every 2 s on S3: the display must not load the store."""

    def __init__(self, run: Run, iteration: int, status, label: str, interval: float | None = None):
        self.run, self.iteration, self.status, self.label = run, iteration, status, label
        self.interval = interval if interval is not None else (2.0 if run.store.is_s3 else 0.5)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.started = time.monotonic()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self):
        done = 0
        while not self._stop.is_set():
            try:
                while done < len(STAGES) and self.run.is_committed(STAGES[done], self.iteration):
                    done += 1
            except Exception:  # the watcher only informs; the runner reports real failures
                pass
            running = STAGES[done] if done < len(STAGES) else "recording"
            elapsed = time.monotonic() - self.started
            self.status.update(f"{self.label} · {running} … ({elapsed:.0f}s, {done}/{len(STAGES)} stages)")
            self._stop.wait(self.interval)


def train(config: Config, *, run_id: str | None = None, iterations: int | None = None, reprepare: bool = False,
          console=None, log_dir: str | Path | None = None) -> TrainSummary:
    """Run (or resume, with ``run_id``) a training run to ``iterations`` (its total). ``reprepare``
    repairs a run that recorded no iteration: its preparation is withdrawn and done again from ``config``."""
    from rich.console import Console

    from kfrl.driver import make_runner
    from kfrl.stages.prepare import prepare_run
    from kfrl.tracking import Tracker, check_reachable, credentials_to_environment

    import sys

    # Outside a terminal (CI logs, files) lines are not wrapped at 80 columns.
    console = console or Console(soft_wrap=not sys.stdout.isatty())
    failpoint("startup")
    config = config.model_copy(update={"tracking": config.tracking.from_environment()})
    # Credentials in the tracking URI go to MLflow's variables: the config is stored, printed and logged.
    config = config.model_copy(update={"tracking": config.tracking.model_copy(
        update={"uri": credentials_to_environment(config.tracking.uri)})})
    if config.pipeline.runner == "kfp":  # the cluster's pods must see the store and load the model
        from kfrl.driver.submit import cluster_input_problems

        problems = cluster_input_problems(config)
        if problems:
            raise TrainingRefused("pipeline.runner=kfp: " + "; ".join(problems))
    check_reachable(config.tracking.uri)  # seconds, before anything is written
    root = Store(config.store.uri, **config.store.options())
    root.ping()
    run_id = run_id or new_run_id()
    run_uri = root.url(f"{config.trainer.experiment_name}/{run_id}")
    run = Run.at(run_uri, **config.store.options())
    latest = run.latest()
    check_iterations(run_id, latest, iterations)
    if reprepare:
        if latest is not None:
            raise TrainingRefused(f"run {run_id} has recorded iterations up to {latest}; --reprepare only repairs a run "
                                "that recorded none. Start a new run (without --run-id), e.g. from its exported policy")
        withdrawn = run.withdraw_all()
        console.print(f"[yellow]re-preparing run {run_id}: withdrew its config and {withdrawn} commits; this "
                      "invocation's config and inputs are used[/]")

    if run.has_config():
        config, ignored = resolve_resume(run.config(), config, iterations)
        if ignored:
            hint = " (no iteration is recorded yet: --reprepare starts it again with the new values)" \
                if latest is None else ""
            console.print(f"[yellow]resuming {run_id}: its stored config wins for {', '.join(ignored)}{hint}[/]")
    elif iterations:
        config = config.model_copy(update={"trainer": config.trainer.model_copy(
            update={"total_iterations": iterations})})
    with console.status(f"preparing run {run_id} (data, initial policy)"):
        try:
            prepare_run(run.store, config)
        except _preparation_input_errors() as err:
            raise TrainingRefused(f"preparing run {run_id}: {err}. Nothing of it was committed: fix the input and "
                                  f"run the same command again") from err
        config = resolve_total(run, config)
    total = config.trainer.total_iterations
    latest = run.latest() or 0

    run_name = mlflow_run_name(config.trainer.experiment_name, run_id)
    tracker = Tracker(config.tracking.uri, config.tracking_experiment, run_id, run_name=run_name, fresh=reprepare)
    check_store_matches_tracking(run, run_id, run.latest(), tracker.last_logged_iteration(), tracker.mlflow_run_id)
    tracker.log_params(config.flat())
    tracker.set_tags(run_tags(config, run_uri))
    tracker.log_config(config.to_yaml())
    log_datasets(run, tracker)
    system_metrics = config.tracking.system_metrics
    if system_metrics is True or (system_metrics == "auto" and gpu_present()):
        tracker.start_system_metrics()
    summary = TrainSummary(run_id=run_id, run_uri=run_uri, mlflow_run_id=tracker.mlflow_run_id, resumed_from=latest,
                           mlflow_run_name=run_name, tracking_uri=tracker.tracking_uri,
                           registered_model=config.registered_model_name)
    stage_plan = plan(config)
    console.print(f"[bold]kfrl[/] run [cyan]{run_id}[/] · store {redact(run_uri)} · runner {config.pipeline.runner} · "
                  f"MLflow run {tracker.mlflow_run_id}")
    if latest:
        console.print(f"resuming after iteration {latest} (LATEST); iterations {latest + 1}..{total} to go")
    skipped = [s for s, why in stage_plan.items() if why]
    if skipped:
        console.print(f"stages skipped by this algorithm: {', '.join(skipped)}")

    runner = make_runner(config)
    logs = Path(log_dir or Path(config.pipeline.pipeline_root) / "logs") / run_id
    engine = None
    try:
        engine = start_engine(runner, run, config, logs, console, tracker)
        if latest == 0 and not skip_reason("validate", config, 0):
            with console.status("validating the initial policy (trainer.val_before_train)"):
                runner.run(run_uri, 0, logs / "validate-000000.log", pipeline="validate")
            metrics = run.iteration_metrics(0, METRIC_ORDER)
            tracker.log_iteration(0, metrics)
            console.print(validation_line(0, metrics))
        for iteration in range(latest + 1, total + 1):
            if engine is not None and not engine.alive():
                engine = restart_engine(engine, console)
            label = f"iteration {iteration}/{total}"
            started = time.perf_counter()
            with console.status(label) as status, StageWatcher(run, iteration, status, label):
                kfp_run_id = runner.run(run_uri, iteration, logs / f"iter-{iteration:06d}.log")
            step_time = time.perf_counter() - started
            if kfp_run_id:  # the iteration's own KFP run, one tag per iteration
                tracker.set_tags({f"kfrl.kfp_run.iter-{iteration:06d}": kfp_run_id})
            metrics = record_iteration(run, tracker, config, iteration, step_time, summary)
            console.print(iteration_line(iteration, total, metrics, stage_plan))
            if any(key.startswith("val-core/") for key in metrics):
                console.print(validation_line(iteration, metrics))
    except KeyboardInterrupt:
        tracker.finish("KILLED")
        raise
    except BaseException:
        tracker.finish("FAILED")
        raise
    finally:
        if engine is not None:
            engine.stop()
        close = getattr(runner, "close", None)
        if close is not None:
            close()
    tracker.finish("FINISHED")
    return summary


def start_engine(runner, run: Run, config: Config, logs: Path, console, tracker=None):
    """The run's resident engine (``pipeline.engines=resident``): a child process for the local runner
    (when it cannot start, the tasks run their stages themselves: slower, the same results), a
    Kubernetes workload on a cluster (``ClusterKfpRunner.start_engine``: without it the run fails, its
    GPU tasks being CPU-only clients); None for the inline runner, which is resident by nature."""
    if config.pipeline.engines != "resident":
        return None
    if config.pipeline.runner == "kfp":
        with console.status("starting the run's engine on the cluster"):
            # The engine has the GPUs the driver's pod lacks: it logs their system metrics into the run.
            metrics_run = (tracker.mlflow_run_id, tracker.tracking_uri) \
                if tracker is not None and config.tracking.system_metrics else None
            engine = runner.start_engine(run, log=lambda line: console.print(f"[dim]{line}[/]"),
                                         metrics_run=metrics_run)
        if engine is not None:
            console.print(f"engine {engine.namespace}/{engine.name} ready at {engine.url}")
        return engine
    if config.pipeline.runner != "local":
        return None
    from kfrl.driver.engine.client import EngineProcess, EngineUnavailable

    try:
        with console.status("starting the resident engine"):
            engine = EngineProcess(run, logs / "engine.log").start()
        console.print(f"resident engine at {engine.url} (log {logs / 'engine.log'})")
        return engine
    except EngineUnavailable as err:
        console.print(f"[yellow]no resident engine ({err}); each task runs its own stage[/]")
        return None


def restart_engine(engine, console):
    """A dead engine, replaced between iterations. A local one that does not come back leaves the
    tasks to run their stages themselves; a cluster one that does not come back fails the run."""
    from kfrl.driver.engine.client import EngineUnavailable

    console.print("[yellow]the resident engine is gone; starting it again[/]")
    try:
        engine.restart()
    except EngineUnavailable as err:
        console.print(f"[yellow]the engine did not come back ({err}); each task runs its own stage[/]")
        return None
    return engine


def record_iteration(run: Run, tracker, config: Config, iteration: int, step_time: float,
                     summary: TrainSummary) -> dict[str, float]:
    metrics = run.iteration_metrics(iteration, METRIC_ORDER)
    metrics["timing_s/step"] = step_time
    metrics["perf/time_per_step"] = step_time
    metrics["training/global_step"] = float(iteration)
    if "perf/total_num_tokens" in metrics and step_time > 0:
        metrics["perf/throughput"] = metrics["perf/total_num_tokens"] / step_time
    tracker.log_iteration(iteration, metrics)
    rows = generation_rows(run, iteration, config.trainer.log_generations)
    if rows:
        tracker.log_table(rows, f"generations/iter-{iteration:06d}.json")
    save = config.trainer.save_freq
    due = iteration == config.trainer.total_iterations or (save > 0 and iteration % save == 0)
    actor_update = run.manifest(POLICY_STAGE, iteration)
    if due and actor_update is not None and not actor_update.info.get("skipped"):  # none during critic warm-up
        from kfrl.tracking import VALIDATION_PREFIX, TrackingError, mlflow_metric_name

        from kfrl.store import settle_in_flight

        settle_in_flight()  # the folder must be complete (an update may still be writing it)
        # The version is the committed folder: an HF directory that is also an MLflow model.
        folder = run.store.url(f"{actor_update.prefix}/{actor_update.attempt}")
        mlmodel = MLMODEL_FILE
        if actor_update.info.get("adapter"):  # a LoRA commit: the version is the merged model beside the adapter
            from kfrl.models.lora import MERGED_FOLDER

            folder, mlmodel = f"{folder}/{MERGED_FOLDER}", f"{MERGED_FOLDER}/{MLMODEL_FILE}"
        if mlmodel not in actor_update.names():
            raise TrackingError(f"the policy checkpoint {folder} is no MLflow model (no {MLMODEL_FILE}: the update ran "
                                "where MLflow is not installed); it cannot be registered. Install mlflow in the "
                                "update's image, or set trainer.save_freq=0 to register nothing")
        tags = {mlflow_metric_name(k): f"{v:.8g}" for k, v in metrics.items() if k.startswith(VALIDATION_PREFIX)}
        tags["mlflow_run_id"] = tracker.mlflow_run_id
        summary.registered_versions[iteration] = tracker.register_checkpoint(
            config.registered_model_name, folder, iteration, tags=tags,
            view_dir=run.store.url(registry_view(iteration)))
        failpoint("registration")
    run.set_latest(iteration)
    failpoint("latest")
    if config.trainer.keep_policy_weights > 0:  # after LATEST: nothing the next iteration reads goes
        from kfrl.retention import apply_policy_retention

        apply_policy_retention(run, config.trainer.keep_policy_weights, config.trainer.save_freq,
                               tracker.registered_iterations())
    summary.iterations[iteration] = metrics
    return metrics


def validation_line(iteration: int, metrics: dict[str, float]) -> str:
    core = "  ".join(f"{key.removeprefix('val-core/')} {value:.3f}" for key, value in sorted(metrics.items())
                     if key.startswith("val-core/"))
    return f"validate after {iteration:>3}  {core}"


def iteration_line(iteration: int, total: int, metrics: dict[str, float], stage_plan: dict[str, str]) -> str:
    timings = " ".join(f"{TIMING_NAMES[s]} {metrics.get('timing_s/' + TIMING_NAMES[s], 0):.1f}s"
                       for s in STAGES if not stage_plan[s])
    # No pg_loss while the critic warms up: the actor was not updated.
    actor = f"pg_loss {metrics['actor/pg_loss']:+.4f}" if "actor/pg_loss" in metrics else "actor held"
    tools = (f"tools {metrics['tool_calls/sample_rate']:.2f} turns {metrics['num_turns/mean']:.1f}  "
             if "tool_calls/sample_rate" in metrics else "")
    return (f"iter {iteration:>3}/{total}  score {metrics.get('critic/score/mean', float('nan')):.3f}  "
            f"resp_len {metrics.get('response_length/mean', float('nan')):.1f}  {tools}{actor}  "
            f"step {metrics['timing_s/step']:.1f}s  ({timings})")
