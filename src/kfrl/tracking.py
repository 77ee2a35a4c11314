"""MLflow tracking for kfrl training runs.

One MLflow run per kfrl training run, found again through the run tag ``kfrl.run_id`` so a
resumed training run keeps logging into the same MLflow run. Every write is idempotent: a
controller that crashes and re-records an iteration must not duplicate metrics, tables or
registered model versions.

All calls go through an ``MlflowClient`` bound to an explicit tracking and registry URI; the
global ``mlflow`` state (``set_tracking_uri``, ``start_run``) is never touched, so Trackers with
different URIs can live in one process.

Checkpoint sources: MLflow's registry, used directly on a database (the embedded sqlite default),
accepts any source string, local paths included. An ``mlflow server`` refuses a local path unless
it lies inside the run's artifact directory (and its clients could not read one anyway). For a local
checkpoint behind a server the Tracker copies the checkpoint folder into the run's artifacts
(``checkpoints/iter-NNNNNN``) and registers ``runs:/<run_id>/checkpoints/iter-NNNNNN`` instead. Either
way the model version carries the real store URI in its tag ``kfrl.store_uri``.

A registry on a database, given the committed folder itself, would let MLflow write into it: loading
``models:/NAME/N`` from a local source returns the source folder and adds ``registered_model_meta`` to
it. So a local checkpoint is registered through a view of its own (``view_dir``, outside the committed
folders): a folder of hard links to the committed files (no second copy of the weights), which loads
may write into. Where a hard link cannot be made (another file system), the file is copied.
"""
from __future__ import annotations

import json
import logging
import math
import os
import posixpath
import sqlite3
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from urllib.parse import urlparse, urlunparse

from kfrl.config import flatten  # noqa: F401  (re-exported: the flattened config is what params log)
from kfrl.faults import failpoint
from kfrl.redaction import MASK, redact

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS
from mlflow.utils.validation import (
    MAX_ENTITY_KEY_LENGTH,
    MAX_METRICS_PER_BATCH,
    MAX_PARAM_VAL_LENGTH,
    MAX_PARAMS_TAGS_PER_BATCH,
)

logger = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///kfrl-runs/mlflow.db"

RUN_ID_TAG = "kfrl.run_id"
LAST_LOGGED_ITERATION_TAG = "kfrl.last_logged_iteration"
STORE_URI_TAG = "kfrl.store_uri"
ITERATION_TAG = "iteration"
FINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")
# MLflow 3's UI opens an experiment in its GenAI (traces) view unless it is tagged as model training.
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
CONFIG_ARTIFACT = "config.yaml"
# Metrics of this prefix at a registered iteration become tags of the model version (promotion reads them).
VALIDATION_PREFIX = "val-core/"

# A short, bounded retry for a tracking server that is briefly away (a restarting pod is healthy
# again after ~20 s). MLflow's own HTTP session already retries connection errors; its defaults
# (7 tries, factor 2) can stall training for minutes, so we only tune it: ~0+2+4+8+16 s.
HTTP_RETRY_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "5",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
}

# URI schemes of registries reached through a server, which validates model version sources.
_SERVER_SCHEMES = {"http", "https", "databricks", "databricks-uc", "uc"}


class TrackingError(RuntimeError):
    """MLflow cannot be used as configured; the message names the URI (credentials removed) and the fix."""


def resolve_tracking_uri(tracking_uri: str | None) -> str:
    """Empty -> the embedded default; a sqlite URI becomes absolute, and its database is created
    whole (``ensure_sqlite_database``) when it does not exist yet."""
    uri = tracking_uri or DEFAULT_TRACKING_URI
    db_path = sqlite_db_path(uri)
    if db_path is None:
        return uri
    db_path = db_path.resolve()
    db_path.parent.mkdir(parents=True, exist_ok=True)
    ensure_sqlite_database(db_path)
    query = uri.partition("?")[2]
    # An absolute path keeps the run findable if the process later changes its working directory.
    return f"sqlite:///{db_path}" + (f"?{query}" if query else "")


