"""MLflow as the model's home, against the suite's `mlflow server`: runs a person can tell apart
(names, tags, config, datasets), model versions that load with MLflow and transformers, a registered
version as the next run's starting point, the promotion gate CI branches on, and what scripts read."""
from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from typer.testing import CliRunner

from kfrl.cli import app
from kfrl.config import load_config
from kfrl.driver.controller import train
from kfrl.registry import PromotionRefused, promote
from kfrl.run import Run
from kfrl.tracking import Tracker

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]
TINY = ["model.path=builtin:tiny-qwen2-arith", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
        "rollout.n=2", "data.max_response_length=4", "trainer.log_generations=0", "pipeline.runner=inline",
        "data.builtin_train_size=16", "data.val_files=builtin:arith", "data.builtin_val_size=4",
        "trainer.test_freq=1", "trainer.val_before_train=false"]


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def tiny(tmp_path, *extra):
    return load_config(None, TINY + [f"store.uri={tmp_path / 'store'}", *extra])


@pytest.fixture()
def client(mlflow_server):
    return MlflowClient(tracking_uri=mlflow_server, registry_uri=mlflow_server)


def test_runs_are_named_tagged_and_carry_config_and_datasets(tmp_path, mlflow_server, client):
    experiment = unique("exp")
    summary = train(tiny(tmp_path, f"tracking.uri={mlflow_server}", f"trainer.experiment_name={experiment}",
                         f"tracking.experiment_name={experiment}"), run_id="20261203-101010-ab12", iterations=1)
    run = client.get_run(summary.mlflow_run_id)
    assert run.info.run_name == f"{experiment}-ab12"  # veRL names runs by experiment
    tags = run.data.tags
    assert tags["kfrl.runner"] == "inline" and tags["kfrl.version"] and len(tags["kfrl.config_hash"]) == 16
    assert tags["mlflow.user"] and tags["mlflow.source.name"] == "kfrl train"
    assert len(tags["mlflow.source.git.commit"]) == 40  # the suite runs in a checkout
    stored = Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path)))
    assert stored.read_text() == Run.at(summary.run_uri).config_text()
    inputs = {d.dataset.name: d for d in run.inputs.dataset_inputs}
    assert set(inputs) == {"train:builtin:arith", "val:builtin:arith"}
    train_input = inputs["train:builtin:arith"]
    assert json.loads(train_input.dataset.profile)["num_rows"] == 16 and train_input.dataset.digest
    assert {t.key: t.value for t in train_input.tags}["mlflow.data.context"] == "training"
    assert client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    # Resuming logs nothing twice.
    train(tiny(tmp_path, f"tracking.uri={mlflow_server}", f"trainer.experiment_name={experiment}",
               f"tracking.experiment_name={experiment}"), run_id="20261203-101010-ab12", iterations=2)
    assert len(client.get_run(summary.mlflow_run_id).inputs.dataset_inputs) == 2


def test_mlflow_variables_are_honoured_when_no_uri_is_given(tmp_path, mlflow_server, client, monkeypatch):
    monkeypatch.chdir(tmp_path)
    experiment = unique("env-exp")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", experiment)
    summary = train(tiny(tmp_path), run_id="env", iterations=1)
    assert client.get_experiment_by_name(experiment) is not None
    assert client.get_run(summary.mlflow_run_id).info.experiment_id == client.get_experiment_by_name(experiment).experiment_id
    assert not (tmp_path / "kfrl-runs" / "mlflow.db").exists()  # not the embedded default


