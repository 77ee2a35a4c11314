"""A multi-node update (trainer.nnodes > 1) as a Kubernetes training job.

The KFP task of ``update_actor`` / ``update_critic`` does not train: it submits one job of
``trainer.nnodes`` pods, ``trainer.n_gpus_per_node`` processes each, every process running
``python -m kfrl.stages.update_worker`` under torchrun, waits for it, and checks that the job
committed the stage to the run's store (rank 0 commits; the store is the only hand-off).

Two kinds of job (``cluster.multi_node``):

- ``trainjob``: a Kubeflow Trainer v2 ``TrainJob`` (trainer.kubeflow.org/v1alpha1) on the
  ClusterTrainingRuntime ``cluster.multi_node_runtime`` (torch-distributed). The runtime's Torch
  plugin gives the ``node`` container torchrun's settings as ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
  ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT``, which torchrun reads, so the command
  is plain ``torchrun -m kfrl.stages.update_worker ...``. Placement (node selector, tolerations)
  and /dev/shm go in the override field of the Trainer release: ``podTemplateOverrides`` (v2.1) or
  ``runtimePatches`` (v2.2, which removed podTemplateOverrides). The job is created with strict field
  validation, so a server that does not know the field rejects it (instead of dropping the placement
  silently) and the other one is tried.
- ``pytorchjob``: a training-operator ``PyTorchJob`` (kubeflow.org/v1): a Master replica and
  ``nnodes - 1`` Worker replicas, container ``pytorch``, ``spec.nprocPerNode``. torchrun gets its node
  rank and master address from the operator's ``RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT`` (set by
  every operator version; ``PET_*`` only by recent ones).

The job's name is derived from the run and the iteration, so a retried task finds the job it
submitted (409 AlreadyExists: it attaches and waits) instead of starting a second one.
"""
from __future__ import annotations

import hashlib
import re
import shlex
import time
from dataclasses import dataclass

from kfrl.kube import (KubernetesUnavailable, api_configuration, gpu_resources, label_value, node_selector,
                       pod_tolerations, secret_env, shm_volume, workload_namespace)
from kfrl.run import CRITIC_STAGE, POLICY_STAGE, stage_prefix

WORKER_MODULE = "kfrl.stages.update_worker"
ROLE_STAGES = {"actor": POLICY_STAGE, "critic": CRITIC_STAGE}
LABEL_RUN, LABEL_ITERATION, LABEL_ROLE = "kfrl.run", "kfrl.iteration", "kfrl.role"
ANNOTATION_RUN_URI = "kfrl.run-uri"
# Job names stay short: the pods' hostnames (TrainJob: <name>-node-<i>-0; PyTorchJob:
# <name>-worker-<i>) and the JobSet's names must remain DNS labels (63 characters).
MAX_NAME = 45
# The Trainer release's field for pod placement: v2.1 podTemplateOverrides, v2.2 runtimePatches.
OVERRIDE_FIELDS = ("podTemplateOverrides", "runtimePatches")
RUNTIME_PATCH_MANAGER = "kfrl"
TRAINJOB_NODE = "node"  # the torch-distributed runtime's replicated job and container
PYTORCHJOB_CONTAINER, PYTORCHJOB_PORT_NAME, PYTORCHJOB_PORT = "pytorch", "pytorchjob-port", 23456


class MultiNodeError(RuntimeError):
    """The job could not be submitted, failed, or did not commit; the message says what to do."""


@dataclass(frozen=True)
class JobKind:
    kind: str
    group: str
    version: str
    plural: str
    succeeded: str           # the condition type that means done
    pod_selector: str        # label of the job's pods, for `kubectl logs -l <label>=<name>`

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    @property
    def resource(self) -> str:
        return f"{self.plural}.{self.group}"


KINDS = {
    "trainjob": JobKind("TrainJob", "trainer.kubeflow.org", "v1alpha1", "trainjobs", "Complete",
                        "jobset.sigs.k8s.io/jobset-name"),
    "pytorchjob": JobKind("PyTorchJob", "kubeflow.org", "v1", "pytorchjobs", "Succeeded",
                          "training.kubeflow.org/job-name"),
}


# --- what every node runs, on what -------------------------------------------------------------------

def worker_args(run_uri: str, iteration: int, role: str) -> list[str]:
    return ["--run-uri", run_uri, "--iteration", str(int(iteration)), "--role", role]


