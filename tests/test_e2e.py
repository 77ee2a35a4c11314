"""End to end: `kfrl train` through KFP's local runner against a real S3 server (moto) and a real
MLflow server, plus an interrupted run that resumes from LATEST."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
from mlflow.tracking import MlflowClient

from kfrl.config import load_config
from kfrl.driver.controller import train
from kfrl.run import Run
from kfrl.store import Store

pytestmark = pytest.mark.slow

SMALL = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "rollout.n=4", "data.max_response_length=12",
         "actor.ppo_micro_batch_size_per_gpu=8", "trainer.log_generations=4"]
REQUIRED_METRICS = ["critic/score/mean", "critic/rewards/mean", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl",
                    "actor/entropy", "actor/grad_norm", "response_length/mean", "timing_s/gen", "timing_s/reward",
                    "timing_s/old_log_prob", "timing_s/adv", "timing_s/update_actor", "timing_s/step",
                    "perf/throughput", "critic/advantages/mean"]


def _objects(bucket: str, prefix: str) -> dict[str, bytes]:
    s3 = boto3.client("s3")
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            out[obj["Key"][len(prefix):]] = s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
    return out


def test_two_iterations_through_kfp_local_s3_and_mlflow(s3_bucket, mlflow_server, tmp_path):
    import xxhash

    from kfrl.store import digest_matches

    cfg = load_config(Path("configs/demo.yaml"), SMALL + [
        f"store.uri=s3://{s3_bucket}/runs", f"tracking.uri={mlflow_server}", "pipeline.runner=local",
        f"pipeline.pipeline_root={tmp_path / 'kfp'}", "pipeline.fuse=none", "trainer.total_iterations=2",
        "trainer.save_freq=1",
        "trainer.experiment_name=e2e"])
    summary = train(cfg, run_id="e2e-run")
    assert sorted(summary.iterations) == [1, 2]

    objects = _objects(s3_bucket, "runs/e2e/e2e-run/")
    assert objects["LATEST"].decode().strip() == "2"
    assert b"adv_estimator: grpo" in objects["config.yaml"]
    for it in (1, 2):
        for stage in ("rollout", "score", "old_logprob", "ref_logprob", "advantage", "update_actor"):
            manifest = json.loads(objects[f"iter-{it:06d}/{stage}/_COMMITTED"])
            for f in manifest["files"]:
                data = objects[f"iter-{it:06d}/{stage}/{manifest['attempt']}/{f['name']}"]
                assert digest_matches(f, data) and xxhash.xxh3_128(data).hexdigest() == f["xxh3_128"]
        ref = json.loads(objects[f"iter-{it:06d}/ref_logprob/_COMMITTED"])
        assert ref["info"]["skipped"] and not ref["files"]  # no KL term → no reference pass
    ckpt = json.loads(objects["iter-000002/update_actor/_COMMITTED"])
    names = {f["name"] for f in ckpt["files"]}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names  # the weights: what a rollout loads
    assert not names & {"optimizer.pt", "trainer_state.json"}
    state = json.loads(objects["iter-000002/actor_state/_COMMITTED"])  # the trainer state, its own commit
    assert state["info"]["weights_attempt"] == ckpt["attempt"]
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= {f["name"] for f in state["files"]}

    client = MlflowClient(tracking_uri=mlflow_server)
    runs = client.search_runs(
        [client.get_experiment_by_name(cfg.tracking_experiment).experiment_id],
        "tags.`kfrl.run_id` = 'e2e-run'")
    assert len(runs) == 1
    run = runs[0]
    assert run.data.params["actor.clip_ratio"] == "0.2"
    for key in REQUIRED_METRICS:
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [1, 2], key
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "generations")}
    assert "generations/iter-000001.json" in artifacts

    versions = client.search_model_versions(f"name='{cfg.registered_model_name}'")
    by_iteration = {v.tags["iteration"]: v for v in versions}
    assert sorted(by_iteration) == ["1", "2"]
    # The version points into the store (no copy): the committed folder, an MLflow model itself.
    assert by_iteration["2"].source == f"s3://{s3_bucket}/runs/e2e/e2e-run/iter-000002/update_actor/{ckpt['attempt']}"
    assert by_iteration["2"].tags["kfrl.run_id"] == "e2e-run"
    assert f"iter-000002/update_actor/{ckpt['attempt']}/MLmodel" in objects
    import mlflow

    mlflow.set_tracking_uri(mlflow_server)
    try:
        components = mlflow.transformers.load_model(f"models:/{cfg.registered_model_name}/{by_iteration['2'].version}",
                                                    return_type="components")
    finally:
        mlflow.set_tracking_uri(None)
    assert {"model", "tokenizer"} <= set(components)

    # Running the finished run again redoes nothing and records nothing twice.
    attempts_before = {k for k in objects if "/attempt-" in k}
    train(cfg, run_id="e2e-run")
    attempts_after = {k for k in _objects(s3_bucket, "runs/e2e/e2e-run/") if "/attempt-" in k}
    assert attempts_after == attempts_before
    assert len(client.search_model_versions(f"name='{cfg.registered_model_name}'")) == 2
    assert len(client.get_metric_history(run.info.run_id, "critic/score/mean")) == 2


def test_interrupted_run_resumes_from_latest(tmp_path):
    store_dir, db = tmp_path / "store", tmp_path / "mlflow.db"
    args = [sys.executable, "-m", "kfrl.cli", "train", "--config", "configs/demo.yaml", "--store", str(store_dir),
            "--tracking-uri", f"sqlite:///{db}", "--run-id", "r1", "-n", "3", *SMALL,
            f"pipeline.pipeline_root={tmp_path / 'kfp'}"]  # KFP local runner, fused
    args.append("pipeline.fuse=weights")
    run_dir = Store(str(store_dir / "demo" / "r1"))
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    # Kill it hard once iteration 2 has started (its rollout committed): a pod killed mid-iteration.
    while not run_dir.is_committed("iter-000002/rollout"):
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert Run(run_dir).latest() == 1
    first = {stage: run_dir.manifest(f"iter-000001/{stage}").attempt for stage in ("rollout", "update_actor")}
    rollout2 = run_dir.manifest("iter-000002/rollout").attempt

    result = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resuming after iteration 1" in result.stdout
    assert Run(run_dir).latest() == 3
    # Iteration 1 was not redone, and iteration 2's committed rollout was kept.
    assert {s: run_dir.manifest(f"iter-000001/{s}").attempt for s in first} == first
    assert run_dir.manifest("iter-000002/rollout").attempt == rollout2
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    run = client.search_runs([client.get_experiment_by_name("kfrl").experiment_id], "tags.`kfrl.run_id` = 'r1'")[0]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "critic/score/mean")] == [1, 2, 3]
