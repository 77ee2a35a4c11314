"""kfrl.tracking against real MLflow backends: the session's `mlflow server` and a sqlite file
used directly (the embedded default)."""
from __future__ import annotations

import json
import logging
import math
import os
import uuid
from pathlib import Path

import boto3
import mlflow
import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from kfrl.tracking import (
    DEFAULT_TRACKING_URI,
    HTTP_RETRY_DEFAULTS,
    Tracker,
    accepts_local_sources,
    configure_http_retries,
    flatten,
    is_server_uri,
)

EXPERIMENT = "kfrl-tests"


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory):
    # One database for the module: creating MLflow's schema costs ~2 s per file.
    return f"sqlite:///{tmp_path_factory.mktemp('embedded')}/mlflow.db"


@pytest.fixture(params=["server", "sqlite"])
def tracking_uri(request):
    return request.getfixturevalue("mlflow_server" if request.param == "server" else "sqlite_uri")


@pytest.fixture()
def kfrl_run_id():
    return unique("run")


@pytest.fixture()
def tracker(tracking_uri, kfrl_run_id):
    return Tracker(tracking_uri, EXPERIMENT, kfrl_run_id)


@pytest.fixture()
def client(tracking_uri):
    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


# --- pure helpers ------------------------------------------------------------------------------

def test_flatten_nests_keys_and_turns_lists_into_json():
    config = {"algo": {"name": "grpo", "kl": {"coef": 0.001}}, "data": {"files": ["a", "b"]},
              "seed": 1, "empty": {}}
    assert flatten(config) == {
        "algo.name": "grpo", "algo.kl.coef": 0.001, "data.files": '["a", "b"]', "seed": 1,
        "empty": {},
    }
    assert flatten({"a": {"b": 1}}, prefix="cfg", sep="/") == {"cfg/a/b": 1}


def test_http_retry_defaults_do_not_override_the_environment(monkeypatch):
    for name in HTTP_RETRY_DEFAULTS:
        # setenv first so that monkeypatch restores the original state afterwards
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "9")
    configure_http_retries()
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "9"
    assert os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"] == HTTP_RETRY_DEFAULTS[
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"]


def test_only_direct_stores_take_local_sources():
    assert accepts_local_sources("sqlite:////tmp/mlflow.db")
    assert accepts_local_sources("postgresql+psycopg2://u@db/mlflow")
    assert not accepts_local_sources("http://127.0.0.1:5000")
    assert not accepts_local_sources("databricks")


# --- runs --------------------------------------------------------------------------------------

def test_run_is_found_again_by_kfrl_run_id(tracker, tracking_uri, kfrl_run_id, client):
    again = Tracker(tracking_uri, EXPERIMENT, kfrl_run_id)
    other = Tracker(tracking_uri, EXPERIMENT, unique("run"))
    assert again.mlflow_run_id == tracker.mlflow_run_id
    assert other.mlflow_run_id != tracker.mlflow_run_id
    assert client.get_run(tracker.mlflow_run_id).data.tags["kfrl.run_id"] == kfrl_run_id


def test_trackers_of_different_uris_do_not_share_state(mlflow_server, sqlite_uri):
    global_uri_before = mlflow.get_tracking_uri()
    run_id = unique("run")
    on_server = Tracker(mlflow_server, EXPERIMENT, run_id)
    embedded = Tracker(sqlite_uri, EXPERIMENT, run_id)
    on_server.log_iteration(0, {"x": 1.0})
    assert embedded.last_logged_iteration() == -1
    assert MlflowClient(sqlite_uri).search_runs(
        [embedded.experiment_id], f"attributes.run_id = '{on_server.mlflow_run_id}'") == []
    assert mlflow.get_tracking_uri() == global_uri_before


def test_finish_then_resume_reopens_the_run(tracker, tracking_uri, kfrl_run_id, client):
    tracker.finish()
    assert client.get_run(tracker.mlflow_run_id).info.status == "FINISHED"
    resumed = Tracker(tracking_uri, EXPERIMENT, kfrl_run_id)
    assert resumed.mlflow_run_id == tracker.mlflow_run_id
    assert client.get_run(resumed.mlflow_run_id).info.status == "RUNNING"
    resumed.finish("FAILED")
    assert client.get_run(resumed.mlflow_run_id).info.status == "FAILED"
    with pytest.raises(ValueError):
        resumed.finish("DONE")


