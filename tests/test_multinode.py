"""Multi-node updates (trainer.nnodes > 1): the Kubeflow Trainer TrainJob and the training-operator
PyTorchJob built from a config, and their submission and wait against a fake Kubernetes API (the
CustomObjects create/get endpoints, served on 127.0.0.1): the submitted resource, an idempotent retry,
a failed job, a job that succeeded without committing, and Trainer releases that name the pod
placement differently. The worker itself (torchrun on CPU) is tested in its own module."""
from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from kfrl.config import load_config
from kfrl.distributed.multinode import (MAX_NAME, MultiNodeError, job_name, pytorchjob_manifest,
                                        run_multinode_update, trainjob_manifest)
from kfrl.run import Run, stage_prefix
from kfrl.stages.context import StageContext

GPU_CONFIG = Path("configs/gsm8k_grpo_qwen05b.yaml")
MULTI = ["trainer.nnodes=3", "trainer.n_gpus_per_node=4", "pipeline.namespace=ml-team",
         "cluster.node_selector={pool: h100}"]
RUN_URI = "s3://bucket/runs/grpo-qwen2.5-0.5b/kfp-0a1b2c3d4e5f"


def config(*overrides: str):
    return load_config(GPU_CONFIG, [*MULTI, *overrides])


# --- manifests --------------------------------------------------------------------------------------

def test_job_names_are_deterministic_short_dns_labels():
    name = job_name(RUN_URI, 7, "actor")
    assert name == job_name(RUN_URI, 7, "actor") and name.endswith("-i7-actor") and name.startswith("kfrl-kfp-0a1b")
    others = {job_name(RUN_URI, 8, "actor"), job_name(RUN_URI, 7, "critic"),
              job_name(RUN_URI.replace("grpo", "ppo"), 7, "actor")}  # same run id, other experiment
    assert name not in others and len(others) == 3
    long = job_name("/tmp/runs/Exp_1/" + "A_very_LONG.run.id" * 6, 123456, "critic")
    for candidate in (name, long, job_name("/runs/x/___", 1, "actor")):
        assert len(candidate) <= MAX_NAME and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", candidate), candidate


