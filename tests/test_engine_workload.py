"""The run's engine on a cluster (kfrl.driver.engine.workload), through the official `kubernetes`
client against a stand-in API server on loopback (tests/kube_standin.py), whose kubelet runs the
engine pod's real command: `kfrl engine serve` with the token from the secret it names."""
from __future__ import annotations

import base64
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from kfrl.config import load_config
from kfrl.driver.engine.workload import (COMPONENT, LABEL_COMPONENT, LABEL_KFP_RUN, LABEL_RUN, TOKEN_KEY,
                                         EngineBinding, EngineWorkload, EngineWorkloadError, engine_manifests,
                                         engine_name)
from kfrl.run import Run

from kube_standin import StandIn

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "kubeflow"
GPU = ["cluster.secret=kfrl-credentials", "cluster.gpu_stages.gpus=1", "cluster.gpu_stages.cpu=8",
       "cluster.gpu_stages.memory=64Gi", "cluster.shm_size=16Gi", "cluster.node_selector={pool: h200}",
       "cluster.tolerations=[{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]",
       "cluster.image_pull_secrets=[regcred]", "cluster.image=registry.example/kfrl-gpu:3"]
OWNER = {"apiVersion": "v1", "kind": "Pod", "name": "rl-train-driver-abc", "uid": "6f1c0f7e-0000-4000-8000-000000000001"}


def manifests(*overrides, run_id="20261204-101010-ab12", token="s3cret-token-of-this-run-0123456789"):
    cfg = load_config(None, [*GPU, *overrides])
    return cfg, engine_manifests(cfg, f"s3://bucket/runs/demo/{run_id}", run_id, namespace=NAMESPACE, token=token,
                                 owner=OWNER, kfp_run_id="3c0ffee0-1234-4abc-9def-0123456789ab")