def job_name(run_uri: str, iteration: int, role: str) -> str:
    """Deterministic per (run, iteration, role): ``kfrl-<run id>-<hash of the run URI>-i<N>-<role>``, an
    RFC 1035 label of at most ``MAX_NAME`` characters (the run id is shortened to fit)."""
    run_id = run_uri.rstrip("/").rsplit("/", 1)[-1]
    slug = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", run_id.lower())).strip("-")
    digest = hashlib.sha256(run_uri.rstrip("/").encode()).hexdigest()[:6]
    tail = f"-{digest}-i{int(iteration)}-{role}"
    room = MAX_NAME - len("kfrl-") - len(tail)
    slug = slug[:max(room, 0)].rstrip("-")
    return f"kfrl-{slug}{tail}" if slug else f"kfrl{tail}"


def _metadata(run_uri: str, iteration: int, role: str, name: str, namespace: str | None) -> dict:
    metadata = {
        "name": name,
        "labels": {LABEL_RUN: label_value(run_uri.rstrip("/").rsplit("/", 1)[-1]),
                   LABEL_ITERATION: str(int(iteration)), LABEL_ROLE: role},
        "annotations": {ANNOTATION_RUN_URI: run_uri},
    }
    if namespace:
        metadata["namespace"] = namespace
    return metadata


def _pod_overrides(cluster) -> dict:
    """What the TrainJob changes in the runtime's ``node`` pods: placement and /dev/shm ({} = nothing)."""
    spec: dict = {}
    selector, tolerations = node_selector(cluster), pod_tolerations(cluster)
    volumes, mounts = shm_volume(cluster)
    if selector:
        spec["nodeSelector"] = selector
    if tolerations:
        spec["tolerations"] = tolerations
    if volumes:
        spec["volumes"] = volumes
        spec["containers"] = [{"name": TRAINJOB_NODE, "volumeMounts": mounts}]
    return spec


def trainjob_manifest(cfg, run_uri: str, iteration: int, role: str, name: str, *, namespace: str | None = None,
                      overrides_field: str = "podTemplateOverrides") -> dict:
    """A Kubeflow Trainer v2 TrainJob running the update worker on ``trainer.nnodes`` nodes.
    ``overrides_field``: where the pod placement goes, ``podTemplateOverrides`` (Trainer v2.1) or
    ``runtimePatches`` (v2.2); left out when there is nothing to place."""
    if overrides_field not in OVERRIDE_FIELDS:
        raise ValueError(f"overrides_field must be one of {OVERRIDE_FIELDS}, got {overrides_field!r}")
    cluster = cfg.cluster
    trainer = {
        "image": cluster.image,
        # torchrun reads the runtime's PET_NNODES / PET_NPROC_PER_NODE / PET_NODE_RANK / PET_MASTER_*.
        "command": ["torchrun", "-m", WORKER_MODULE, *worker_args(run_uri, iteration, role)],
        "env": secret_env(cluster),
        "numNodes": int(cfg.trainer.nnodes),
        "numProcPerNode": int(cfg.trainer.n_gpus_per_node),
    }
    resources = gpu_resources(cfg)
    if resources:
        trainer["resourcesPerNode"] = resources
    spec: dict = {
        "runtimeRef": {"name": cluster.multi_node_runtime, "apiGroup": KINDS["trainjob"].group,
                       "kind": "ClusterTrainingRuntime"},
        "trainer": trainer,
    }
    pod = _pod_overrides(cluster)
    if pod and overrides_field == "podTemplateOverrides":
        spec["podTemplateOverrides"] = [{"targetJobs": [{"name": TRAINJOB_NODE}], "spec": pod}]
    elif pod:
        spec["runtimePatches"] = [{
            "manager": RUNTIME_PATCH_MANAGER,
            "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
                {"name": TRAINJOB_NODE, "template": {"spec": {"template": {"spec": pod}}}}]}}},
        }]
    return {"apiVersion": KINDS["trainjob"].api_version, "kind": "TrainJob",
            "metadata": _metadata(run_uri, iteration, role, name, namespace), "spec": spec}