def test_trainjob_manifest_follows_the_trainer_v1alpha1_schema():
    cfg = config()
    job = trainjob_manifest(cfg, RUN_URI, 7, "actor", "job-a", namespace="ml-team")
    assert job["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and job["kind"] == "TrainJob"
    assert job["metadata"]["name"] == "job-a" and job["metadata"]["namespace"] == "ml-team"
    assert job["metadata"]["labels"] == {"kfrl.run": "kfp-0a1b2c3d4e5f", "kfrl.iteration": "7", "kfrl.role": "actor"}
    spec = job["spec"]
    assert spec["runtimeRef"] == {"name": "torch-distributed", "apiGroup": "trainer.kubeflow.org",
                                  "kind": "ClusterTrainingRuntime"}
    trainer = spec["trainer"]
    assert trainer["image"] == cfg.cluster.image
    # torchrun takes nodes, processes, rank and master from the runtime's PET_* variables.
    assert trainer["command"] == ["torchrun", "-m", "kfrl.stages.update_worker", "--run-uri", RUN_URI,
                                  "--iteration", "7", "--role", "actor"]
    assert trainer["numNodes"] == 3 and trainer["numProcPerNode"] == 4
    assert trainer["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": "4", "cpu": "8", "memory": "64G"}
    assert trainer["resourcesPerNode"]["requests"] == trainer["resourcesPerNode"]["limits"]
    assert not any(env["name"].startswith("PET_") for env in trainer["env"])  # reserved by the Torch plugin
    secret_env = {env["name"]: env["valueFrom"]["secretKeyRef"] for env in trainer["env"] if "valueFrom" in env}
    assert set(secret_env) == set(cfg.cluster.secret_keys)
    assert secret_env["AWS_ACCESS_KEY_ID"] == {"name": "kfrl-credentials", "key": "AWS_ACCESS_KEY_ID", "optional": True}
    (override,) = spec["podTemplateOverrides"]
    assert override["targetJobs"] == [{"name": "node"}]
    assert override["spec"] == {
        "nodeSelector": {"pool": "h100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}],
        "containers": [{"name": "node", "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}],
    }
    assert "runtimePatches" not in spec and "labels" not in spec  # spec.labels is gone in Trainer v2.2
    # Trainer v2.2: the same pod spec as a runtime patch of the `node` replicated job.
    patched = trainjob_manifest(cfg, RUN_URI, 7, "actor", "job-a", overrides_field="runtimePatches")["spec"]
    (patch,) = patched["runtimePatches"]
    assert patch["manager"] == "kfrl" and "podTemplateOverrides" not in patched
    (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert rjob["name"] == "node" and rjob["template"]["spec"]["template"]["spec"] == override["spec"]
    # Nothing to place: no override at all (the body fits every Trainer release); a GKE accelerator type
    # asks for nvidia.com/gpu on the nodes of that type.
    plain = trainjob_manifest(config("cluster.tolerations=[]", 'cluster.shm_size=""', "cluster.node_selector={}"),
                              RUN_URI, 1, "critic", "job-c")["spec"]
    assert "podTemplateOverrides" not in plain and "runtimePatches" not in plain
    gke = trainjob_manifest(config("cluster.gpu_stages.accelerator=nvidia-h100-80gb"), RUN_URI, 1, "actor", "j")
    assert gke["spec"]["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "4"
    assert gke["spec"]["podTemplateOverrides"][0]["spec"]["nodeSelector"] == {
        "pool": "h100", "cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    # trainer.device=cpu: CPU processes over gloo, no GPU asked.
    cpu = trainjob_manifest(config("trainer.device=cpu", "cluster.gpu_stages.gpus=0"), RUN_URI, 1, "actor", "j")
    assert "nvidia.com/gpu" not in cpu["spec"]["trainer"]["resourcesPerNode"]["limits"]


def test_pytorchjob_manifest_is_a_master_and_workers():
    cfg = config("cluster.multi_node=pytorchjob")
    job = pytorchjob_manifest(cfg, RUN_URI, 2, "critic", "job-b", namespace="ml-team")
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    assert job["metadata"]["labels"]["kfrl.role"] == "critic"
    spec = job["spec"]
    assert spec["nprocPerNode"] == "4"
    replicas = spec["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 2
    for replica in replicas.values():
        assert replica["restartPolicy"] == "Never"
        pod = replica["template"]["spec"]
        (container,) = pod["containers"]
        assert container["name"] == "pytorch" and container["image"] == cfg.cluster.image
        assert container["resources"]["limits"] == {"nvidia.com/gpu": "4", "cpu": "8", "memory": "64G"}
        assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": 23456}]
        assert container["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
        assert pod["nodeSelector"] == {"pool": "h100"} and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
        shell, flag, script = container["command"]
        assert (shell, flag) == ("/bin/sh", "-c")
        assert script.startswith("exec torchrun --nnodes=3 --nproc-per-node=4 ")
        assert '--node-rank="${PET_NODE_RANK:-${RANK:-0}}"' in script and "$MASTER_ADDR" in script
        assert script.endswith(f"-m kfrl.stages.update_worker --run-uri {RUN_URI} --iteration 2 --role critic")
        assert {e["name"] for e in container["env"] if "valueFrom" in e} == set(cfg.cluster.secret_keys)
    single = pytorchjob_manifest(config("trainer.nnodes=1"), RUN_URI, 2, "critic", "j")
    assert set(single["spec"]["pytorchReplicaSpecs"]) == {"Master"}


# --- submission and waiting, against a fake API server -------------------------------------------------

class FakeKube:
    """The CustomObjects create/get endpoints of trainjobs.trainer.kubeflow.org and
    pytorchjobs.kubeflow.org. A created job runs for `polls` reads, then ends `outcome`
    (Succeeded/Failed); `on_create(body)` runs when a job is created and `on_done(body)` when it ends
    (where a test commits the stage, as the job's rank 0 would)."""

    def __init__(self, *, outcome: str = "succeed", polls: int = 2, unknown_fields: tuple = (), fail_with: int = 0):
        self.jobs: dict[tuple, dict] = {}
        self.reads: dict[tuple, int] = {}
        self.requests: list[dict] = []
        self.outcome, self.polls, self.unknown_fields, self.fail_with = outcome, polls, unknown_fields, fail_with
        self.on_create = lambda body: None
        self.on_done = lambda body: None
        self.finished: set = set()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self):
                url = urlsplit(self.path)
                match = re.fullmatch(r"/apis/(?P<group>[^/]+)/(?P<version>[^/]+)/namespaces/(?P<ns>[^/]+)/"
                                     r"(?P<plural>trainjobs|pytorchjobs)(?:/(?P<name>[^/]+))?", url.path)
                return match, parse_qs(url.query)

            def do_POST(self):
                match, query = self._route()
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                fake.requests.append({"method": "POST", "path": self.path, "query": query, "body": body})
                if match is None or fake.fail_with == 404:
                    return self._send(404, api_status(404, "NotFound", "the server could not find the resource"))
                if fake.fail_with == 403:
                    return self._send(403, api_status(403, "Forbidden", 'trainjobs.trainer.kubeflow.org is forbidden: '
                                                  'User "system:serviceaccount:ml-team:default-editor" cannot create'))
                unknown = [f for f in fake.unknown_fields if f in body.get("spec", {})]
                if unknown and query.get("fieldValidation") == ["Strict"]:
                    return self._send(400, api_status(400, "BadRequest",
                                                  f'TrainJob in version "v1alpha1" cannot be handled as a TrainJob: '
                                                  f'strict decoding error: unknown field "spec.{unknown[0]}"'))
                key = (match["plural"], match["ns"], body["metadata"]["name"])
                if key in fake.jobs:
                    return self._send(409, api_status(409, "AlreadyExists", f'"{key[2]}" already exists'))
                fake.jobs[key] = {**body, "status": {}}
                fake.reads[key] = 0
                fake.on_create(body)
                self._send(201, fake.jobs[key])

            def do_GET(self):
                match, query = self._route()
                fake.requests.append({"method": "GET", "path": self.path, "query": query})
                key = (match["plural"], match["ns"], match["name"]) if match else None
                if key not in fake.jobs:
                    return self._send(404, api_status(404, "NotFound", "not found"))
                fake.reads[key] += 1
                self._send(200, fake.advance(key))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def advance(self, key) -> dict:
        job, reads, trainjob = self.jobs[key], self.reads[key], key[0] == "trainjobs"
        done = reads > self.polls
        if done and key not in self.finished:
            self.finished.add(key)
            self.on_done(job)
        if trainjob:
            conditions = []
            if done:
                conditions = [{"type": "Complete", "status": "True", "reason": "JobSetCompleted", "message": "done"}
                              if self.outcome == "succeed" else
                              {"type": "Failed", "status": "True", "reason": "JobSetFailed",
                               "message": "jobset failed: node-1 exited with code 1"}]
            job["status"] = {"conditions": conditions,
                             "jobsStatus": [{"name": "node", "active": 0 if done else 3, "ready": 0 if done else 3,
                                             "succeeded": 1 if done and self.outcome == "succeed" else 0,
                                             "failed": 1 if done and self.outcome != "succeed" else 0}]}
        else:
            conditions = [{"type": "Created", "status": "True", "reason": "PyTorchJobCreated"},
                          {"type": "Running", "status": "False" if done else "True", "reason": "PyTorchJobRunning"}]
            if done:
                conditions.append({"type": "Succeeded" if self.outcome == "succeed" else "Failed", "status": "True",
                                   "reason": "PyTorchJobSucceeded" if self.outcome == "succeed" else "PyTorchJobFailed",
                                   "message": "PyTorchJob ended"})
            job["status"] = {"conditions": conditions}
        return job

    def created(self) -> list[dict]:
        return [r["body"] for r in self.requests if r["method"] == "POST"]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def api_status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason,
            "message": message}


@pytest.fixture()
def kube():
    fakes = []

    def make(**kwargs) -> tuple[FakeKube, object]:
        from kubernetes import client

        fake = FakeKube(**kwargs)
        fakes.append(fake)
        api = client.CustomObjectsApi(client.ApiClient(client.Configuration(host=fake.url)))
        return fake, api

    yield make
    for fake in fakes:
        fake.close()


def stage_context(tmp_path, cfg, iteration: int = 3) -> StageContext:
    run_uri = str(tmp_path / "runs" / "grpo" / "run-1")
    return StageContext(run_uri=run_uri, iteration=iteration, run=Run.at(run_uri), config=cfg)


def commit_update(ctx: StageContext, stage: str = "update_actor"):
    """What the job's rank 0 does at the end: commit the stage."""
    return ctx.store.open_attempt(stage_prefix(ctx.iteration, stage)).commit(
        metrics={"actor/pg_loss": 0.5}, info={"iteration": ctx.iteration})


def test_submits_a_trainjob_waits_and_returns_the_committed_stage(tmp_path, kube):
    fake, api = kube()
    ctx = stage_context(tmp_path, config())
    fake.on_create = lambda body: commit_update(ctx)
    lines: list[str] = []
    manifest = run_multinode_update(ctx, "actor", api=api, poll_s=0.01, log=lines.append)
    assert manifest.prefix == "iter-000003/update_actor" and manifest.metrics == {"actor/pg_loss": 0.5}
    (post,) = [r for r in fake.requests if r["method"] == "POST"]
    assert post["path"].startswith("/apis/trainer.kubeflow.org/v1alpha1/namespaces/ml-team/trainjobs")
    assert post["query"]["fieldValidation"] == ["Strict"]  # an unknown field fails instead of vanishing
    body = post["body"]
    assert body["metadata"]["name"] == job_name(ctx.run_uri, 3, "actor")
    assert body["metadata"]["labels"] == {"kfrl.run": "run-1", "kfrl.iteration": "3", "kfrl.role": "actor"}
    assert body["spec"]["trainer"]["command"][-6:] == ["--run-uri", ctx.run_uri, "--iteration", "3", "--role", "actor"]
    assert body["spec"]["trainer"]["numNodes"] == 3 and "podTemplateOverrides" in body["spec"]
    text = "\n".join(lines)
    assert f"ml-team/{body['metadata']['name']}" in text and "node: active 3, ready 3" in text
    assert "Complete (JobSetCompleted)" in text and "committed by TrainJob" in text
    # Committed now: a second call submits nothing.
    assert run_multinode_update(ctx, "actor", api=api, poll_s=0.01, log=lines.append).attempt == manifest.attempt
    assert len(fake.created()) == 1


def test_a_retried_task_attaches_to_the_job_it_submitted(tmp_path, kube):
    fake, api = kube(polls=5)
    ctx = stage_context(tmp_path, config())
    fake.on_done = lambda body: commit_update(ctx)  # the workers commit as the job ends
    with pytest.raises(MultiNodeError, match=r"did not finish within 0 s .*a retried task attaches to it"):
        run_multinode_update(ctx, "actor", api=api, poll_s=0.01, timeout_s=1e-9, log=lambda line: None)
    # KFP retries the task while the job still runs: the same name, 409, attach, wait.
    lines: list[str] = []
    manifest = run_multinode_update(ctx, "actor", api=api, poll_s=0.01, log=lines.append)
    assert manifest.prefix == "iter-000003/update_actor"
    assert len(fake.created()) == 2 and len(fake.jobs) == 1  # the retry's create was answered 409
    assert any("exists already (a retried task): attaching to it" in line for line in lines)


def test_a_failed_job_fails_the_task_with_one_actionable_line(tmp_path, kube):
    fake, api = kube(outcome="fail")
    ctx = stage_context(tmp_path, config())
    with pytest.raises(MultiNodeError) as caught:
        run_multinode_update(ctx, "critic", api=api, poll_s=0.01, log=lambda line: None)
    message = str(caught.value)
    name = job_name(ctx.run_uri, 3, "critic")
    assert "\n" not in message
    assert message.startswith(f"TrainJob ml-team/{name} failed "
                              "(JobSetFailed: jobset failed: node-1 exited with code 1); ")
    assert f"kubectl logs -n ml-team -l jobset.sigs.k8s.io/jobset-name={name}" in message
    assert f"kubectl delete trainjobs {name} -n ml-team" in message


def test_a_job_that_succeeds_without_committing_is_an_error(tmp_path, kube):
    fake, api = kube()
    ctx = stage_context(tmp_path, config())
    with pytest.raises(MultiNodeError, match=r"succeeded but iteration 3 update_actor is not committed .*"
                                             r"rank 0 should have committed it; logs: kubectl logs"):
        run_multinode_update(ctx, "actor", api=api, poll_s=0.01, log=lambda line: None)


def test_a_trainer_release_without_pod_template_overrides_gets_runtime_patches(tmp_path, kube):
    fake, api = kube(unknown_fields=("podTemplateOverrides",))
    ctx = stage_context(tmp_path, config())
    fake.on_create = lambda body: commit_update(ctx)
    lines: list[str] = []
    run_multinode_update(ctx, "actor", api=api, poll_s=0.01, log=lines.append)
    first, second = fake.created()
    assert "podTemplateOverrides" in first["spec"] and "runtimePatches" in second["spec"]
    assert list(fake.jobs.values())[0]["spec"]["runtimePatches"][0]["manager"] == "kfrl"
    assert any("does not know spec.podTemplateOverrides" in line for line in lines)


def test_pytorchjob_kind_and_api_errors(tmp_path, kube):
    fake, api = kube()
    ctx = stage_context(tmp_path, config("cluster.multi_node=pytorchjob"))
    fake.on_create = lambda body: commit_update(ctx, "update_critic")
    run_multinode_update(ctx, "critic", api=api, poll_s=0.01, log=lambda line: None)
    ((plural, namespace, name),) = fake.jobs
    assert (plural, namespace) == ("pytorchjobs", "ml-team") and name.endswith("-i3-critic")
    assert fake.created()[0]["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2
    # No such API (the operator is not installed), and no permission: say what to do.
    _, api_404 = kube(fail_with=404)
    with pytest.raises(MultiNodeError, match=r"has no trainjobs.trainer.kubeflow.org .* Install Kubeflow Trainer v2"):
        run_multinode_update(stage_context(tmp_path / "b", config()), "actor", api=api_404, log=lambda line: None)
    _, api_403 = kube(fail_with=403)
    with pytest.raises(MultiNodeError, match=r"forbidden .* needs a Role allowing create and get on "
                                             r"trainjobs.trainer.kubeflow.org in namespace ml-team"):
        run_multinode_update(stage_context(tmp_path / "c", config()), "actor", api=api_403, log=lambda line: None)