def ensure_sqlite_database(db_path: Path) -> None:
    """Create MLflow's SQLite database so that a kill at any moment leaves either none or a whole one.

    MLflow builds a new database in place over ~3 s of migrations; killed in between, the file stays
    half-migrated and every later start fails (``table ... already exists``). Here the schema is built
    in a temporary file and hard-linked into place (the link fails if another process won the race).
    A half-built database left by an older kill (no current schema revision, no runs, no models) is
    moved aside to ``<name>.broken-<time>`` and rebuilt; one that holds data is left to MLflow, which
    names the upgrade command for an old schema.
    """
    if db_path.exists():
        if not _is_half_built(db_path):
            return
        aside = db_path.with_name(f"{db_path.name}.broken-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(db_path, aside)
        logger.warning("MLflow database %s was half-created (a process was killed while creating it) and held "
                       "no runs; moved it to %s and creating it again", db_path, aside)
    _remove_dead_temporaries(db_path)
    tmp = db_path.with_name(f".{db_path.name}.init-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        _write_new_database(tmp)
        failpoint("mlflow_init")
        try:
            os.link(tmp, db_path)
        except FileExistsError:
            pass  # created meanwhile by another process: theirs is whole too
    finally:
        tmp.unlink(missing_ok=True)


_NEW_DATABASE: bytes | None = None  # an empty database's file, as MLflow's migrations left it


def _write_new_database(path: Path) -> None:
    """MLflow's empty database at ``path``. MLflow's migrations (~1 s) run once per process; later
    databases are copies of that first file (the same tables at the same schema revision), so a
    process that creates several (a notebook, the test suite) pays them once."""
    global _NEW_DATABASE
    if _NEW_DATABASE is not None:
        with open(path, "wb") as fh:
            fh.write(_NEW_DATABASE)
            fh.flush()
            os.fsync(fh.fileno())  # on disk before it is linked into place, as SQLite's own commit is
        return
    import sqlalchemy
    from mlflow.store.db.utils import _initialize_tables  # what MLflow itself runs on a new database

    engine = sqlalchemy.create_engine(f"sqlite:///{path}")
    try:
        _initialize_tables(engine)
    finally:
        engine.dispose()
    _NEW_DATABASE = path.read_bytes()


def _remove_dead_temporaries(db_path: Path) -> None:
    """Temporary databases of processes killed while creating one (their pid is in the name)."""
    for tmp in db_path.parent.glob(f".{db_path.name}.init-*"):
        pid = tmp.name.rsplit(".init-", 1)[1].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_half_built(db_path: Path) -> bool:
    from mlflow.store.db.utils import _get_latest_schema_revision

    try:
        con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    except sqlite3.Error:
        return False  # not ours to judge; MLflow reports it
    try:
        tables = {row[0] for row in con.execute("select name from sqlite_master where type='table'")}
        if "alembic_version" in tables:
            revision = con.execute("select version_num from alembic_version").fetchone()
            if revision is not None and revision[0] == _get_latest_schema_revision():
                return False
        for table in ("runs", "registered_models"):
            if table in tables and con.execute(f"select count(*) from {table}").fetchone()[0]:
                return False
        return True
    except sqlite3.Error:
        return False
    finally:
        con.close()


# --- credentials ---------------------------------------------------------------------------------

def credentials_to_environment(uri: str) -> str:
    """A tracking URI without its ``user:password@``; the credentials go to MLflow's own variables
    (``MLFLOW_TRACKING_USERNAME`` / ``_PASSWORD``, which its HTTP client sends as basic auth), so the
    config that is stored, printed and logged as params never holds them."""
    parsed = urlparse(uri)
    if not parsed.username and not parsed.password:
        return uri
    from urllib.parse import unquote

    # "***@" is what redaction left of them (a stored or submitted config): the environment has them, or not.
    if parsed.username != MASK:
        if parsed.username:
            os.environ["MLFLOW_TRACKING_USERNAME"] = unquote(parsed.username)
        if parsed.password:
            os.environ["MLFLOW_TRACKING_PASSWORD"] = unquote(parsed.password)
    host = parsed.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parsed.port:
        netloc += f":{parsed.port}"
    return urlunparse(parsed._replace(netloc=netloc))


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds, before anything is written, when a tracking server does not answer.

    Any HTTP answer counts (auth is checked by the first real call); a refused or timed-out
    connection raises TrackingError naming the server."""
    if urlparse(uri).scheme not in ("http", "https"):
        return
    import requests

    try:
        requests.get(uri.rstrip("/") + "/health", timeout=timeout_s)
    except requests.RequestException as err:
        reason = type(err).__name__
        if isinstance(err, requests.ConnectionError):
            reason = "connection refused or host unknown"
        elif isinstance(err, requests.Timeout):
            reason = f"no answer within {timeout_s:.0f}s"
        raise TrackingError(f"MLflow tracking server {redact(uri)} is unreachable ({reason}); start it, or fix "
                            "--tracking-uri / tracking.uri") from None


def sqlite_db_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///path`` URI; None for other URIs and in-memory sqlite."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return None
    path = uri[len(prefix):].partition("?")[0]
    if path in ("", ":memory:"):
        return None
    return Path(path)


def configure_http_retries() -> None:
    """Apply HTTP_RETRY_DEFAULTS where the user has not set MLflow's variables themselves.

    MLflow reads these variables on every request, so this is process-wide, but it only fills
    gaps and never overrides a choice made in the environment.
    """
    for name, value in HTTP_RETRY_DEFAULTS.items():
        os.environ.setdefault(name, value)


def quiet_mlflow_logs() -> None:
    """Silence MLflow's per-database and per-call INFO chatter (schema creation, migrations)."""
    for name in ("mlflow.store.db.utils", "mlflow.store.model_registry.abstract_store", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)


def is_local_uri(uri: str) -> bool:
    """True for plain paths and ``file://`` URIs (a one-letter scheme is a Windows drive)."""
    scheme = urlparse(uri).scheme
    return scheme in ("", "file") or len(scheme) == 1


def absolute_local_uri(uri: str) -> str:
    """A local path made absolute; a ``file://`` URI is kept as it is."""
    if urlparse(uri).scheme == "file":
        return uri
    return str(Path(uri).resolve())


def is_server_uri(uri: str) -> bool:
    """True when MLflow talks to a server, False for a database or folder it writes directly."""
    # partition, not urlparse: "databricks" alone is a server URI without "://"
    return uri.partition(":")[0] in _SERVER_SCHEMES


def accepts_local_sources(registry_uri: str) -> bool:
    """Whether the registry takes a local model version source as it is (see module docstring)."""
    return not is_server_uri(registry_uri)


def chunks(items: Sequence, size: int) -> Iterator[Sequence]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def require_no_quote(kind: str, value: str) -> None:
    # Values are interpolated into MLflow search filters, which have no escaping for quotes.
    if "'" in value:
        raise ValueError(f"{kind} must not contain a single quote: {value!r}")


def linked_view(folder: Path, view: Path) -> Path:
    """``view``: a folder with ``folder``'s files as hard links (copies where a link cannot be made),
    built beside and renamed into place, so a view either is complete or does not exist."""
    import shutil

    from kfrl.models.mlmodel import MLMODEL_FILE

    if (view / MLMODEL_FILE).is_file():
        return view
    partial = view.with_name(view.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    for source in sorted(folder.rglob("*")):
        if source.is_file():
            target = partial / source.relative_to(folder)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source, target)
            except OSError:
                shutil.copy2(source, target)
    partial.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(view, ignore_errors=True)
    os.replace(partial, view)
    return view


def start_system_metrics(mlflow_run_id: str, tracking_uri: str, *, node_id: str | None = None,
                         interval_s: float = 10.0):
    """MLflow's ``SystemMetricsMonitor`` sampling this process's machine into a run (metric names
    ``system/[node_id/]...``); None when MLflow cannot sample here (no psutil, no NVML)."""
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(mlflow_run_id, sampling_interval=interval_s, resume_logging=True,
                                       node_id=node_id, tracking_uri=tracking_uri)
        monitor.start()
    except Exception as err:  # noqa: BLE001 - a missing psutil or NVML must not stop training
        logger.warning("system metrics are off: %s", err)
        return None
    return monitor


def stop_system_metrics(monitor) -> None:
    """Stop sampling; one last sample is logged first, so even a run shorter than the sampling
    interval has its system metrics."""
    if monitor is None:
        return
    try:
        monitor.collect_metrics()
        monitor.publish_metrics(monitor.aggregate_metrics())
    except Exception as err:  # noqa: BLE001 - the metrics are a nicety; finishing the run is not
        logger.warning("last system metrics sample not logged: %s", err)
    monitor.finish()  # flushes what was published


def registered_iterations(client, kfrl_run_id: str) -> set[int]:
    require_no_quote("run id", kfrl_run_id)
    versions = client.search_model_versions(f"tag.`{RUN_ID_TAG}`='{kfrl_run_id}'")
    return {int(v.tags[ITERATION_TAG]) for v in versions if str(v.tags.get(ITERATION_TAG, "")).isdigit()}


def checkpoint_artifact_dir(iteration: int) -> str:
    return f"checkpoints/iter-{iteration:06d}"


def mlflow_metric_name(name: str) -> str:
    """MLflow refuses "@" in metric names; veRL's MLflow logger writes val-core/.../mean@1 as mean_at_1."""
    return name.replace("@", "_at_")


class Tracker:
    """The MLflow side of one kfrl training run. See the module docstring."""

    def __init__(self, tracking_uri: str | None, experiment_name: str, kfrl_run_id: str, *,
                 run_name: str | None = None, fresh: bool = False):
        """``fresh``: the kfrl run was prepared again (``kfrl train --reprepare``); its earlier MLflow runs
        and model versions are retired (their ``kfrl.run_id`` tag renamed, the runs marked FAILED) and a
        new MLflow run starts."""
        require_no_quote("kfrl_run_id", kfrl_run_id)
        quiet_mlflow_logs()
        self.tracking_uri = resolve_tracking_uri(credentials_to_environment(tracking_uri or ""))
        if is_server_uri(self.tracking_uri):
            configure_http_retries()
        self.kfrl_run_id = kfrl_run_id
        self.client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
        self.experiment_id = self._get_or_create_experiment(experiment_name)
        if fresh:
            self._retire_runs()
        self.mlflow_run_id = self._find_or_create_run(run_name)
        # The first iteration this process logs may have been half recorded by a killed one (below).
        self._check_partial_record = True

    # --- run lifecycle -------------------------------------------------------------------------

    def _default_artifact_location(self) -> str | None:
        # For the embedded sqlite store MLflow would put artifacts in ./mlruns of whatever the
        # working directory is; keep them next to the database instead.
        db_path = sqlite_db_path(self.tracking_uri)
        return (db_path.parent / "artifacts").as_uri() if db_path else None

    def _get_or_create_experiment(self, name: str) -> str:
        experiment = self.client.get_experiment_by_name(name)
        if experiment is None:
            try:
                return self.client.create_experiment(
                    name, artifact_location=self._default_artifact_location(),
                    tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
            except MlflowException as error:
                if error.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                # Another tracker created it between our lookup and our create.
                experiment = self.client.get_experiment_by_name(name)
        if experiment.lifecycle_stage == "deleted":
            logger.warning("MLflow experiment %r was deleted; restoring it", name)
            self.client.restore_experiment(experiment.experiment_id)
        if EXPERIMENT_KIND_TAG not in experiment.tags:
            self.client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return experiment.experiment_id

    def _find_or_create_run(self, run_name: str | None) -> str:
        runs = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.`{RUN_ID_TAG}` = '{self.kfrl_run_id}'",
            order_by=["attributes.start_time ASC"],
            max_results=10,
        )
        if not runs:
            run = self.client.create_run(
                self.experiment_id, run_name=run_name, tags={RUN_ID_TAG: self.kfrl_run_id})
            return run.info.run_id
        if len(runs) > 1:
            logger.warning("%d MLflow runs carry kfrl.run_id=%s; using the oldest",
                           len(runs), self.kfrl_run_id)
        run = runs[0]
        if run.info.status != "RUNNING":
            # A resumed training run: reopen the run it finished or failed with.
            self.client.update_run(run.info.run_id, status="RUNNING")
        return run.info.run_id

    def _retire_runs(self) -> None:
        retired = f"{self.kfrl_run_id}~retired-{time.strftime('%Y%m%d-%H%M%S')}"
        for run in self.client.search_runs([self.experiment_id],
                                           filter_string=f"tags.`{RUN_ID_TAG}` = '{self.kfrl_run_id}'"):
            self.client.set_tag(run.info.run_id, RUN_ID_TAG, retired)
            if run.info.status == "RUNNING":
                self.client.set_terminated(run.info.run_id, status="FAILED")
        for version in self.client.search_model_versions(f"tag.`{RUN_ID_TAG}`='{self.kfrl_run_id}'"):
            self.client.set_model_version_tag(version.name, version.version, RUN_ID_TAG, retired)

    def finish(self, status: str = "FINISHED") -> None:
        if status not in FINAL_STATUSES:
            raise ValueError(f"status must be one of {FINAL_STATUSES}, got {status!r}")
        self.stop_system_metrics()
        self.client.set_terminated(self.mlflow_run_id, status=status)

    def start_system_metrics(self, interval_s: float = 10.0) -> bool:
        """MLflow's system metrics (CPU, memory, disk, network; GPU through pynvml) logged to this run
        every ``interval_s`` until ``finish``. False when MLflow cannot sample here."""
        self._system_metrics = start_system_metrics(self.mlflow_run_id, self.tracking_uri, interval_s=interval_s)
        return self._system_metrics is not None

    def stop_system_metrics(self) -> None:
        monitor, self._system_metrics = getattr(self, "_system_metrics", None), None
        stop_system_metrics(monitor)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish("FINISHED" if exc_type is None else "FAILED")

    # --- params and tags -----------------------------------------------------------------------

    def log_params(self, params: Mapping) -> None:
        """Log the flattened config. MLflow params are immutable: a key already logged with a
        different value keeps its original value (with a warning) so that a resume never fails."""
        wanted = self._param_values(params)
        logged = self.client.get_run(self.mlflow_run_id).data.params
        new_params = []
        for key, value in wanted.items():
            if key not in logged:
                new_params.append(Param(key, value))
            elif logged[key] != value:
                logger.warning("param %r already logged as %r; keeping it, not %r",
                               key, logged[key], value)
        for batch in chunks(new_params, MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.mlflow_run_id, params=batch, synchronous=True)

    @staticmethod
    def _param_values(params: Mapping) -> dict[str, str]:
        values = {}
        for key, value in flatten(params).items():
            if len(key) > MAX_ENTITY_KEY_LENGTH:
                logger.warning("param key longer than %d characters skipped: %s...",
                               MAX_ENTITY_KEY_LENGTH, key[:80])
                continue
            # Truncate here rather than let MLflow do it, so a later comparison sees the same value.
            values[key] = redact(str(value))[:MAX_PARAM_VAL_LENGTH]
        return values

    def set_tags(self, tags: Mapping) -> None:
        run_tags = [RunTag(str(key), str(value)) for key, value in tags.items()]
        for batch in chunks(run_tags, MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.mlflow_run_id, tags=batch, synchronous=True)

    def log_config(self, yaml_text: str) -> None:
        """The resolved config as the run's ``config.yaml`` artifact (rewritten on resume)."""
        self.client.log_text(self.mlflow_run_id, yaml_text, CONFIG_ARTIFACT)

    def log_dataset(self, *, name: str, digest: str, source: str, context: str, rows: int,
                    columns: Sequence[str] = ()) -> bool:
        """Record a dataset the run used as an MLflow dataset input (its digest, source URI and row
        count; ``context`` training | validation). Returns False when this run already has it."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        inputs = self.client.get_run(self.mlflow_run_id).inputs
        for existing in inputs.dataset_inputs if inputs else []:
            if existing.dataset.name == name and existing.dataset.digest == digest:
                return False
        scheme = urlparse(source).scheme
        source_type = "builtin" if scheme == "builtin" else "local" if is_local_uri(source) else scheme
        schema = {"mlflow_colspec": [{"name": column, "type": "string"} for column in columns]} if columns else None
        dataset = Dataset(name=name, digest=digest[:36], source_type=source_type,
                          source=json.dumps({"uri": source}), schema=json.dumps(schema) if schema else None,
                          profile=json.dumps({"num_rows": rows}))
        self.client.log_inputs(self.mlflow_run_id, datasets=[
            DatasetInput(dataset, tags=[InputTag("mlflow.data.context", context)])])
        return True

    # --- metrics -------------------------------------------------------------------------------

    def last_logged_iteration(self) -> int:
        """The last iteration recorded by log_iteration; -1 when none was."""
        tags = self.client.get_run(self.mlflow_run_id).data.tags
        return int(tags.get(LAST_LOGGED_ITERATION_TAG, -1))

    def log_iteration(self, iteration: int, metrics: Mapping[str, float]) -> bool:
        """Log one iteration's metrics at step=iteration. Returns False, logging nothing, when
        this iteration (or a later one) was already recorded."""
        if iteration <= self.last_logged_iteration():
            return False
        metric_list = self._finite_metrics(iteration, metrics)
        # The progress tag travels in the same log_batch as the last metrics, so an iteration
        # counts as recorded only once all of its metrics are in (one store transaction when
        # they fit a single batch). The client would put tags in the first batch, so we split.
        *leading_batches, last_batch = list(chunks(metric_list, MAX_METRICS_PER_BATCH - 1)) or [[]]
        check, self._check_partial_record = self._check_partial_record, False
        for batch in leading_batches:
            if not (check and self._recorded(batch, iteration)):
                self.client.log_batch(self.mlflow_run_id, metrics=batch, synchronous=True)
        progress_tag = RunTag(LAST_LOGGED_ITERATION_TAG, str(iteration))
        if check and self._recorded(last_batch, iteration):
            last_batch = []
        self.client.log_batch(self.mlflow_run_id, metrics=last_batch, tags=[progress_tag],
                              synchronous=True)
        return True

    def _recorded(self, batch: list[Metric], iteration: int) -> bool:
        """Whether ``batch`` is already in the run at this step. MLflow's SQL store commits a batch's
        metrics and its tags in separate transactions, so a process killed between the two leaves the
        metrics without the progress tag; logging them again would record the iteration twice. A
        batch's metrics commit together, so its first one tells."""
        return bool(batch) and any(m.step == iteration for m in
                                   self.client.get_metric_history(self.mlflow_run_id, batch[0].key))

    @staticmethod
    def _finite_metrics(iteration: int, metrics: Mapping[str, float]) -> list[Metric]:
        timestamp_ms = int(time.time() * 1000)
        metric_list = []
        for name, value in metrics.items():
            try:
                number = float(value)
            except (TypeError, ValueError):
                logger.warning("metric %r at iteration %d is not a number (%r); skipped",
                               name, iteration, value)
                continue
            if not math.isfinite(number):
                logger.warning("metric %r at iteration %d is %s; skipped", name, iteration, number)
                continue
            metric_list.append(Metric(mlflow_metric_name(str(name)), number, timestamp_ms, iteration))
        return metric_list

    # --- tables --------------------------------------------------------------------------------

    def log_table(self, rows: Sequence[Mapping], artifact_file: str) -> None:
        """Log rows as an MLflow table artifact (readable by ``MlflowClient.load_table``).

        ``MlflowClient.log_table`` appends to an existing artifact, which would duplicate rows on
        a re-record; this writes the same format itself and overwrites instead."""
        import pandas as pd

        if not artifact_file.endswith((".json", ".parquet")):
            raise ValueError(f"table artifact must end in .json or .parquet: {artifact_file!r}")
        frame = pd.DataFrame(list(rows))
        artifact_dir, file_name = posixpath.split(posixpath.normpath(artifact_file))
        with tempfile.TemporaryDirectory() as tmp:
            local_file = os.path.join(tmp, file_name)
            if file_name.endswith(".json"):
                frame.to_json(local_file, orient="split", index=False, date_format="iso")
            else:
                frame.to_parquet(local_file, index=False)
            self.client.log_artifact(self.mlflow_run_id, local_file, artifact_dir or None)
        self._mark_as_table(artifact_file)

    def _mark_as_table(self, artifact_file: str) -> None:
        # load_table and the MLflow UI find tables through this run tag.
        tags = self.client.get_run(self.mlflow_run_id).data.tags
        tables = json.loads(tags.get(MLFLOW_LOGGED_ARTIFACTS, "[]"))
        entry = {"path": artifact_file, "type": "table"}
        if entry not in tables:
            tables.append(entry)
            self.client.set_tag(self.mlflow_run_id, MLFLOW_LOGGED_ARTIFACTS, json.dumps(tables))

    # --- model registry ------------------------------------------------------------------------

    def register_checkpoint(self, model_name: str, source_uri: str, iteration: int, *,
                            tags: Mapping | None = None, view_dir: str | Path | None = None) -> str:
        """Register the checkpoint folder at source_uri (an HF directory that is an MLflow model) as a
        version of model_name, once per (kfrl run, iteration). Returns the version, the existing one
        on a repeated call. ``view_dir``: where a local checkpoint's linked view goes (module docstring)."""
        require_no_quote("model_name", model_name)
        existing = self.find_checkpoint_version(model_name, iteration)
        if existing is not None:
            return existing
        self._ensure_registered_model(model_name)
        store_uri = absolute_local_uri(source_uri) if is_local_uri(source_uri) else source_uri
        version_tags = {str(k): str(v) for k, v in (tags or {}).items()}
        version_tags.update({
            RUN_ID_TAG: self.kfrl_run_id,
            ITERATION_TAG: str(iteration),
            STORE_URI_TAG: store_uri,
        })
        version = self.client.create_model_version(
            model_name,
            self._model_version_source(store_uri, iteration, view_dir),
            run_id=self.mlflow_run_id,
            tags=version_tags,
            await_creation_for=0,  # sources are registered as they are; nothing to wait for
        )
        return str(version.version)

    def registered_iterations(self) -> set[int]:
        """The iterations of this kfrl run with a registered model version (in any registered model)."""
        return registered_iterations(self.client, self.kfrl_run_id)

    def find_checkpoint_version(self, model_name: str, iteration: int) -> str | None:
        """The version registered for this kfrl run's iteration, or None."""
        versions = self.client.search_model_versions(
            f"name='{model_name}' and tag.`{RUN_ID_TAG}`='{self.kfrl_run_id}'"
            f" and tag.`{ITERATION_TAG}`='{iteration}'")
        if not versions:
            return None
        return str(min(int(version.version) for version in versions))

    def _ensure_registered_model(self, model_name: str) -> None:
        try:
            self.client.create_registered_model(model_name)
        except MlflowException as error:
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise

    def _model_version_source(self, store_uri: str, iteration: int, view_dir: str | Path | None) -> str:
        if not is_local_uri(store_uri):
            return store_uri  # a load downloads it into a folder of its own
        if accepts_local_sources(self.tracking_uri):
            if view_dir is None:
                raise ValueError("a local checkpoint is registered through a view (view_dir): a load from "
                                 "MLflow would write into the committed folder")
            return str(linked_view(Path(store_uri.removeprefix("file://")), Path(view_dir)))
        # A server refuses local sources outside the run's artifacts, and its clients could not read
        # them anyway: the checkpoint folder goes into the run's artifacts (a copy: the store is not
        # where this server keeps artifacts), and the version points there.
        artifact_dir = checkpoint_artifact_dir(iteration)
        local = Path(store_uri.removeprefix("file://"))
        if local.is_dir():
            self.client.log_artifacts(self.mlflow_run_id, str(local), artifact_dir)
        else:
            pointer = {STORE_URI_TAG: store_uri, RUN_ID_TAG: self.kfrl_run_id, ITERATION_TAG: iteration}
            self.client.log_dict(self.mlflow_run_id, pointer, f"{artifact_dir}/POINTER.json")
        return f"runs:/{self.mlflow_run_id}/{artifact_dir}"

    def set_alias(self, model_name: str, alias: str, version: str) -> None:
        self.client.set_registered_model_alias(model_name, alias, str(version))