def test_context_manager_marks_a_crash_as_failed(tracking_uri, client):
    with pytest.raises(RuntimeError):
        with Tracker(tracking_uri, EXPERIMENT, unique("run")) as tracker:
            raise RuntimeError("training crashed")
    assert client.get_run(tracker.mlflow_run_id).info.status == "FAILED"


def test_empty_uri_uses_the_embedded_default_beside_the_working_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tracker = Tracker("", EXPERIMENT, unique("run"))
    tracker.log_table([{"a": 1}], "t.json")
    default_db = tmp_path / DEFAULT_TRACKING_URI.removeprefix("sqlite:///")
    assert default_db.is_file()
    # Artifacts go beside the database, not into ./mlruns.
    assert list((default_db.parent / "artifacts").rglob("t.json"))
    assert not (tmp_path / "mlruns").exists()


# --- params, tags, metrics ---------------------------------------------------------------------

def test_params_are_flattened_and_relogging_never_crashes(tracker, client, caplog):
    config = {"algo": {"name": "grpo", "lr": 1e-6}, "data": {"files": ["a", "b"]}}
    tracker.log_params(config)
    tracker.log_params(config)
    with caplog.at_level(logging.WARNING, logger="kfrl.tracking"):
        tracker.log_params({"algo": {"lr": 2e-6}, "new": True})
    params = client.get_run(tracker.mlflow_run_id).data.params
    assert params == {"algo.name": "grpo", "algo.lr": "1e-06", "data.files": '["a", "b"]',
                      "new": "True"}
    assert "algo.lr" in caplog.text


def test_more_than_a_batch_of_params_and_tags(tracker, client):
    tracker.log_params({f"p{i}": i for i in range(250)})
    tracker.set_tags({f"t{i}": i for i in range(150)})
    run = client.get_run(tracker.mlflow_run_id)
    assert len(run.data.params) == 250
    assert run.data.tags["t149"] == "149"


def test_log_iteration_is_idempotent_and_keeps_slashes(tracker, tracking_uri, kfrl_run_id, client):
    assert tracker.log_iteration(0, {"critic/score/mean": 0.5, "actor/pg_loss": -0.1})
    assert tracker.log_iteration(1, {"critic/score/mean": 0.7, "actor/pg_loss": float("nan"),
                                     "perf/throughput": float("inf")})
    # The same iteration again, from this tracker and from a restarted controller.
    assert not tracker.log_iteration(1, {"critic/score/mean": 0.9})
    restarted = Tracker(tracking_uri, EXPERIMENT, kfrl_run_id)
    assert not restarted.log_iteration(0, {"critic/score/mean": 0.9})
    assert restarted.log_iteration(2, {"critic/score/mean": 0.8})

    history = client.get_metric_history(tracker.mlflow_run_id, "critic/score/mean")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.5), (1, 0.7), (2, 0.8)]
    losses = client.get_metric_history(tracker.mlflow_run_id, "actor/pg_loss")
    assert [(m.step, m.value) for m in losses] == [(0, -0.1)]
    assert client.get_metric_history(tracker.mlflow_run_id, "perf/throughput") == []
    assert restarted.last_logged_iteration() == 2


@pytest.mark.parametrize("width", [3, 1500], ids=["one_batch", "two_batches"])
def test_an_iteration_whose_metrics_landed_without_the_progress_tag_is_not_recorded_twice(
        tracker, tracking_uri, kfrl_run_id, client, width):
    """MLflow's SQL store commits a batch's metrics and tags in separate transactions: a controller killed
    between the two leaves iteration 1's metrics without the tag. The restarted one records the rest of
    the iteration (here: the last batch) and the tag, never a metric twice."""
    from mlflow.entities import Metric

    metrics = {f"m/{i:04d}": float(i) for i in range(width)}
    assert tracker.log_iteration(0, metrics)
    landed = [Metric(key, value, 0, 1) for key, value in list(metrics.items())[:999 if width > 999 else width]]
    client.log_batch(tracker.mlflow_run_id, metrics=landed, synchronous=True)  # the kill came before the tag
    restarted = Tracker(tracking_uri, EXPERIMENT, kfrl_run_id)
    assert restarted.last_logged_iteration() == 0
    assert restarted.log_iteration(1, metrics)
    for key in (next(iter(metrics)), list(metrics)[-1]):
        assert sorted(m.step for m in client.get_metric_history(tracker.mlflow_run_id, key)) == [0, 1]
    assert restarted.last_logged_iteration() == 1
    assert restarted.log_iteration(2, metrics)  # later iterations log without looking