def test_a_registered_version_loads_with_mlflow_and_transformers_and_starts_the_next_run(tmp_path, mlflow_server,
                                                                                        client):
    import mlflow
    from transformers import AutoModelForCausalLM

    experiment = unique("load")
    summary = train(tiny(tmp_path, f"tracking.uri={mlflow_server}", f"trainer.experiment_name={experiment}"),
                    run_id="first", iterations=2)
    name = summary.registered_model
    version = summary.registered_versions[2]
    registered = client.get_model_version(name, version)
    assert registered.tags["iteration"] == "2" and registered.tags["mlflow_run_id"] == summary.mlflow_run_id
    assert any(key.startswith("val-core/") for key in registered.tags)  # validation metrics of that iteration
    mlflow.set_tracking_uri(mlflow_server)
    try:
        pipeline = mlflow.transformers.load_model(f"models:/{name}/{version}")
        text = pipeline("1 + 2 =", max_new_tokens=3, do_sample=False)[0]["generated_text"]
        assert text.startswith("1 + 2 =")
        assert mlflow.pyfunc.load_model(f"models:/{name}/{version}").metadata.flavors["transformers"]["task"] \
            == "text-generation"
        folder = Path(mlflow.artifacts.download_artifacts(f"models:/{name}/{version}", dst_path=str(tmp_path / "dl")))
    finally:
        mlflow.set_tracking_uri(None)
    model = AutoModelForCausalLM.from_pretrained(folder)  # the same folder is a plain HF directory
    weights = Run.at(summary.run_uri).manifest("update_actor", 2)
    committed = Path(summary.run_uri) / weights.prefix / weights.attempt
    expected = AutoModelForCausalLM.from_pretrained(committed)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), expected.state_dict().values()))

    # A nightly run continues from the champion.
    client.set_registered_model_alias(name, "champion", version)
    nightly = train(tiny(tmp_path / "n", f"tracking.uri={mlflow_server}", f"trainer.experiment_name={experiment}",
                         f"model.path=models:/{name}@champion"), run_id="nightly", iterations=1)
    init = Run.at(nightly.run_uri).manifest("update_actor", 0)
    assert init.info["model_version"] == version and init.info["model_uri"] == f"models:/{name}@champion"
    started = AutoModelForCausalLM.from_pretrained(Path(nightly.run_uri) / init.prefix / init.attempt)
    assert all(torch.equal(a, b) for a, b in zip(started.state_dict().values(), expected.state_dict().values()))


def test_unknown_alias_in_model_path_is_refused_naming_it(tmp_path, mlflow_server):
    result = runner.invoke(app, ["train", "--runner", "inline", "--store", str(tmp_path / "s"), "--tracking-uri",
                                 mlflow_server, "-n", "1", "model.path=models:/no-such-model@champion", *TINY[1:]])
    assert result.exit_code == 2, result.output
    assert "no-such-model" in result.output and "@champion" in result.output


def _version_with(tracker: Tracker, model: str, iteration: int, value: float | None) -> str:
    tags = {} if value is None else {"val-core/arith/reward/mean_at_1": str(value)}
    return tracker.register_checkpoint(model, f"s3://bucket/{model}/iter-{iteration}", iteration, tags=tags)


def test_promotion_moves_the_alias_only_when_the_metric_improves(mlflow_server, client):
    model = unique("policy")
    first, second, third = (Tracker(mlflow_server, "promote", unique(f"run{i}")) for i in range(3))
    v1 = _version_with(first, model, 5, 0.40)
    result = promote(mlflow_server, first.kfrl_run_id)
    assert result.promoted and result.champion is None and result.metric == "val-core/arith/reward/mean_at_1"
    _version_with(second, model, 5, 0.35)
    worse = promote(mlflow_server, second.kfrl_run_id)
    assert not worse.promoted and worse.champion["value"] == 0.40 and worse.candidate["value"] == 0.35
    assert str(client.get_model_version_by_alias(model, "champion").version) == v1
    v3 = _version_with(third, model, 5, 0.45)
    assert not promote(mlflow_server, third.kfrl_run_id, min_delta=0.1).promoted  # better, not by enough
    better = promote(mlflow_server, third.kfrl_run_id)
    assert better.promoted and better.champion["version"] == v1
    assert str(client.get_model_version_by_alias(model, "champion").version) == v3
    again = promote(mlflow_server, third.kfrl_run_id)
    assert not again.promoted and "already holds" in again.reason


def test_promote_command_exit_codes_and_json_line(mlflow_server, client):
    model = unique("policy")
    champion, challenger, silent = (Tracker(mlflow_server, "promote", unique(f"cli{i}")) for i in range(3))
    _version_with(champion, model, 3, 0.5)
    _version_with(challenger, model, 3, 0.25)
    _version_with(silent, model, 3, None)
    base = ["promote", "--tracking-uri", mlflow_server, "--alias", "best"]
    promoted = runner.invoke(app, base + ["--run", champion.kfrl_run_id])
    assert promoted.exit_code == 0, promoted.output
    line = json.loads(promoted.output.strip().splitlines()[-1])
    assert line["promoted"] is True and line["candidate"]["value"] == 0.5 and line["model"] == model
    kept = runner.invoke(app, base + ["--run", challenger.kfrl_run_id])
    assert kept.exit_code == 3, kept.output
    line = json.loads(kept.output.strip().splitlines()[-1])
    assert line["promoted"] is False and line["candidate"]["value"] == 0.25 and line["champion"]["value"] == 0.5
    refused = runner.invoke(app, base + ["--run", silent.kfrl_run_id])
    assert refused.exit_code == 2 and "no validation metric" in refused.output
    unknown = runner.invoke(app, base + ["--run", "never-ran"])
    assert unknown.exit_code == 2 and "registered no model version" in unknown.output
    with pytest.raises(PromotionRefused, match="choose one with --metric"):
        tracker = Tracker(mlflow_server, "promote", unique("two"))
        tracker.register_checkpoint(model, "s3://b/two", 1, tags={"val-core/a/acc/mean_at_1": "1",
                                                                  "val-core/b/acc/mean_at_1": "0"})
        promote(mlflow_server, tracker.kfrl_run_id)


