"""The KFP pipeline: compiled YAML is current, the DAG has the documented shape, and the cluster
runner submits one run per iteration through kfp.Client."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

from kfrl.config import load_config
from kfrl.pipelines.compile import compile_pipelines, compiled_path
from kfrl.driver import IterationFailed
from kfrl.driver.cluster import ClusterKfpRunner


def test_committed_yaml_is_up_to_date(tmp_path):
    written = compile_pipelines(tmp_path)
    assert {p.name for p in written} == {"rl_iteration.yaml", "rl_iteration_fused.yaml", "rl_iteration_single.yaml",
                                            "rl_validate.yaml", "rl_train.yaml"}
    for fresh in written:
        assert compiled_path(fresh.stem).read_text() == fresh.read_text(), \
            f"pipelines/compiled/{fresh.name} is stale: run `kfrl compile`"


def test_fused_pipeline_is_infer_then_train():
    spec = yaml.safe_load(compiled_path("rl_iteration_fused").read_text())
    tasks = spec["root"]["dag"]["tasks"]
    assert set(tasks) == {"infer-op", "train-op"}
    assert tasks["train-op"]["dependentTasks"] == ["infer-op"]
    single = yaml.safe_load(compiled_path("rl_iteration_single").read_text())
    assert set(single["root"]["dag"]["tasks"]) == {"iteration-op"}


def test_dag_shape_parallel_branches_and_retries():
    spec = yaml.safe_load(compiled_path().read_text())
    tasks = spec["root"]["dag"]["tasks"]
    deps = {name: set(task.get("dependentTasks", [])) for name, task in tasks.items()}
    branches = {"score-op", "gen-max-op", "old-logprob-op", "ref-logprob-op", "values-op"}
    assert deps["rollout-op"] == set()
    # Everything that only reads the rollout is a parallel branch, then one advantage join,
    # then the two updates in parallel.
    for branch in branches:
        assert deps[branch] == {"rollout-op"}, branch
    assert deps["advantage-op"] == branches
    assert deps["update-actor-op"] == {"advantage-op"} and deps["update-critic-op"] == {"advantage-op"}
    assert deps["validate-op"] == {"update-actor-op"}  # validates the new policy
    assert set(tasks) == branches | {"rollout-op", "advantage-op", "update-actor-op", "update-critic-op", "validate-op"}
    for task in tasks.values():
        assert task["retryPolicy"]["maxRetryCount"] == 2
    assert set(spec["root"]["inputDefinitions"]["parameters"]) == {"run_uri", "iteration"}
    for executor in spec["deploymentSpec"]["executors"].values():
        assert "pip install" not in " ".join(executor["container"]["command"])  # install_kfp_package=False


class FakeKfp(BaseHTTPRequestHandler):
    """Just enough of KFP's v2beta1 REST API for kfp.Client: experiments, runs, run status."""
    posted: list = []
    final_state = "SUCCEEDED"

    def log_message(self, *args):
        pass

    def _send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        path = self.path.split("?")[0]
        if path.endswith("/healthz"):
            return self._send({"multi_user": False})
        if path == "/apis/v2beta1/experiments":
            return self._send({"experiments": [{"experiment_id": "exp-1", "display_name": "kfrl"}]})
        if path.startswith("/apis/v2beta1/runs/"):
            return self._send({"run_id": path.rsplit("/", 1)[1], "state": self.final_state})
        return self._send({})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeKfp.posted.append((self.path, body))
        self._send({"run_id": f"run-{len(FakeKfp.posted)}", "experiment_id": "exp-1", **body})


