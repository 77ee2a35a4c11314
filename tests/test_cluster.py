"""On a cluster: pipelines compiled from a GPU config ask for what their tasks need (and only those
that need it), every parameter the KFP UI shows is typed, defaulted and described, `kfrl submit` and
`kfrl schedule` send the requests a KFP API expects (checked against a fake one), and the training
pipeline (rl_train) drives a whole run through KFP's local runner as `kfrl train` does."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

from kfrl.cli import app
from kfrl.config import load_config
from kfrl.pipelines.compile import COMPILED_DIR, compile_pipelines
from kfrl.run import Run
from kfrl.stages import STAGES

runner = CliRunner()
GPU_CONFIG = Path("configs/gsm8k_grpo_qwen05b.yaml")


def compiled(folder: Path, name: str) -> tuple[dict, dict]:
    """(pipeline spec, kubernetes platform spec) of a compiled YAML."""
    docs = list(yaml.safe_load_all((folder / f"{name}.yaml").read_text()))
    platform = next((d for d in docs if "platforms" in d), {"platforms": {"kubernetes": {"deploymentSpec": {}}}})
    return docs[0], platform["platforms"]["kubernetes"]["deploymentSpec"].get("executors", {})


def test_a_gpu_config_compiles_gpu_tasks_with_accelerators_tolerations_secret_and_shm(tmp_path):
    config = load_config(GPU_CONFIG, [])
    compile_pipelines(tmp_path, config)
    spec, kube = compiled(tmp_path, "rl_iteration")
    executors = spec["deploymentSpec"]["executors"]
    # GRPO with a KL loss and four mini-batches: no critic (values, update_critic) and no greedy baseline
    # (gen_max), so those stages have no task at all (the driver records their skips).
    gpu_ops = {f"exec-{stage.replace('_', '-')}-op" for stage in
               ("rollout", "old_logprob", "ref_logprob", "update_actor", "validate")}
    cpu_ops = {"exec-score-op", "exec-advantage-op"}
    assert gpu_ops | cpu_ops == set(executors)
    for name in gpu_ops:
        container = executors[name]["container"]
        assert container["image"] == "ghcr.io/kfrl/kfrl-gpu:0.1.0"
        assert container["resources"]["accelerator"]["resourceType"] == "nvidia.com/gpu"
        assert container["resources"]["accelerator"]["resourceCount"] == "1"
        assert container["resources"]["resourceMemoryLimit"] == "64G"
        assert kube[name]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert kube[name]["emptyDirMounts"] == [{"medium": "Memory", "mountPath": "/dev/shm", "sizeLimit": "16Gi",
                                                 "volumeName": "dshm"}]
    for name in cpu_ops:
        container = executors[name]["container"]
        assert container["image"] == "ghcr.io/kfrl/kfrl-cpu:0.1.0"
        assert "accelerator" not in container["resources"]
        assert "tolerations" not in kube[name] and "emptyDirMounts" not in kube[name]
    for name in gpu_ops | cpu_ops:  # every task reads the store and MLflow with the secret's credentials
        (secret,) = kube[name]["secretAsEnv"]
        assert secret["secretName"] == "kfrl-credentials" and secret["optional"] is True
        assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_URI"} <= \
            {entry["envVar"] for entry in secret["keyToEnv"]}
    train_spec, train_kube = compiled(tmp_path, "rl_train")
    driver = train_spec["deploymentSpec"]["executors"]["exec-train-driver-op"]["container"]
    assert driver["image"] == "ghcr.io/kfrl/kfrl-cpu:0.1.0" and "accelerator" not in driver["resources"]
    assert train_kube["exec-train-driver-op"]["secretAsEnv"][0]["secretName"] == "kfrl-credentials"
    # Without a cluster config the committed pipelines ask for nothing (the local runner runs them).
    plain, plain_kube = compiled(COMPILED_DIR, "rl_iteration")
    assert not plain_kube and all("resources" not in e["container"] for e in plain["deploymentSpec"]["executors"].values())


def test_a_reward_model_makes_scoring_a_gpu_task(tmp_path):
    config = load_config(GPU_CONFIG, ["reward.name=model", "reward.model_path=/models/rm"])
    compile_pipelines(tmp_path, config)
    spec, _ = compiled(tmp_path, "rl_iteration")
    assert "accelerator" in spec["deploymentSpec"]["executors"]["exec-score-op"]["container"]["resources"]


def dependencies(spec: dict) -> dict[str, set[str]]:
    """Task -> the tasks it runs after, in a compiled pipeline."""
    return {name: set(task.get("dependentTasks", [])) for name, task in spec["root"]["dag"]["tasks"].items()}


def test_stages_the_run_always_skips_have_no_task_and_the_dag_closes_over_them(tmp_path):
    config = load_config(GPU_CONFIG, ["actor.use_kl_loss=false", "actor.ppo_mini_batch_size=128",
                                      "cluster.image_pull_secrets=[regcred, mirror]"])
    compile_pipelines(tmp_path, config)
    spec, kube = compiled(tmp_path, "rl_iteration")
    assert dependencies(spec) == {"rollout-op": set(), "score-op": {"rollout-op"}, "advantage-op": {"score-op"},
                                  "update-actor-op": {"advantage-op"}, "validate-op": {"update-actor-op"}}
    for executor in kube.values():  # every pod pulls its image with the registry's secrets
        assert [secret["secretName"] for secret in executor["imagePullSecret"]] == ["regcred", "mirror"]
    # The fused pipelines run skips inside their tasks; without a run's config every stage has a task.
    fused, _ = compiled(tmp_path, "rl_iteration_fused")
    assert set(dependencies(fused)) == {"infer-op", "train-op"}
    plain, _ = compiled(COMPILED_DIR, "rl_iteration")
    assert len(dependencies(plain)) == len(STAGES)


def accelerators(folder: Path, name: str) -> dict[str, int]:
    """Executor -> accelerator limit (0: none) of a compiled pipeline."""
    spec, _ = compiled(folder, name)
    return {executor: int(body["container"].get("resources", {}).get("accelerator", {}).get("resourceCount", 0))
            for executor, body in spec["deploymentSpec"]["executors"].items()}


def test_gpu_tasks_ask_for_one_accelerator_per_process(tmp_path):
    compile_pipelines(tmp_path, load_config(GPU_CONFIG, ["trainer.n_gpus_per_node=4", "algorithm.adv_estimator=remax",
                                                         "critic.enable=true"]))
    counts = accelerators(tmp_path, "rl_iteration")
    for stage in ("rollout", "gen_max", "old_logprob", "ref_logprob", "values", "update_critic", "update_actor",
                  "validate"):
        assert counts[f"exec-{stage.replace('_', '-')}-op"] == 4, stage
    assert counts["exec-score-op"] == counts["exec-advantage-op"] == 0
    assert set(accelerators(tmp_path, "rl_iteration_fused").values()) == {4}
    assert accelerators(tmp_path, "rl_iteration_single") == {"exec-iteration-op": 4}
    # cluster.gpu_stages.gpus = 0 (the default) with trainer.device auto: n_gpus_per_node (1); more may be asked.
    compile_pipelines(tmp_path, load_config(None, []))
    assert accelerators(tmp_path, "rl_iteration")["exec-rollout-op"] == 1
    compile_pipelines(tmp_path, load_config(GPU_CONFIG, ["cluster.gpu_stages.gpus=8", "trainer.n_gpus_per_node=4"]))
    assert accelerators(tmp_path, "rl_iteration")["exec-update-actor-op"] == 8
    # trainer.device=cpu: processes on CPUs, no accelerator unless gpu_stages.gpus asks.
    compile_pipelines(tmp_path, load_config(GPU_CONFIG, ["trainer.device=cpu", "cluster.gpu_stages.gpus=0"]))
    assert set(accelerators(tmp_path, "rl_iteration").values()) == {0}


def test_multi_node_update_tasks_only_submit_the_job_on_the_cpu_image(tmp_path):
    compile_pipelines(tmp_path, load_config(GPU_CONFIG, ["trainer.nnodes=2", "trainer.n_gpus_per_node=4",
                                                         "algorithm.adv_estimator=gae"]))
    spec, kube = compiled(tmp_path, "rl_iteration")
    executors = spec["deploymentSpec"]["executors"]
    for name in ("exec-update-actor-op", "exec-update-critic-op"):
        container = executors[name]["container"]
        assert container["image"] == "ghcr.io/kfrl/kfrl-cpu:0.1.0" and "accelerator" not in container["resources"]
        assert container["resources"]["resourceMemoryLimit"] == "8G"  # cluster.cpu_stages
        assert "tolerations" not in kube[name] and "emptyDirMounts" not in kube[name]
        assert kube[name]["secretAsEnv"][0]["secretName"] == "kfrl-credentials"  # the job's pods read the store
    assert accelerators(tmp_path, "rl_iteration")["exec-rollout-op"] == 4
    fused = accelerators(tmp_path, "rl_iteration_fused")
    assert fused == {"exec-infer-op": 4, "exec-train-op": 0}
    assert accelerators(tmp_path, "rl_iteration_single") == {"exec-iteration-op": 4}  # it also rolls out


@pytest.mark.parametrize("name", ["rl_iteration", "rl_iteration_fused", "rl_iteration_single", "rl_validate",
                                  "rl_train"])
def test_every_pipeline_parameter_has_a_type_a_default_and_a_description(name):
    spec, _ = compiled(COMPILED_DIR, name)
    parameters = spec["root"]["inputDefinitions"]["parameters"]
    assert parameters
    for key, parameter in parameters.items():
        assert parameter["parameterType"] in ("STRING", "NUMBER_INTEGER"), key
        assert "defaultValue" in parameter and parameter["isOptional"], key
        assert len(parameter.get("description", "")) > 20, key
    assert spec["pipelineInfo"]["description"]


def test_compile_command_takes_a_config_and_an_image(tmp_path):
    result = runner.invoke(app, ["compile", "--config", str(GPU_CONFIG), "--image", "registry.example/kfrl-gpu:9",
                                 "--output", str(tmp_path)])
    assert result.exit_code == 0, result.output
    spec, _ = compiled(tmp_path, "rl_iteration")
    assert spec["deploymentSpec"]["executors"]["exec-rollout-op"]["container"]["image"] == "registry.example/kfrl-gpu:9"


class FakeKfp:
    """Just enough of KFP's v2beta1 REST API to take a run or recurring runs (create, list, delete);
    records every request."""

    def __init__(self):
        self.requests: list[dict] = []
        self.recurring: dict[str, dict] = {}  # id -> the recurring run as created
        self.run_states = ["PENDING", "RUNNING", "SUCCEEDED"]  # what GET /runs/<id> answers, in turn
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, method):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                fake.requests.append({"method": method, "path": self.path, "body": body,
                                      "authorization": self.headers.get("Authorization")})
                path = self.path.split("?")[0]
                if path.endswith("/experiments"):
                    answer = {"experiments": []} if method == "GET" else {"experiment_id": "exp-1", **(body or {})}
                elif path.endswith("/recurringruns") and method == "POST":
                    answer = {**body, "recurring_run_id": f"rr-{len(fake.requests)}",
                              "created_at": "2026-12-04T02:00:00Z", "status": "ENABLED"}
                    fake.recurring[answer["recurring_run_id"]] = answer
                elif path.endswith("/recurringruns"):  # GET: one page, all of them
                    answer = {"recurringRuns": list(fake.recurring.values()), "totalSize": len(fake.recurring)}
                elif "/recurringruns/" in path and method == "DELETE":
                    fake.recurring.pop(path.rsplit("/", 1)[1])
                    answer = {}
                elif path.endswith("/runs"):
                    answer = {**body, "run_id": "run-1"}
                elif "/runs/" in path and method == "GET":
                    state = fake.run_states.pop(0) if len(fake.run_states) > 1 else fake.run_states[0]
                    answer = {"run_id": path.rsplit("/", 1)[1], "state": state}
                else:
                    answer = {}
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer("GET")

            def do_POST(self):
                self._answer("POST")

            def do_DELETE(self):
                self._answer("DELETE")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def posted(self, suffix: str) -> dict:
        (request,) = [r for r in self.requests if r["method"] == "POST" and r["path"].split("?")[0].endswith(suffix)]
        return request

    def deleted(self) -> list[str]:
        return [r["path"].rsplit("/", 1)[1] for r in self.requests if r["method"] == "DELETE"]


@pytest.fixture()
def fake_kfp(monkeypatch):
    fake = FakeKfp()
    monkeypatch.setenv("KF_PIPELINES_TOKEN", "t0ken")
    yield fake
    fake.server.shutdown()


def sent_config(uri: str) -> dict:
    """The config a run parameter points at, read back from the store."""
    import posixpath

    from kfrl.store import Store

    folder, name = posixpath.split(uri)
    return yaml.safe_load(Store(folder).read_text(name))


def test_schedule_creates_a_nightly_recurring_run_of_the_training_pipeline(fake_kfp, s3_bucket):
    result = runner.invoke(app, ["schedule", "--cron", "0 2 * * *", "--config", str(GPU_CONFIG), "--host",
                                 fake_kfp.url, "--namespace", "team-a", "--promote-alias", "champion", "-n", "50",
                                 "--store", f"s3://{s3_bucket}/runs", "model.path=models:/kfrl-gsm8k-policy@champion"])
    assert result.exit_code == 0, result.output
    (recurring_run_id,) = fake_kfp.recurring
    assert f"scheduled recurring run {recurring_run_id}" in result.output
    assert fake_kfp.posted("/experiments")["body"] == {"display_name": "kfrl-gsm8k", "namespace": "team-a"}
    request = fake_kfp.posted("/recurringruns")
    body = request["body"]
    assert request["authorization"] == "Bearer t0ken"  # multi-user KFP: the token travels
    assert body["trigger"] == {"cron_schedule": {"cron": "0 0 2 * * *"}}  # KFP's cron has seconds first
    assert str(body["max_concurrency"]) == "1" and body["no_catchup"] is True and body["mode"] == "ENABLE"
    assert body["experiment_id"] == "exp-1" and body["display_name"] == "grpo-qwen2.5-0.5b-nightly"
    spec = body["pipeline_spec"]["pipeline_spec"]
    assert spec["pipelineInfo"]["name"] == "kfrl-rl-train"
    driver = spec["deploymentSpec"]["executors"]["exec-train-driver-op"]["container"]
    assert driver["image"] == "ghcr.io/kfrl/kfrl-cpu:0.1.0"  # compiled for the cluster from the config
    params = body["runtime_config"]["parameters"]
    assert params["promote_alias"] == "champion" and params["iterations"] == 50 and params["runner"] == "kfp"
    # The config travels as a one-line URI of a YAML object in the store (the KFP UI's form shows it).
    assert params["config_uri"].startswith(f"s3://{s3_bucket}/runs/configs/grpo-qwen2.5-0.5b-")
    sent = sent_config(params["config_uri"])
    assert sent["model"]["path"] == "models:/kfrl-gsm8k-policy@champion"  # each night starts from the champion
    assert sent["trainer"]["experiment_name"] == "grpo-qwen2.5-0.5b"


def test_submit_starts_one_training_run(fake_kfp, s3_bucket):
    common = ["submit", "--config", str(GPU_CONFIG), "--host", fake_kfp.url, "--store", f"s3://{s3_bucket}/runs"]
    result = runner.invoke(app, [*common, "--run-id", "resume-me", "--tracking-uri", "http://alice:hunter22@mlflow:5000"])
    assert result.exit_code == 0, result.output
    assert "run-1" in result.output
    body = fake_kfp.posted("/runs")["body"]
    params = body["runtime_config"]["parameters"]
    assert params["run_id"] == "resume-me"
    sent = sent_config(params["config_uri"])
    assert sent["store"]["uri"] == f"s3://{s3_bucket}/runs" and sent["tracking"]["uri"] == "http://***@mlflow:5000"
    assert "hunter22" not in json.dumps(body)
    spec = body["pipeline_spec"].get("pipeline_spec", body["pipeline_spec"])
    assert spec["pipelineInfo"]["name"] == "kfrl-rl-train"
    # The same config again: the same object in the store.
    again = runner.invoke(app, [*common, "--tracking-uri", "http://alice:hunter22@mlflow:5000"])
    assert again.exit_code == 0
    assert [r for r in fake_kfp.requests if r["method"] == "POST" and r["path"].endswith("/runs")][-1][
        "body"]["runtime_config"]["parameters"]["config_uri"] == params["config_uri"]


@pytest.mark.parametrize("states, promoted, status", [
    (["PENDING", "RUNNING", "SUCCEEDED"], True, 0), (["RUNNING", "SUCCEEDED"], False, 3),
    (["RUNNING", "FAILED"], None, 1)])
def test_submit_wait_follows_the_run_and_exits_as_kfrl_train_does(fake_kfp, s3_bucket, tmp_path, states,
                                                                   promoted, status):
    from kfrl.driver.kfp_entry import SUMMARY_FILE, driver_run_id
    from kfrl.store import Store

    fake_kfp.run_states = list(states)
    store = f"s3://{s3_bucket}/runs"
    if promoted is not None:  # what the driver leaves in the run's folder at its end
        Store(store).write_text(f"grpo-qwen2.5-0.5b/{driver_run_id('run-1')}/{SUMMARY_FILE}", json.dumps(
            {"final_metrics": {"critic/score/mean": 0.5}, "promotion": {"promoted": promoted, "reason": "better"
                                                                         if promoted else "0.41 <= 0.43"}}))
    result = runner.invoke(app, ["submit", "--config", str(GPU_CONFIG), "--host", fake_kfp.url, "--store", store,
                                 "--promote-alias", "champion", "--wait", "--poll-seconds", "0.01",
                                 "--json", str(tmp_path / "summary.json")])
    assert result.exit_code == status, result.output
    shown = [line.split(": ")[-1] for line in result.output.splitlines() if "KFP run run-1:" in line]
    assert shown == states  # each state once, as it changed
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["kfp_run_id"] == "run-1" and summary["state"] == states[-1]
    assert summary["run_id"] == driver_run_id("run-1")
    if status == 3:
        assert "not promoted: @champion stays (0.41 <= 0.43)" in result.output
    if status == 0:
        assert summary["final_metrics"] == {"critic/score/mean": 0.5} and "@champion moved" in result.output


def test_submit_refuses_what_the_cluster_cannot_run_before_anything_is_sent(fake_kfp, tmp_path):
    result = runner.invoke(app, ["submit", "--config", "configs/demo.yaml", "--host", fake_kfp.url,
                                 "--store", str(tmp_path / "store")])
    assert result.exit_code == 2
    assert "cannot see" in result.output and "builtin demo model" in result.output
    assert not fake_kfp.requests and not (tmp_path / "store").exists()
    # kfrl train --runner kfp: the same refusal before anything is written; --dry-run warns.
    refused = runner.invoke(app, ["train", "--config", "configs/demo.yaml", "--runner", "kfp", "--store",
                                  str(tmp_path / "store"), "pipeline.host=http://127.0.0.1:9"])
    assert refused.exit_code == 2 and "cannot see" in refused.output and not (tmp_path / "store").exists()
    dry = runner.invoke(app, ["train", "--config", "configs/demo.yaml", "--runner", "kfp", "--dry-run", "--strict"])
    assert dry.exit_code == 2 and "pipeline.runner=kfp: store.uri" in dry.output


def test_the_driver_reads_the_config_from_its_uri_and_names_a_missing_one(tmp_path):
    from kfrl.driver.kfp_entry import read_config_text

    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "a.yaml").write_text("trainer:\n  experiment_name: x\n")
    assert read_config_text(str(tmp_path / "configs" / "a.yaml")) == "trainer:\n  experiment_name: x\n"
    with pytest.raises(FileNotFoundError, match="no such config in the store"):
        read_config_text(str(tmp_path / "configs" / "b.yaml"))


def test_scheduling_the_same_name_again_replaces_the_recurring_run_and_list_and_delete_work(fake_kfp, s3_bucket):
    common = ["--config", str(GPU_CONFIG), "--host", fake_kfp.url, "--store", f"s3://{s3_bucket}/runs"]
    first = runner.invoke(app, ["schedule", "--cron", "0 2 * * *", *common])
    assert first.exit_code == 0, first.output
    (old_id,) = fake_kfp.recurring
    again = runner.invoke(app, ["schedule", "--cron", "30 3 * * *", *common, "-n", "40"])
    assert again.exit_code == 0, again.output
    (new_id,) = fake_kfp.recurring  # one nightly run, not two
    assert new_id != old_id and fake_kfp.deleted() == [old_id] and f"replaced {old_id}" in again.output
    assert fake_kfp.recurring[new_id]["trigger"] == {"cron_schedule": {"cron": "0 30 3 * * *"}}
    other = runner.invoke(app, ["schedule", "--cron", "0 4 * * 0", "--name", "weekly", *common])
    assert other.exit_code == 0 and len(fake_kfp.recurring) == 2  # another name is another schedule
    listed = runner.invoke(app, ["schedule", "--list", *common])
    assert listed.exit_code == 0, listed.output
    lines = [line.split() for line in listed.output.strip().splitlines()]
    assert lines[0][:3] == ["NAME", "ID", "CRON"]
    assert sorted(line[0] for line in lines[1:]) == ["grpo-qwen2.5-0.5b-nightly", "weekly"]
    assert ["grpo-qwen2.5-0.5b-nightly", new_id, "30", "3", "*", "*", "*"] == lines[1][:7] or \
        ["grpo-qwen2.5-0.5b-nightly", new_id, "30", "3", "*", "*", "*"] == lines[2][:7]
    deleted = runner.invoke(app, ["schedule", "--delete", "weekly", *common])
    assert deleted.exit_code == 0 and list(fake_kfp.recurring) == [new_id]
    missing = runner.invoke(app, ["schedule", "--delete", "weekly", *common])
    assert missing.exit_code == 2 and "no recurring run named 'weekly'" in missing.output


def test_bad_cron_is_refused():
    result = runner.invoke(app, ["schedule", "--cron", "nightly", "--host", "http://127.0.0.1:9"])
    assert result.exit_code == 2 and "five fields" in result.output


def test_the_training_pipeline_drives_a_run_through_the_local_runner_as_kfrl_train_does(tmp_path, mlflow_server):
    from kfp import local
    from mlflow import MlflowClient

    from kfrl.driver.controller import train
    from kfrl.pipelines.rl_iteration import PIPELINES

    small = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=4", "data.max_response_length=16",
             "trainer.log_generations=0", "trainer.val_before_train=false", "pipeline.fuse=all",
             f"pipeline.pipeline_root={tmp_path / 'inner'}", "trainer.experiment_name=pipe"]
    config_uri = tmp_path / "pipe-store" / "configs" / "demo.yaml"
    config_uri.parent.mkdir(parents=True)
    config_uri.write_text(Path("configs/demo.yaml").read_text())
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "outer"),
               raise_on_error=True)
    try:
        task = PIPELINES["rl_train"](config_uri=str(config_uri), store_uri=str(tmp_path / "pipe-store"),
                                     tracking_uri=mlflow_server, iterations=2, run_id="from-kfp",
                                     overrides=" ".join(small), runner="local")
    finally:
        import kfrl.driver.local

        kfrl.driver.local._LOCAL_ROOT = None  # the local runner's settings here belong to this test
    assert task is not None  # the pipeline ran (its exit handler too): the run is where its store and id say
    run_uri = str(tmp_path / "pipe-store" / "pipe" / "from-kfp")
    run = Run.at(run_uri)
    assert run.latest() == 2
    left = json.loads((Path(run_uri) / "summary.json").read_text())  # what `kfrl submit --wait` reads
    assert left["run_id"] == "from-kfp" and left["run_uri"] == run_uri and left["final_metrics"]
    reference = train(load_config(Path("configs/demo.yaml"), small + [
        f"store.uri={tmp_path / 'ref-store'}", f"tracking.uri={mlflow_server}", "pipeline.runner=inline"]),
        run_id="from-cli", iterations=2)
    ref_run = Run.at(reference.run_uri)
    for iteration in (1, 2):
        for stage in STAGES:
            mine, theirs = run.manifest(stage, iteration), ref_run.manifest(stage, iteration)
            for name in theirs.names():
                if name.endswith(".parquet"):
                    assert pq.read_table(Path(run.store.url(f"{mine.prefix}/{mine.attempt}/{name}"))).equals(
                        pq.read_table(Path(ref_run.store.url(f"{theirs.prefix}/{theirs.attempt}/{name}")))), \
                        (iteration, stage, name)
    client = MlflowClient(tracking_uri=mlflow_server)
    (recorded,) = client.search_runs([client.get_experiment_by_name("kfrl").experiment_id],
                                     "tags.`kfrl.run_id` = 'from-kfp'")
    history = [m.value for m in client.get_metric_history(recorded.info.run_id, "critic/score/mean")]
    expected = [m.value for m in client.get_metric_history(reference.mlflow_run_id, "critic/score/mean")]
    assert history == expected and len(history) == 2
    assert client.search_model_versions("tag.`kfrl.run_id`='from-kfp'")  # the last iteration registered