def test_train_json_summary_and_strict_dry_run(tmp_path):
    out = tmp_path / "summary.json"
    args = ["train", "--runner", "inline", "--store", str(tmp_path / "s"), "--tracking-uri",
            f"sqlite:///{tmp_path}/m.db", "--run-id", "j", "-n", "1", "--json", str(out), *TINY[1:],
            "model.path=builtin:tiny-qwen2-arith"]
    result = subprocess.run([sys.executable, "-m", "kfrl.cli", *args], cwd=REPO, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert summary["run_id"] == "j" and summary["final_iteration"] == 1 and summary["iterations"] == [1]
    assert summary["registered_versions"] == {"1": "1"} and summary["mlflow_run_id"]
    assert "critic/score/mean" in summary["final_metrics"]
    # Outside a terminal lines are not wrapped at 80 columns (the iteration line is longer).
    assert any(len(line) > 100 and line.startswith("iter") for line in result.stdout.splitlines()), result.stdout
    warned = runner.invoke(app, ["train", "--dry-run", "--strict", "data.train_files=/no/such.parquet"])
    assert warned.exit_code == 2 and "--strict" in warned.output
    assert runner.invoke(app, ["train", "--dry-run", "data.train_files=/no/such.parquet"]).exit_code == 0
    assert runner.invoke(app, ["train", "--dry-run", "--strict"]).exit_code == 0  # the demo config: no warnings


def test_system_metrics_are_logged_when_asked(tmp_path, mlflow_server, client, monkeypatch):
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "60")  # only the last sample, at the end
    summary = train(tiny(tmp_path, f"tracking.uri={mlflow_server}", "tracking.system_metrics=true"), run_id="sys",
                    iterations=2)
    metrics = client.get_run(summary.mlflow_run_id).data.metrics
    assert any(key.startswith("system/cpu_utilization") for key in metrics), sorted(metrics)
    quiet = train(tiny(tmp_path / "q", f"tracking.uri={mlflow_server}", "tracking.system_metrics=false"),
                  run_id="quiet", iterations=1)
    assert not any(key.startswith("system/") for key in client.get_run(quiet.mlflow_run_id).data.metrics)