def pytorchjob_command(cfg, run_uri: str, iteration: int, role: str) -> list[str]:
    """torchrun with the node count and processes per node of the config, the node rank and master from
    the operator's environment (PET_* where the operator sets them, else RANK / MASTER_*)."""
    worker = " ".join(shlex.quote(arg) for arg in ["-m", WORKER_MODULE, *worker_args(run_uri, iteration, role)])
    script = (f"exec torchrun --nnodes={int(cfg.trainer.nnodes)} --nproc-per-node={int(cfg.trainer.n_gpus_per_node)} "
              '--node-rank="${PET_NODE_RANK:-${RANK:-0}}" --master-addr="${PET_MASTER_ADDR:-$MASTER_ADDR}" '
              f'--master-port="${{PET_MASTER_PORT:-$MASTER_PORT}}" {worker}')
    return ["/bin/sh", "-c", script]


def pytorchjob_manifest(cfg, run_uri: str, iteration: int, role: str, name: str, *,
                        namespace: str | None = None) -> dict:
    """A training-operator PyTorchJob running the update worker: Master ×1 + Worker ×(nnodes - 1)."""
    cluster = cfg.cluster
    metadata = _metadata(run_uri, iteration, role, name, namespace)
    volumes, mounts = shm_volume(cluster)
    container = {
        "name": PYTORCHJOB_CONTAINER,
        "image": cluster.image,
        "command": pytorchjob_command(cfg, run_uri, iteration, role),
        "env": secret_env(cluster),
        "ports": [{"name": PYTORCHJOB_PORT_NAME, "containerPort": PYTORCHJOB_PORT}],
    }
    resources = gpu_resources(cfg)
    if resources:
        container["resources"] = resources
    if mounts:
        container["volumeMounts"] = mounts
    pod: dict = {"containers": [container]}
    if volumes:
        pod["volumes"] = volumes
    if node_selector(cluster):
        pod["nodeSelector"] = node_selector(cluster)
    if pod_tolerations(cluster):
        pod["tolerations"] = pod_tolerations(cluster)

    def replica(count: int) -> dict:
        # Never: a failed process fails the job (torchrun's static rendezvous cannot take one node back).
        return {"replicas": count, "restartPolicy": "Never",
                "template": {"metadata": {"labels": dict(metadata["labels"])}, "spec": pod}}

    replicas = {"Master": replica(1)}
    if cfg.trainer.nnodes > 1:
        replicas["Worker"] = replica(int(cfg.trainer.nnodes) - 1)
    return {"apiVersion": KINDS["pytorchjob"].api_version, "kind": "PyTorchJob", "metadata": metadata,
            "spec": {"nprocPerNode": str(int(cfg.trainer.n_gpus_per_node)),
                     # Pods stay after the job ends, for `kubectl logs`.
                     "runPolicy": {"cleanPodPolicy": "None"},
                     "pytorchReplicaSpecs": replicas}}


# --- the Kubernetes API -----------------------------------------------------------------------------

def custom_objects_api(configuration=None):
    """A CustomObjectsApi from ``configuration``, else the in-cluster service account, else kubeconfig."""
    from kubernetes import client

    if configuration is None:
        try:
            configuration = api_configuration()
        except KubernetesUnavailable as err:
            raise MultiNodeError(f"{err}: cannot submit the multi-node update") from err
    return client.CustomObjectsApi(client.ApiClient(configuration))


def job_namespace(cfg) -> str:
    return workload_namespace(cfg)


def _api_message(err) -> str:
    import json

    try:
        return json.loads(err.body).get("message") or str(err.reason)
    except (TypeError, ValueError, AttributeError):
        return str(getattr(err, "body", "") or getattr(err, "reason", "") or err)


def _explain(err, kind: JobKind, namespace: str, name: str) -> str:
    status, message = getattr(err, "status", None), _api_message(err)
    where = f"{kind.kind} {namespace}/{name}"
    if status == 404:
        return (f"{where}: the API server has no {kind.resource} ({message}). Install "
                + ("Kubeflow Trainer v2 with the ClusterTrainingRuntime named in cluster.multi_node_runtime"
                   if kind.kind == "TrainJob" else "the Kubeflow training operator")
                + ", or pick the other cluster.multi_node (trainjob | pytorchjob); and check that namespace "
                f"{namespace} exists (pipeline.namespace)")
    if status == 403:
        return (f"{where}: forbidden ({message}). The service account of this pipeline task needs a Role allowing "
                f"create and get on {kind.resource} in namespace {namespace} (docs/operations.md, Multi-node updates)")
    return f"{where}: Kubernetes API error {status} {getattr(err, 'reason', '')}: {message}"