def test_an_iteration_wider_than_one_batch(tracker, client):
    assert tracker.log_iteration(0, {f"layer/{i}/grad_norm": float(i) for i in range(1500)})
    run = client.get_run(tracker.mlflow_run_id)
    assert len(run.data.metrics) == 1500
    assert run.data.tags["kfrl.last_logged_iteration"] == "0"


def test_non_finite_metrics_are_skipped_with_a_warning(tracker, client, caplog):
    with caplog.at_level(logging.WARNING, logger="kfrl.tracking"):
        assert tracker.log_iteration(5, {"ok": 1.0, "bad": math.nan})
    assert "'bad'" in caplog.text
    assert set(client.get_run(tracker.mlflow_run_id).data.metrics) == {"ok"}


# --- tables ------------------------------------------------------------------------------------

def test_table_relogged_is_not_duplicated(tracker, client, tracking_uri, tmp_path, monkeypatch):
    rows = [{"prompt": "1+1=", "response": "2", "score": 1.0},
            {"prompt": "2+2=", "response": "5", "score": 0.0}]
    artifact = "generations/iter-000003.json"
    tracker.log_table(rows, artifact)
    tracker.log_table(rows, artifact)

    downloaded = client.download_artifacts(tracker.mlflow_run_id, artifact, str(tmp_path))
    with open(downloaded) as fh:
        table = json.load(fh)
    assert table["columns"] == ["prompt", "response", "score"]
    assert table["data"] == [["1+1=", "2", 1.0], ["2+2=", "5", 0.0]]
    logged = json.loads(client.get_run(tracker.mlflow_run_id).data.tags["mlflow.loggedArtifacts"])
    assert logged == [{"path": artifact, "type": "table"}]

    # MlflowClient.load_table searches runs through the global tracking URI.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    frame = client.load_table(tracker.experiment_id, artifact, run_ids=[tracker.mlflow_run_id])
    # (pandas' JSON reader re-infers dtypes, so compare the text column only)
    assert list(frame["prompt"]) == ["1+1=", "2+2="]


# --- model registry ----------------------------------------------------------------------------

def versions_for_iteration(client, model_name, iteration):
    return client.search_model_versions(f"name='{model_name}' and tag.iteration='{iteration}'")


def test_register_s3_checkpoint_once(tracker, tracking_uri, kfrl_run_id, client, s3_bucket):
    boto3.client("s3").put_object(Bucket=s3_bucket, Key="ckpt/iter-3/model.safetensors", Body=b"w")
    source = f"s3://{s3_bucket}/ckpt/iter-3"
    model = unique("policy")

    version = tracker.register_checkpoint(model, source, 3, tags={"reward": 0.5})
    assert tracker.register_checkpoint(model, source, 3) == version
    restarted = Tracker(tracking_uri, EXPERIMENT, kfrl_run_id)
    assert restarted.register_checkpoint(model, source, 3) == version

    # sqlite returns versions as int, the server as str
    assert [str(v.version) for v in versions_for_iteration(client, model, 3)] == [version]
    registered = client.get_model_version(model, version)
    assert registered.source == source
    assert registered.run_id == tracker.mlflow_run_id
    assert registered.tags == {"kfrl.run_id": kfrl_run_id, "iteration": "3",
                               "kfrl.store_uri": source, "reward": "0.5"}
    assert tracker.register_checkpoint(model, f"s3://{s3_bucket}/ckpt/iter-4", 4) != version