def test_every_engine_manifest_is_valid_against_the_kubernetes_schemas():
    import kubernetes_validate

    _, objects = manifests()
    for kind, body in objects.items():
        # strict: an unknown or misspelt field is an error, as the API server's strict field validation
        for version in ("1.29.0", "1.33.0"):
            kubernetes_validate.validate(body, version, strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):  # the check can fail
        broken = json.loads(json.dumps(objects["pod"]))
        broken["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = [8000]
        kubernetes_validate.validate(broken, "1.33.0", strict=True)


def test_the_engine_pod_has_the_gpu_stages_shape_and_no_secret_in_its_spec():
    token = "s3cret-token-of-this-run-0123456789"
    cfg, objects = manifests(token=token)
    pod, secret, service, policy = objects["pod"], objects["secret"], objects["service"], objects["network_policy"]
    (container,) = pod["spec"]["containers"]
    assert container["image"] == "registry.example/kfrl-gpu:3" and container["imagePullPolicy"] == "IfNotPresent"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1", "cpu": "8", "memory": "64Gi"}
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert pod["spec"]["nodeSelector"] == {"pool": "h200"}
    assert pod["spec"]["tolerations"] == [{"operator": "Exists", "key": "nvidia.com/gpu", "effect": "NoSchedule"}]
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert pod["spec"]["restartPolicy"] == "Never" and pod["spec"]["automountServiceAccountToken"] is False
    name = engine_name("20261204-101010-ab12")
    assert container["command"][:5] == ["kfrl", "engine", "serve", "--run-uri", "s3://bucket/runs/demo/20261204-101010-ab12"]
    assert container["command"][-2:] == ["--advertise", f"http://{name}.{NAMESPACE}.svc:8000"]
    env = {e["name"]: e for e in container["env"]}
    assert env[TOKEN_KEY]["valueFrom"]["secretKeyRef"] == {"name": name, "key": TOKEN_KEY}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "kfrl-credentials"
    assert base64.b64decode(secret["data"][TOKEN_KEY]).decode() == token
    for body in (pod, service, policy):  # the token only in the secret
        assert token not in json.dumps(body)
    for body in objects.values():  # owned by the driver's pod, labelled for the exit handler
        assert body["metadata"]["ownerReferences"] == [OWNER]
        assert body["metadata"]["labels"][LABEL_KFP_RUN] == "3c0ffee0-1234-4abc-9def-0123456789ab"
    assert service["spec"]["selector"] == {LABEL_RUN: "20261204-101010-ab12", LABEL_COMPONENT: COMPONENT}
    assert all(pod["metadata"]["labels"][k] == v for k, v in service["spec"]["selector"].items())
    # Only the run's own task pods reach the engine's port.
    assert policy["spec"]["podSelector"]["matchLabels"] == service["spec"]["selector"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": {LABEL_RUN: "20261204-101010-ab12"}}}]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert EngineBinding.for_run("20261204-101010-ab12") == EngineBinding(secret_name=name,
                                                                          run_label="20261204-101010-ab12")


def test_engine_names_are_dns_labels_for_any_run_id():
    import re

    for run_id in ("20261204-101010-ab12", "kfp-0123456789ab", "From_KFP.run", "x" * 90, "--"):
        name = engine_name(run_id)
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63, name
    assert engine_name("A_b") != engine_name("a-b")  # distinct runs, distinct engines


# --- the workload's life, against the stand-in API ------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def apis(kube: StandIn):
    from kubernetes import client

    api = client.ApiClient(client.Configuration(host=kube.url))
    return client.CoreV1Api(api), client.NetworkingV1Api(api)


@pytest.fixture()
def prepared_run(tmp_path):
    from kfrl.stages.prepare import prepare_run

    config = load_config(REPO / "configs" / "demo.yaml", [
        f"store.uri={tmp_path / 'store'}", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2",
        "data.max_response_length=8", "trainer.log_generations=0", "pipeline.runner=kfp",
        "pipeline.host=http://127.0.0.1:9", "cluster.image=unused"])
    run = Run.at(str(tmp_path / "store" / "demo" / "r-1"))
    prepare_run(run.store, config)
    return config, run


def kubelet_env() -> dict:
    # The image's `kfrl` is this venv's; the kubelet runs the pod's command as it is.
    return {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(REPO / "src")}


def write_kubeconfig(path: Path, kube: StandIn) -> Path:
    """A kubeconfig whose context reaches the stand-in, in NAMESPACE (what kfrl finds through $KUBECONFIG)."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": kube.url}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u", "namespace": NAMESPACE}}],
        "users": [{"name": "u", "user": {"token": "t"}}]}))
    return path


class ReadyPods:
    """Plays the kubelet of a stand-in without one: every pending pod becomes Running and Ready."""

    def __init__(self, kube: StandIn):
        self.kube, self.done = kube, threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self.done.wait(0.05):
            for pod in self.kube.objects("pods"):
                if pod["status"].get("phase") == "Pending" and pod["metadata"]["name"].startswith("kfrl-engine"):
                    try:
                        self.kube.set_pod_phase(pod["metadata"]["namespace"], pod["metadata"]["name"], "Running",
                                                ready=True)
                    except KeyError:  # deleted meanwhile
                        pass

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


def workload(config, run, kube, **kwargs) -> EngineWorkload:
    core, networking = apis(kube)
    lines = []
    engine = EngineWorkload(config=config, run_uri=run.uri, run_id="r-1", namespace=NAMESPACE, core=core,
                            networking=networking, owner=kwargs.pop("owner", None), port=free_port(),
                            ready_timeout_s=120, poll_s=0.1, log=lines.append, **kwargs)
    engine.lines = lines
    return engine


def test_the_driver_starts_the_engine_pod_it_serves_with_the_secrets_token_and_stop_deletes_everything(
        prepared_run):
    import requests

    from kfrl.driver.engine.client import run_on_engine

    config, run = prepared_run
    with StandIn(kubelet=True, env_extra=kubelet_env()) as kube:
        engine = workload(config, run, kube, kfp_run_id="kfp-run-7")
        started = time.monotonic()
        engine.start()
        ready_s = time.monotonic() - started
        assert engine.alive()
        assert {o["metadata"]["name"] for kind in ("pods", "services", "secrets", "networkpolicies")
                for o in kube.objects(kind)} == {engine.name}
        # The engine took the token from the secret: it refuses requests without it, and serves a stage with it.
        local = f"http://127.0.0.1:{engine.port}"
        health = requests.get(f"{local}/health", timeout=5).json()
        assert health["run_uri"] == run.uri
        refused = requests.post(f"{local}/stages", json={"run_uri": run.uri, "iteration": 1, "stage": "score"},
                                timeout=10)
        assert refused.status_code == 401
        os.environ[TOKEN_KEY] = engine.token
        try:
            result = run_on_engine(local, "rollout", run.uri, 1)
        finally:
            os.environ.pop(TOKEN_KEY)
        assert result.stage == "rollout" and run.is_committed("rollout", 1)
        assert run.engine()["url"] == engine.url  # what tasks read: the Service's address
        engine.stop(wait_s=30)
        assert not any(kube.objects(kind) for kind in ("pods", "services", "secrets", "networkpolicies"))
        log = kube.pod_log(NAMESPACE, engine.name)
        assert "[engine] stopped" in log, log  # SIGTERM: it finished its writes and cleared ENGINE.json
        assert run.engine() is None
        assert engine.token not in log
    assert ready_s < 60, ready_s


def test_a_dead_engine_pod_is_replaced_and_a_second_driver_attempt_replaces_the_first_ones(prepared_run):
    config, run = prepared_run
    with StandIn(kubelet=True, env_extra=kubelet_env()) as kube:
        engine = workload(config, run, kube)
        engine.start()
        first_uid = kube.objects("pods")[0]["metadata"]["uid"]
        kube.remove("pods", NAMESPACE, engine.name)  # evicted, the node lost
        assert not engine.alive()
        engine.restart()
        assert engine.alive() and engine.restarts == 1
        assert kube.objects("pods")[0]["metadata"]["uid"] != first_uid
        assert any("replacing it (restart 1)" in line for line in engine.lines)
        # A retried driver (a new token) finds the objects of the first: it replaces the secret and the pod.
        again = workload(config, run, kube)
        again.port = engine.port
        again.start()
        (secret,) = kube.objects("secrets")
        assert base64.b64decode(secret["data"][TOKEN_KEY]).decode() == again.token != engine.token
        assert len(kube.objects("pods")) == 1 and again.alive()
        again.stop(wait_s=30)


def test_an_engine_that_cannot_start_fails_with_what_to_do(prepared_run):
    config, run = prepared_run
    with StandIn() as kube:  # no kubelet: nothing runs; the test plays the kubelet
        engine = workload(config, run, kube)
        threading.Timer(0.5, lambda: kube.set_pod_phase(NAMESPACE, engine.name, "Failed", ready=False,
                                                        reason="Error", message="no token", exit_code=2)).start()
        with pytest.raises(EngineWorkloadError, match=r"did not start: the pod ended \(Failed: container exited "
                                                      r"with code 2.*kubectl logs -n kubeflow kfrl-engine-r-1"):
            engine.start()
        kube.fail_next("POST", "pods", 403, "Forbidden", 'pods is forbidden: User "system:serviceaccount:kubeflow:'
                       'pipeline-runner" cannot create resource "pods" in API group "" in the namespace "kubeflow"')
        kube.remove("pods", NAMESPACE, engine.name)
        with pytest.raises(EngineWorkloadError, match=r"HTTP 403 pods is forbidden.*infra/terraform: kfrl_engine "
                                                      r"role\), or set pipeline.engines=per_task"):
            engine.start()


def test_the_engine_goes_with_the_drivers_pod_and_with_the_exit_handler(prepared_run, tmp_path, monkeypatch):
    from kfrl.driver.kfp_entry import cleanup_for_kfp

    config, run = prepared_run
    with StandIn() as kube:
        core, _ = apis(kube)
        driver = core.create_namespaced_pod(NAMESPACE, {"apiVersion": "v1", "kind": "Pod",
                                                        "metadata": {"name": "driver"},
                                                        "spec": {"containers": [{"name": "main", "image": "x"}]}})
        owner = {"apiVersion": "v1", "kind": "Pod", "name": "driver", "uid": driver.metadata.uid}
        engine = workload(config, run, kube, owner=owner, kfp_run_id="kfp-run-9")
        with ReadyPods(kube):
            engine.start()
        kube.remove("pods", NAMESPACE, "driver")
        collected = kube.collect_garbage()
        assert {plural for plural, _, _ in collected} == {"pods", "services", "secrets", "networkpolicies"}

        # The exit handler: by the KFP run's label, through the kubeconfig it finds.
        with ReadyPods(kube):
            engine.start()
        other = workload(config, run, kube, kfp_run_id="another-run")
        assert len(kube.objects("services")) == 1
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", kube)
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.delenv("KF_PIPELINES_NAMESPACE", raising=False)
        assert cleanup_for_kfp(kfp_run_id="another-run", runner="kfp").startswith("deleted")
        assert len(kube.objects("services")) == 1  # not this run's
        assert cleanup_for_kfp(kfp_run_id="kfp-run-9", runner="kfp").startswith("deleted")
        assert not any(kube.objects(kind) for kind in ("services", "secrets", "networkpolicies"))
        assert cleanup_for_kfp(kfp_run_id="kfp-run-9", runner="local") == "no cluster engine (runner=local)"
        del other


def test_the_terraform_role_grants_exactly_what_the_engine_workload_uses(prepared_run):
    """Every (verb, resource) the driver and the exit handler sent is in infra/terraform's kfrl-engine
    Role, and the Role grants nothing they do not use."""
    from test_terraform import parse

    config, run = prepared_run
    with StandIn() as kube:
        engine = workload(config, run, kube, kfp_run_id="k")
        with ReadyPods(kube):
            engine.start()
            engine.start()  # a second attempt: replaces the secret and the pod
            kube.remove("pods", NAMESPACE, engine.name)
            engine.restart()
            engine.stop(wait_s=5)
        used = set()
        for request in kube.requests:
            parts = request.path.split("?")[0].strip("/").split("/")
            plural = parts[parts.index("namespaces") + 2]
            named = len(parts) > parts.index("namespaces") + 3
            verb = {"POST": "create", "PUT": "update", "GET": "get" if named else "list",
                    "DELETE": "delete" if named else "deletecollection"}[request.method]
            used.add((verb, plural))
    tf = parse(REPO / "infra" / "terraform" / "modules" / "kfp" / "main.tf")
    (role,) = [r["kubernetes_role_v1"]["engine"] for r in tf["resource"] if "engine" in r.get("kubernetes_role_v1", {})]
    rules = role["rule"] if isinstance(role["rule"], list) else [role["rule"]]
    granted = {(verb, resource) for rule in rules for resource in rule["resources"] for verb in rule["verbs"]}
    assert used == granted, (sorted(used - granted), sorted(granted - used))


# --- the run's pipelines and the driver around the engine --------------------------------------------------

def compiled(tmp_path, cfg, binding):
    from kfrl.pipelines.compile import compile_pipelines

    compile_pipelines(tmp_path, cfg, binding)
    docs = list(yaml.safe_load_all((tmp_path / "rl_iteration.yaml").read_text()))
    return docs[0], (docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"] if len(docs) > 1 else {})


def test_with_a_cluster_engine_the_gpu_tasks_are_cpu_clients_that_carry_the_runs_label_and_token(tmp_path):
    cfg = load_config(None, [*GPU, "pipeline.runner=kfp", "cluster.cpu_image=registry.example/kfrl-cpu:3"])
    binding = EngineBinding.for_run("r-1")
    spec, kube = compiled(tmp_path / "engine", cfg, binding)
    executors = spec["deploymentSpec"]["executors"]
    rollout = executors["exec-rollout-op"]["container"]
    assert rollout["image"] == "registry.example/kfrl-cpu:3"
    assert "accelerator" not in json.dumps(rollout.get("resources", {}))
    assert {"name": "KFRL_ENGINE_REQUIRED", "value": "1"} in rollout["env"]
    assert spec["root"]["dag"]["tasks"]["rollout-op"]["retryPolicy"]["maxRetryCount"] == 5
    for task in ("exec-rollout-op", "exec-score-op", "exec-update-actor-op"):
        platform = kube[task]
        assert platform["podMetadata"]["labels"] == {LABEL_RUN: "r-1"}
        assert {"secretName": binding.secret_name, "keyToEnv": [{"secretKey": TOKEN_KEY, "envVar": TOKEN_KEY}]} \
            in [{k: v for k, v in s.items() if k in ("secretName", "keyToEnv")} for s in platform["secretAsEnv"]]
        assert "tolerations" not in platform and "nodeSelector" not in platform  # no GPU node needed
        assert platform["imagePullPolicy"] == "IfNotPresent"  # a node pulls the image once, not per pod
    assert "KFRL_ENGINE_REQUIRED" not in json.dumps(executors["exec-score-op"])  # a CPU stage may run itself
    # Without the engine (per_task) the GPU tasks keep the GPU shape.
    spec, kube = compiled(tmp_path / "per-task", cfg.model_copy(update={"pipeline": cfg.pipeline.model_copy(
        update={"engines": "per_task"})}), None)
    rollout = spec["deploymentSpec"]["executors"]["exec-rollout-op"]["container"]
    assert rollout["image"] == "registry.example/kfrl-gpu:3" and rollout["resources"]["accelerator"]["count"] == "1"
    assert "podMetadata" not in kube["exec-rollout-op"]


def test_the_training_pipeline_deletes_the_engine_on_exit_and_tells_the_driver_its_pod():
    from kfrl.pipelines.compile import compiled_path

    docs = list(yaml.safe_load_all(compiled_path("rl_train").read_text()))
    tasks = docs[0]["root"]["dag"]["tasks"]
    assert tasks["engine-cleanup-op"]["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    assert tasks["engine-cleanup-op"]["dependentTasks"] == ["exit-handler-1"]
    driver = docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-train-driver-op"]
    assert {(f["name"], f["fieldPath"]) for f in driver["fieldPathAsEnv"]} == {
        ("KFRL_POD_NAME", "metadata.name"), ("KFRL_POD_UID", "metadata.uid")}


def test_a_required_client_without_a_live_engine_fails_and_never_runs_the_stage(prepared_run, monkeypatch):
    from kfrl.driver.engine.client import EngineUnavailable, dispatch

    _, run = prepared_run
    run.set_engine({"url": "http://127.0.0.1:9", "pid": 1, "host": "gone"})  # a dead engine's record
    monkeypatch.setenv("KFRL_ENGINE_REQUIRED", "1")
    with pytest.raises(EngineUnavailable, match=r"no live engine serves .*r-1.*this task has no GPU and does not run "
                                                r"rollout of iteration 1 itself.*KFP retries this task"):
        dispatch("rollout", run.uri, 1)
    assert not run.is_committed("rollout", 1)


def test_the_cluster_driver_replaces_a_dead_engine_while_it_waits_for_an_iteration(prepared_run, monkeypatch):
    from test_cluster import FakeKfp

    from kfrl.driver.cluster import ClusterKfpRunner

    config, run = prepared_run
    fake = FakeKfp()
    fake.run_states = ["PENDING"] * 8 + ["RUNNING"] * 30 + ["SUCCEEDED"]
    monkeypatch.setenv("KF_PIPELINES_TOKEN", "t0ken")
    try:
        runner = ClusterKfpRunner(config.model_copy(update={"pipeline": config.pipeline.model_copy(
            update={"host": fake.url})}))
        runner.poll_s = 0.05
        with StandIn() as kube, ReadyPods(kube):
            runner.engine = workload(config, run, kube)
            runner.engine.start()
            threading.Timer(0.3, lambda: kube.remove("pods", NAMESPACE, runner.engine.name)).start()
            assert "SUCCEEDED" in runner.wait("run-1")
            assert runner.engine.restarts == 1 and runner.engine.alive()
    finally:
        fake.server.shutdown()


def test_a_cluster_run_whose_engine_cannot_start_fails_naming_the_way_out(prepared_run, monkeypatch, tmp_path):
    from kfrl.driver import IterationFailed
    from kfrl.driver.cluster import ClusterKfpRunner

    config, run = prepared_run
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    with pytest.raises(IterationFailed, match=r"the run's engine did not start on the cluster: no Kubernetes "
                                              r"credentials.*pipeline.engines=per_task"):
        ClusterKfpRunner(config).start_engine(run)
    per_task = config.model_copy(update={"pipeline": config.pipeline.model_copy(update={"engines": "per_task"})})
    assert ClusterKfpRunner(per_task).start_engine(run) is None


def test_a_kfp_driven_run_is_tagged_with_its_kfp_run_its_link_its_commit_and_its_image_digest(prepared_run, tmp_path,
                                                                                          monkeypatch):
    from kubernetes import client

    from kfrl.driver.controller import run_tags

    config, run = prepared_run
    config = config.model_copy(update={"pipeline": config.pipeline.model_copy(
        update={"ui_url": "https://kubeflow.example.com/pipeline/"})})
    monkeypatch.chdir(tmp_path)  # no checkout here: the commit comes from the image
    with StandIn() as kube:
        core, _ = apis(kube)
        core.create_namespaced_pod(NAMESPACE, client.V1Pod(
            metadata=client.V1ObjectMeta(name="rl-train-driver"),
            spec=client.V1PodSpec(containers=[client.V1Container(name="main", image="registry.example/kfrl-cpu:7")])))
        kube.set_pod_phase(NAMESPACE, "rl-train-driver", "Running", ready=True)
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", kube)
        environ = {"KFRL_KFP_RUN_ID": "kfp-run-9", "KFRL_GIT_COMMIT": "0123abcd" * 5,
                   "KFRL_POD_NAME": "rl-train-driver", "KUBECONFIG": str(kubeconfig)}
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        tags = run_tags(config, run.uri, environ)
        reported = core.read_namespaced_pod("rl-train-driver", NAMESPACE).status.container_statuses[0].image_id
    assert tags["kfrl.kfp_run_id"] == "kfp-run-9"
    assert tags["kfrl.kfp_run_url"] == "https://kubeflow.example.com/pipeline/#/runs/details/kfp-run-9"
    assert tags["mlflow.source.git.commit"] == "0123abcd" * 5 and tags["mlflow.source.type"] == "JOB"
    assert tags["kfrl.image"] == "registry.example/kfrl-cpu:7"
    assert tags["kfrl.image_digest"] == "sha256:" + reported.split("@sha256:")[1]
    # Outside KFP: none of these, and a pod the API does not know costs nothing but the tags.
    assert not {k for k in run_tags(config, run.uri, {}) if k.startswith("kfrl.kfp") or k.startswith("kfrl.image")}
    gone = run_tags(config, run.uri, {**environ, "KFRL_POD_NAME": "no-such-pod"})
    assert "kfrl.image" not in gone and gone["kfrl.kfp_run_id"] == "kfp-run-9"


def test_the_engine_logs_its_machines_system_metrics_into_the_runs_mlflow_run(tmp_path):
    """On a cluster the driver's pod has no GPU: the engine pod is told the MLflow run (never the
    tracking credentials, which come from the secret) and logs system/engine/... into it."""
    import kubernetes_validate
    from mlflow import MlflowClient

    from kfrl.driver.engine.client import METRICS_RUN_VARIABLE
    from kfrl.driver.engine.server import start_engine_system_metrics
    from kfrl.tracking import Tracker, stop_system_metrics

    cfg = load_config(None, GPU)
    objects = engine_manifests(cfg, "s3://bucket/runs/demo/r-1", "r-1", namespace=NAMESPACE, token="t" * 32,
                               owner=OWNER, metrics_run=("0123abcd", "https://alice:pa55word@mlflow.example:5000/"))
    kubernetes_validate.validate(objects["pod"], "1.33.0", strict=True)
    env = {e["name"]: e.get("value") for e in objects["pod"]["spec"]["containers"][0]["env"]}
    assert env[METRICS_RUN_VARIABLE] == "0123abcd" and env["MLFLOW_TRACKING_URI"] == "https://mlflow.example:5000/"
    assert "pa55word" not in json.dumps(objects) and "alice" not in json.dumps(objects)
    assert METRICS_RUN_VARIABLE not in json.dumps(manifests()[1]["pod"])  # only when the driver asks

    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(tracking, "engine-metrics", "r-1")
    assert start_engine_system_metrics({}) is None
    monitor = start_engine_system_metrics({METRICS_RUN_VARIABLE: tracker.mlflow_run_id, "MLFLOW_TRACKING_URI": tracking})
    assert monitor is not None
    stop_system_metrics(monitor)  # the engine's shutdown: one last sample
    logged = MlflowClient(tracking_uri=tracking).get_run(tracker.mlflow_run_id).data.metrics
    assert any(key.startswith("system/engine/cpu_utilization") for key in logged), sorted(logged)