def _unknown_field(err, field: str) -> bool:
    """The server rejected ``field`` under strict field validation (this Trainer release lacks it)."""
    text = str(getattr(err, "body", "") or "")
    return getattr(err, "status", None) in (400, 422) and "unknown field" in text and field in text


def _conditions(obj: dict) -> list[dict]:
    return list(((obj or {}).get("status") or {}).get("conditions") or [])


def _true(obj: dict, condition: str) -> dict | None:
    return next((c for c in _conditions(obj) if c.get("type") == condition and c.get("status") == "True"), None)


def _progress(obj: dict) -> str:
    """One line of the job's state: its true conditions, and the TrainJob's child jobs."""
    status = (obj or {}).get("status") or {}
    parts = [c.get("type", "?") + (f" ({c['reason']})" if c.get("reason") else "")
             for c in _conditions(obj) if c.get("status") == "True"]
    for job in status.get("jobsStatus") or []:
        counts = ", ".join(f"{key} {job.get(key, 0)}" for key in ("active", "ready", "succeeded", "failed"))
        parts.append(f"{job.get('name', '?')}: {counts}")
    for replica, counts in sorted((status.get("replicaStatuses") or {}).items()):
        parts.append(f"{replica}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if isinstance(v, int)))
    return "; ".join(parts) or "submitted, no status yet"


def _hints(kind: JobKind, namespace: str, name: str) -> str:
    return (f"logs: kubectl logs -n {namespace} -l {kind.pod_selector}={name} --all-containers --prefix --tail=200; "
            f"details: kubectl describe {kind.plural} {name} -n {namespace}; "
            f"to let a retry run it again: kubectl delete {kind.plural} {name} -n {namespace}")


def submit_job(api, kind: JobKind, namespace: str, bodies: list[dict], run_uri: str, log) -> dict:
    """Create the job from the first body the server accepts (the bodies differ only in the TrainJob's
    override field); on 409 attach to the job of that name. Returns the job as the server has it."""
    name = bodies[0]["metadata"]["name"]
    for index, body in enumerate(bodies):
        try:
            created = api.create_namespaced_custom_object(kind.group, kind.version, namespace, kind.plural, body,
                                                          field_validation="Strict")
        except Exception as err:  # noqa: BLE001 - kubernetes.client.ApiException, sorted below
            status = getattr(err, "status", None)
            if status == 409:
                return _attach(api, kind, namespace, name, run_uri, log)
            if status is None:
                raise MultiNodeError(f"{kind.kind} {namespace}/{name}: cannot reach the Kubernetes API: "
                                     f"{type(err).__name__}: {err}") from err
            field = next((f for f in OVERRIDE_FIELDS if f in body["spec"]), None)
            if index + 1 < len(bodies) and field and _unknown_field(err, field):
                log(f"{kind.kind}: this Kubeflow Trainer release does not know spec.{field}; trying the other "
                    "override field")
                continue
            raise MultiNodeError(_explain(err, kind, namespace, name)) from err
        log(f"submitted {kind.kind} {namespace}/{name} ({kind.api_version})")
        return created
    raise AssertionError("unreachable: the last body either returns or raises")  # pragma: no cover


def _attach(api, kind: JobKind, namespace: str, name: str, run_uri: str, log) -> dict:
    try:
        existing = api.get_namespaced_custom_object(kind.group, kind.version, namespace, kind.plural, name)
    except Exception as err:  # noqa: BLE001
        raise MultiNodeError(_explain(err, kind, namespace, name)) from err
    owner = ((existing.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_RUN_URI)
    if owner and owner != run_uri:
        raise MultiNodeError(f"{kind.kind} {namespace}/{name} exists but belongs to run {owner}, not {run_uri}; "
                             f"delete it (kubectl delete {kind.plural} {name} -n {namespace}) and retry")
    log(f"{kind.kind} {namespace}/{name} exists already (a retried task): attaching to it")
    return existing


def wait_for_job(api, kind: JobKind, namespace: str, name: str, *, timeout_s: float, poll_s: float, log,
                 heartbeat_s: float = 300.0) -> dict:
    """Poll the job until its success condition (TrainJob Complete, PyTorchJob Succeeded) or Failed;
    print its state whenever it changes. Raises MultiNodeError on Failed, deletion or timeout."""
    started = time.monotonic()
    last, last_print, errors = None, started, 0
    while True:
        try:
            job = api.get_namespaced_custom_object(kind.group, kind.version, namespace, kind.plural, name)
            errors = 0
        except Exception as err:  # noqa: BLE001 - a blip of the API server is retried a few times
            status = getattr(err, "status", None)
            if status == 404:
                raise MultiNodeError(f"{kind.kind} {namespace}/{name} was deleted while the update waited for it; "
                                     "retry the task to submit it again") from err
            errors += 1
            if (status is not None and status < 500) or errors > 5:
                raise MultiNodeError(_explain(err, kind, namespace, name)) from err
            log(f"{kind.kind} {namespace}/{name}: reading its status failed ({type(err).__name__}); retrying")
            job = None
        if job is not None:
            state = _progress(job)
            now = time.monotonic()
            if state != last or now - last_print >= heartbeat_s:
                log(f"{kind.kind} {namespace}/{name} after {now - started:.0f} s: {state}")
                last, last_print = state, now
            failed = _true(job, "Failed")
            if failed:
                raise MultiNodeError(
                    f"{kind.kind} {namespace}/{name} failed ({failed.get('reason') or 'no reason'}: "
                    f"{(failed.get('message') or '').strip() or 'no message'}); " + _hints(kind, namespace, name))
            if _true(job, kind.succeeded):
                return job
        if time.monotonic() - started > timeout_s:
            raise MultiNodeError(f"{kind.kind} {namespace}/{name} did not finish within {timeout_s:.0f} s "
                                 f"(last state: {last or 'unknown'}); it keeps running and a retried task attaches "
                                 "to it; " + _hints(kind, namespace, name))
        time.sleep(poll_s)


def run_multinode_update(ctx, role_name: str, *, api=None, poll_s: float = 10.0, timeout_s: float | None = None,
                         log=None):
    """The update of ``role_name`` (actor | critic) at ``ctx.iteration`` as a multi-node job: submit (or
    attach to) the job, wait for it, and return the stage's manifest, which the job's rank 0 committed.
    ``timeout_s`` defaults to ``pipeline.run_timeout_s``; ``api`` to ``custom_objects_api()``."""
    if role_name not in ROLE_STAGES:
        raise ValueError(f"role must be one of {', '.join(ROLE_STAGES)}, got {role_name!r}")
    log = log or (lambda line: print(f"[kfrl] {line}", flush=True))
    cfg = ctx.config
    stage = ROLE_STAGES[role_name]
    prefix = stage_prefix(ctx.iteration, stage)
    committed = ctx.store.manifest(prefix)
    if committed is not None:
        log(f"iteration {ctx.iteration} {stage}: already committed; no job submitted")
        return committed
    kind = KINDS[cfg.cluster.multi_node]
    name = job_name(ctx.run_uri, ctx.iteration, role_name)
    namespace = job_namespace(cfg)
    if kind.kind == "TrainJob":
        bodies = [trainjob_manifest(cfg, ctx.run_uri, ctx.iteration, role_name, name, namespace=namespace,
                                    overrides_field=field) for field in OVERRIDE_FIELDS]
        if not any(field in bodies[0]["spec"] for field in OVERRIDE_FIELDS):
            bodies = bodies[:1]  # nothing to place: one body fits every Trainer release
    else:
        bodies = [pytorchjob_manifest(cfg, ctx.run_uri, ctx.iteration, role_name, name, namespace=namespace)]
    api = api or custom_objects_api()
    log(f"iteration {ctx.iteration} {stage}: {cfg.trainer.nnodes} nodes x {cfg.trainer.n_gpus_per_node} "
        f"processes as {kind.kind} {namespace}/{name}")
    submit_job(api, kind, namespace, bodies, ctx.run_uri, log)
    wait_for_job(api, kind, namespace, name, timeout_s=float(timeout_s or cfg.pipeline.run_timeout_s),
                 poll_s=poll_s, log=log)
    manifest = ctx.store.manifest(prefix)
    if manifest is None:
        raise MultiNodeError(
            f"{kind.kind} {namespace}/{name} succeeded but iteration {ctx.iteration} {stage} is not committed "
            f"({ctx.store.manifest_url(prefix)} is missing): its rank 0 should have committed it; "
            + _hints(kind, namespace, name))
    log(f"iteration {ctx.iteration} {stage}: committed by {kind.kind} {namespace}/{name} ({manifest.attempt})")
    return manifest