def test_cluster_runner_submits_the_runs_own_compiled_pipeline_and_records_the_skips(tmp_path):
    from kfrl.run import Run
    from kfrl.stages import STAGES, always_skipped
    from kfrl.stages.prepare import prepare_run
    from kfrl.store import Store

    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeKfp)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cfg = load_config(Path("configs/demo.yaml"), [
            "pipeline.runner=kfp", f"pipeline.host=http://127.0.0.1:{server.server_address[1]}",
            f"store.uri={tmp_path}", "cluster.image=registry.example/kfrl-gpu:7", "data.train_batch_size=8",
            "pipeline.engines=per_task", "pipeline.fuse=none",  # a task per stage, loading its models (with the engine: tests/test_engine_workload.py)
            "actor.ppo_mini_batch_size=8", "rollout.n=2"])
        run_uri = str(tmp_path / "demo" / "r1")
        prepare_run(Store(run_uri), cfg)
        skipped = always_skipped(cfg)
        assert set(skipped) == {"gen_max", "old_logprob", "ref_logprob", "values", "update_critic"}
        runner = ClusterKfpRunner(cfg)
        assert runner.run(run_uri, 3, Path("unused.log")) == "run-1"  # the driver tags MLflow with it
        path, body = [p for p in FakeKfp.posted if p[0] == "/apis/v2beta1/runs"][-1]
        assert body["runtime_config"]["parameters"] == {"run_uri": run_uri, "iteration": 3}
        # A compiled package with Kubernetes settings (image pull policy, secrets, ...) is two YAML documents;
        # KFP's client submits them as {"pipeline_spec": ..., "platform_spec": ...}.
        submitted = body["pipeline_spec"]
        spec, platform = submitted["pipeline_spec"], submitted["platform_spec"]
        assert spec["pipelineInfo"]["name"] == "kfrl-rl-iteration"
        rollout_platform = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-rollout-op"]
        assert rollout_platform["imagePullPolicy"] == "IfNotPresent"
        executors = spec["deploymentSpec"]["executors"]
        assert executors["exec-rollout-op"]["container"]["image"] == "registry.example/kfrl-gpu:7"  # the run's shape
        assert set(executors) == {f"exec-{s.replace('_', '-')}-op" for s in STAGES if s not in skipped}
        # What was submitted is committed in the run's folder; the skipped stages' records are in the store.
        run = Run.at(run_uri)
        (digest,) = [p.name for p in (Path(run_uri) / "pipelines").iterdir()]
        manifest = run.store.manifest(f"pipelines/{digest}")
        assert list(yaml.safe_load_all(run.store.read_file(manifest, "rl_iteration.yaml"))) == [spec, platform]
        assert {"rl_iteration.yaml", "rl_train.yaml", "rl_validate.yaml"} <= set(manifest.names())
        for stage in skipped:
            assert run.manifest(stage, 3).info["skipped"]
        assert not run.is_committed("rollout", 3)  # the cluster runs the rest
        runner.run(run_uri, 4, Path("unused.log"))
        assert [p.name for p in (Path(run_uri) / "pipelines").iterdir()] == [digest]  # compiled once
        FakeKfp.final_state = "FAILED"
        try:
            runner.run(run_uri, 5, Path("unused.log"))
            raise AssertionError("a failed KFP run must raise")
        except IterationFailed as err:
            assert "FAILED" in str(err)
    finally:
        FakeKfp.final_state = "SUCCEEDED"
        server.shutdown()


def test_stage_table_is_consistent_and_the_docs_carry_its_graph():
    from kfrl import batch
    from kfrl.stages import GRAPH_END, GRAPH_START, METRIC_ORDER, STAGE_TABLE, STAGES, stage_graph

    seen: set[str] = set()
    for spec in STAGE_TABLE:
        assert set(spec.needs) <= seen, f"{spec.name} needs a stage that runs after it"
        assert spec.writes is None or spec.writes in batch.GROUPS
        assert callable(spec.function())
        seen.add(spec.name)
    # veRL reports actor/entropy from old_log_prob: its metrics are merged after the update's.
    assert set(METRIC_ORDER) == set(STAGES) and METRIC_ORDER.index("old_logprob") > METRIC_ORDER.index("update_actor")
    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    assert f"{GRAPH_START}\n{stage_graph()}\n{GRAPH_END}" in doc, \
        "docs/architecture.md's stage graph is stale: run `python -m kfrl.stages docs/architecture.md`"