def test_a_registered_version_is_a_servable_mlflow_model_and_loading_it_leaves_the_store_as_committed(tmp_path):
    """A local store and the embedded database registry (the demo's set-up): the version's source is a
    view of hard links to the committed folder; MLflow reads its dependencies, serves it, and writes a
    Dockerfile for it; nothing MLflow writes lands in the committed folder."""
    import os
    import urllib.request

    import mlflow

    from conftest import free_port, wait_http
    from kfrl.store import Store

    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    summary = train(tiny(tmp_path, f"tracking.uri={tracking}", "trainer.save_freq=2"), run_id="serve", iterations=2)
    name, version = summary.registered_model, summary.registered_versions[2]
    uri = f"models:/{name}/{version}"
    weights = Run.at(summary.run_uri).manifest("update_actor", 2)
    committed = Path(summary.run_uri) / weights.prefix / weights.attempt
    assert {"MLmodel", "requirements.txt", "python_env.yaml", "conda.yaml"} <= set(weights.names())
    source = MlflowClient(tracking_uri=tracking).get_model_version(name, version).source
    assert Path(source) == Path(summary.run_uri) / "registry" / "iter-000002"
    assert os.path.samefile(Path(source) / "model.safetensors", committed / "model.safetensors")  # no copy

    mlflow.set_tracking_uri(tracking)
    try:
        requirements = Path(mlflow.pyfunc.get_model_dependencies(uri)).read_text().split()
        answer = mlflow.pyfunc.load_model(uri).predict(["1 + 2 ="], params={"max_new_tokens": 3})
    finally:
        mlflow.set_tracking_uri(None)
    pins = {line.split("==")[0]: line for line in requirements}
    assert {"mlflow", "torch", "transformers"} <= set(pins) and all("==" in pin for pin in pins.values())
    assert isinstance(answer[0], str) and not answer[0].startswith("1 + 2 =")  # the answer, not an echo

    port = free_port()
    log = tmp_path / "serve.log"
    # mlflow models serve starts `uvicorn` from PATH: as in an activated venv.
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    with open(log, "w") as fh:
        server = subprocess.Popen([str(Path(sys.executable).with_name("mlflow")), "models", "serve", "-m", uri,
                                   "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)],
                                  stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/ping", 120, server, log)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/invocations", method="POST", headers={"Content-Type": "application/json"},
            data=json.dumps({"inputs": ["1 + 2 =", "3 + 4 ="], "params": {"max_new_tokens": 3}}).encode())
        with urllib.request.urlopen(request, timeout=60) as reply:
            predictions = json.loads(reply.read())["predictions"]
    finally:
        os.killpg(server.pid, 15)
        server.wait(30)
    assert len(predictions) == 2 and all(isinstance(text, str) for text in predictions)

    build = subprocess.run([str(Path(sys.executable).with_name("mlflow")), "models", "generate-dockerfile", "-m", uri,
                            "-d", str(tmp_path / "docker")], capture_output=True, text=True, env=env, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    assert "COPY model_dir /opt/ml/model" in (tmp_path / "docker" / "Dockerfile").read_text()
    packaged = tmp_path / "docker" / "model_dir"
    assert {"MLmodel", "model.safetensors", "requirements.txt", "python_env.yaml"} <= {p.name for p in packaged.iterdir()}

    # Loading, serving and packaging wrote nothing into the committed folder: it holds what it committed.
    on_disk = sorted(p.relative_to(committed).as_posix() for p in committed.rglob("*") if p.is_file())
    assert on_disk == sorted(weights.names())
    Store(summary.run_uri).committed_dir(weights)  # and its digests still match


def test_one_lineage_across_experiment_names_with_registered_model_name(tmp_path):
    """The same model trained under two experiment names: with tracking.registered_model_name both runs'
    versions are versions of one model, and the second run is promoted against the first's champion."""
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    name = unique("gsm8k-policy")
    common = [f"tracking.uri={tracking}", f"tracking.registered_model_name={name}"]
    first = train(tiny(tmp_path / "a", *common, "trainer.experiment_name=spring"), run_id="spring", iterations=1)
    second = train(tiny(tmp_path / "b", *common, "trainer.experiment_name=autumn"), run_id="autumn", iterations=1)
    assert first.registered_model == second.registered_model == name
    client = MlflowClient(tracking_uri=tracking, registry_uri=tracking)
    assert sorted(v.tags["kfrl.run_id"] for v in client.search_model_versions(f"name='{name}'")) == ["autumn", "spring"]
    assert promote(tracking, "spring").promoted
    challenge = promote(tracking, "autumn", min_delta=1.0)  # better by more than 1: never
    assert challenge.model == name and challenge.champion["run_id"] == "spring" and not challenge.promoted


def test_a_run_driven_by_kfp_carries_its_kfp_run_and_each_iterations_run(tmp_path, monkeypatch):
    import kfrl.driver
    from kfrl.driver.local import InlineRunner

    class KfpLike(InlineRunner):  # the stages as inline, the answer as the cluster runner's: a KFP run id
        def run(self, run_uri, iteration, log_path, pipeline="iteration"):
            super().run(run_uri, iteration, log_path, pipeline)
            return f"kfp-iteration-{iteration}"

    monkeypatch.setattr(kfrl.driver, "make_runner", lambda config: KfpLike())
    monkeypatch.setenv("KFRL_KFP_RUN_ID", "rl-train-7")  # as rl_train's driver task sets it
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    summary = train(tiny(tmp_path, f"tracking.uri={tracking}", "pipeline.host=http://ml-pipeline.kubeflow:8888",
                         "pipeline.ui_url=https://kubeflow.example.com/pipeline"), run_id="k", iterations=2)
    tags = MlflowClient(tracking_uri=tracking).get_run(summary.mlflow_run_id).data.tags
    assert tags["kfrl.kfp_run_id"] == "rl-train-7"
    assert tags["kfrl.kfp_run_url"] == "https://kubeflow.example.com/pipeline/#/runs/details/rl-train-7"
    assert [tags.get(f"kfrl.kfp_run.iter-{i:06d}") for i in (1, 2)] == ["kfp-iteration-1", "kfp-iteration-2"]
    assert tags.get("mlflow.source.git.commit")  # this checkout's