def test_register_local_checkpoint(tracker, tracking_uri, client, tmp_path, monkeypatch):
    checkpoint = tmp_path / "store" / "ckpt" / "iter-7"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.safetensors").write_bytes(b"w")
    model = unique("policy")

    view = tmp_path / "store" / "registry" / "iter-000007"
    version = tracker.register_checkpoint(model, str(checkpoint), 7, view_dir=view)
    assert tracker.register_checkpoint(model, str(checkpoint), 7, view_dir=view) == version
    assert len(versions_for_iteration(client, model, 7)) == 1
    registered = client.get_model_version(model, version)
    assert registered.tags["kfrl.store_uri"] == str(checkpoint)
    assert registered.tags["iteration"] == "7"

    if is_server_uri(tracking_uri):
        # The server refuses a local source (and its clients could not read it): the checkpoint folder
        # goes into the run's artifacts and the version points there.
        with pytest.raises(MlflowException, match="local path"):
            client.create_model_version(model, str(checkpoint), run_id=tracker.mlflow_run_id)
        assert registered.source == f"runs:/{tracker.mlflow_run_id}/checkpoints/iter-000007"
        copy = client.download_artifacts(
            tracker.mlflow_run_id, "checkpoints/iter-000007/model.safetensors", str(tmp_path))
        with open(copy, "rb") as fh:
            assert fh.read() == b"w"
    else:
        # The source is a view of hard links (the same data, no copy) outside the committed folder: what a
        # load writes into a local source (MLflow's registered_model_meta) lands in the view.
        assert registered.source == str(view)
        assert os.path.samefile(view / "model.safetensors", checkpoint / "model.safetensors")
        from mlflow.store.artifact.models_artifact_repo import ModelsArtifactRepository

        (view / "MLmodel").write_text("flavors: {}\n")  # a folder MLflow treats as a model
        (checkpoint / "MLmodel").write_text("flavors: {}\n")
        # The registry a models:/ URI resolves against; through the environment, which monkeypatch
        # restores (mlflow.set_registry_uri would leave MLFLOW_REGISTRY_URI set for every later test).
        monkeypatch.setenv("MLFLOW_REGISTRY_URI", tracking_uri)
        loaded = ModelsArtifactRepository(f"models:/{model}/{version}").download_artifacts("")
        assert Path(loaded) == view and (view / "registered_model_meta").is_file()
        assert sorted(p.name for p in checkpoint.iterdir()) == ["MLmodel", "model.safetensors"]


def test_a_local_checkpoint_without_a_view_is_not_registered_in_a_database(sqlite_uri, kfrl_run_id, tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    with pytest.raises(ValueError, match="view"):
        Tracker(sqlite_uri, EXPERIMENT, kfrl_run_id).register_checkpoint(unique("policy"), str(checkpoint), 1)


def test_a_linked_view_is_complete_or_absent(tmp_path, monkeypatch):
    from kfrl.tracking import linked_view

    folder = tmp_path / "committed"
    (folder / "components" / "tokenizer").mkdir(parents=True)
    (folder / "MLmodel").write_text("m")
    (folder / "components" / "tokenizer" / "tokenizer.json").write_text("t")
    calls = []

    def failing_link(source, target):
        calls.append(source)
        if len(calls) == 2:
            raise KeyboardInterrupt  # a kill while the view is built
        os_link(source, target)

    os_link = os.link
    monkeypatch.setattr(os, "link", failing_link)
    with pytest.raises(KeyboardInterrupt):
        linked_view(folder, tmp_path / "view")
    assert not (tmp_path / "view").exists()
    monkeypatch.setattr(os, "link", os_link)
    view = linked_view(folder, tmp_path / "view")
    assert (view / "components" / "tokenizer" / "tokenizer.json").read_text() == "t"
    assert not (tmp_path / "view.partial").exists()


def test_alias_points_at_the_version(tracker, client):
    model = unique("policy")
    first = tracker.register_checkpoint(model, "s3://bucket/ckpt/iter-1", 1)
    second = tracker.register_checkpoint(model, "s3://bucket/ckpt/iter-2", 2)
    tracker.set_alias(model, "champion", first)
    tracker.set_alias(model, "champion", second)
    assert str(client.get_model_version_by_alias(model, "champion").version) == second
