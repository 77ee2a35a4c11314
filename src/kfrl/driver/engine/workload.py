"""The run's engine on Kubernetes: what the cluster driver creates when ``pipeline.runner=kfp`` and
``pipeline.engines=resident``.

Four objects per run, all labelled ``kfrl.run=<run id>`` and ``kfrl.component=engine`` (and
``kfrl.kfp-run=<KFP run id>`` when the driver is a KFP task, for ``rl_train``'s exit handler), and
owned by the driver's pod when it runs in one, so Kubernetes deletes them with it:

- a Secret holding the run's engine token (made here, per run; the engine and the iteration tasks
  read it as ``KFRL_ENGINE_TOKEN``; it never appears in an argument, a parameter or a log);
- the engine Pod: the GPU image, ``cluster.gpu_stages`` resources, the GPU tasks' placement, the
  credentials secret, ``kfrl engine serve`` with a readiness probe on ``/health``; ``restartPolicy``
  Never: the driver replaces a pod that died, and the run resumes from the store as always;
- a Service in front of it (the URL the engine advertises in the run's ``ENGINE.json``);
- a NetworkPolicy: only the run's own task pods (label ``kfrl.run``) reach the engine's port.

The manifests are plain dicts (``engine_manifests``), validated against Kubernetes' schemas in the
tests; ``EngineWorkload`` creates, watches, replaces and deletes them through the official client.
"""
from __future__ import annotations

import base64
import os
import re
import secrets
import time
from dataclasses import dataclass, field

from kfrl.kube import (gpu_resources, label_value, node_selector, pod_tolerations, secret_env, shm_volume)

ENGINE_PORT = 8000
LABEL_RUN, LABEL_COMPONENT, LABEL_KFP_RUN = "kfrl.run", "kfrl.component", "kfrl.kfp-run"
ANNOTATION_RUN_URI = "kfrl.run-uri"
COMPONENT = "engine"
CONTAINER = "engine"
TOKEN_KEY = "KFRL_ENGINE_TOKEN"
# The driver's pod, from the downward API of rl_train's driver task: the engine's owner.
POD_NAME_VARIABLE, POD_UID_VARIABLE, KFP_RUN_VARIABLE = "KFRL_POD_NAME", "KFRL_POD_UID", "KFRL_KFP_RUN_ID"
# A deleted engine finishes the trainer state it is writing before it exits (SIGTERM: uvicorn stops,
# then the engine drains its writes): minutes for a 7B state.
TERMINATION_GRACE_S = 600


class EngineWorkloadError(RuntimeError):
    """The engine could not be created or did not become ready; the message says what to do."""


def engine_name(run_id: str) -> str:
    """``kfrl-engine-<run id>``: a DNS-1035 label (Service names must start with a letter) of at most 63
    characters; a run id that is not one already is shortened and a hash of it added."""
    import hashlib

    slug = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", run_id.lower())).strip("-")
    if slug == run_id and len(f"kfrl-engine-{slug}") <= 63:
        return f"kfrl-engine-{slug}"
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:8]
    short = slug[:63 - len("kfrl-engine--") - len(digest)].rstrip("-")
    return f"kfrl-engine-{short}-{digest}" if short else f"kfrl-engine-{digest}"


@dataclass(frozen=True)
class EngineBinding:
    """What the iteration tasks of a run with a cluster engine carry: the token's secret and the run's
    label (the NetworkPolicy admits pods that have it)."""
    secret_name: str
    run_label: str

    @classmethod
    def for_run(cls, run_id: str) -> "EngineBinding":
        return cls(secret_name=engine_name(run_id), run_label=label_value(run_id))


def owner_reference(environ=os.environ) -> dict | None:
    """The driver's pod as an owner (``KFRL_POD_NAME`` and ``KFRL_POD_UID`` from the downward API), or
    None outside a pod: then the driver's own exit and rl_train's exit handler delete the engine."""
    name, uid = environ.get(POD_NAME_VARIABLE, ""), environ.get(POD_UID_VARIABLE, "")
    if not (name and uid):
        return None
    # Not blockOwnerDeletion: that needs update rights on the owner pod's finalizers, which the
    # pipeline runner does not have (and need not).
    return {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid}


def _metadata(name: str, namespace: str, labels: dict, owner: dict | None, run_uri: str) -> dict:
    metadata = {"name": name, "namespace": namespace, "labels": dict(labels),
                "annotations": {ANNOTATION_RUN_URI: run_uri}}
    if owner is not None:
        metadata["ownerReferences"] = [dict(owner)]
    return metadata


def engine_labels(run_id: str, kfp_run_id: str = "") -> dict:
    labels = {LABEL_RUN: label_value(run_id), LABEL_COMPONENT: COMPONENT}
    if kfp_run_id:
        labels[LABEL_KFP_RUN] = label_value(kfp_run_id)
    return labels


def engine_manifests(config, run_uri: str, run_id: str, *, namespace: str, token: str, owner: dict | None = None,
                     kfp_run_id: str = "", port: int = ENGINE_PORT,
                     metrics_run: tuple[str, str] | None = None) -> dict[str, dict]:
    """The run's engine as Kubernetes objects: {"secret", "service", "network_policy", "pod"}.
    ``metrics_run``: (MLflow run id, tracking URI) the engine logs its system metrics into."""
    name = engine_name(run_id)
    labels = engine_labels(run_id, kfp_run_id)
    selector = {LABEL_RUN: labels[LABEL_RUN], LABEL_COMPONENT: COMPONENT}
    cluster = config.cluster
    secret = {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": _metadata(name, namespace, labels, owner, run_uri),
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _metadata(name, namespace, labels, owner, run_uri),
        "spec": {"type": "ClusterIP", "selector": selector,
                 "ports": [{"name": "http", "port": port, "targetPort": port, "protocol": "TCP"}]},
    }
    network_policy = {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": _metadata(name, namespace, labels, owner, run_uri),
        "spec": {"podSelector": {"matchLabels": selector}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"podSelector": {"matchLabels": {LABEL_RUN: labels[LABEL_RUN]}}}],
                              "ports": [{"protocol": "TCP", "port": port}]}]},
    }
    env = secret_env(cluster) + [
        {"name": TOKEN_KEY, "valueFrom": {"secretKeyRef": {"name": name, "key": TOKEN_KEY}}},
        {"name": "KFRL_ENGINE_POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    if metrics_run is not None:  # (MLflow run id, tracking URI): credentials come from the secret, never here
        from kfrl.driver.engine.client import METRICS_RUN_VARIABLE
        from kfrl.redaction import without_userinfo

        env += [{"name": METRICS_RUN_VARIABLE, "value": metrics_run[0]},
                {"name": "MLFLOW_TRACKING_URI", "value": without_userinfo(metrics_run[1])}]
    volumes, mounts = shm_volume(cluster)
    container = {
        "name": CONTAINER, "image": cluster.image, "imagePullPolicy": cluster.image_pull_policy,
        "command": ["kfrl", "engine", "serve", "--run-uri", run_uri, "--host", "0.0.0.0", "--port", str(port),
                    "--advertise", f"http://{name}.{namespace}.svc:{port}"],
        "env": env,
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        # Ready = serving this run; tasks wait for it through the Service. Liveness is generous: a stage
        # holds the GIL for long stretches, and a killed engine costs a reload.
        "readinessProbe": {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 5, "timeoutSeconds": 3,
                           "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/health", "port": port}, "initialDelaySeconds": 30,
                          "periodSeconds": 30, "timeoutSeconds": 10, "failureThreshold": 10},
        "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    resources = gpu_resources(config)
    if resources:
        container["resources"] = resources
    if mounts:
        container["volumeMounts"] = mounts
    pod_spec = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "automountServiceAccountToken": False,  # the engine never calls the Kubernetes API
        "containers": [container],
    }
    if volumes:
        pod_spec["volumes"] = volumes
    if node_selector(cluster):
        pod_spec["nodeSelector"] = node_selector(cluster)
    if pod_tolerations(cluster):
        pod_spec["tolerations"] = pod_tolerations(cluster)
    if cluster.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": secret_name} for secret_name in cluster.image_pull_secrets]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": _metadata(name, namespace, labels, owner, run_uri),
           "spec": pod_spec}
    return {"secret": secret, "service": service, "network_policy": network_policy, "pod": pod}


def _conditions(pod) -> dict:
    return {c.type: c.status for c in (pod.status.conditions or [])} if pod.status else {}


def pod_problem(pod) -> str:
    """Why the engine pod cannot serve ("" while it may still become ready): it ended, or a container
    cannot start (image pull, bad command)."""
    status = pod.status
    if status is None:
        return ""
    if pod.metadata.deletion_timestamp is not None:
        return "it is being deleted"
    if status.phase in ("Failed", "Succeeded"):
        detail = ""
        for container in status.container_statuses or []:
            terminated = container.state.terminated if container.state else None
            if terminated is not None:
                detail = f": container exited with code {terminated.exit_code}" + \
                    (f" ({terminated.reason})" if terminated.reason else "") + \
                    (f", {terminated.message.strip()[:300]}" if terminated.message else "")
        return f"the pod ended ({status.phase}{detail})"
    for container in status.container_statuses or []:
        waiting = container.state.waiting if container.state else None
        if waiting is not None and waiting.reason in ("ErrImagePull", "ImagePullBackOff", "InvalidImageName",
                                                       "CreateContainerConfigError", "CreateContainerError",
                                                       "CrashLoopBackOff"):
            return f"its container cannot start ({waiting.reason}: {(waiting.message or '').strip()[:300]})"
    return ""


@dataclass
class EngineWorkload:
    """The run's engine on Kubernetes, driven by the cluster driver: ``start`` creates it and waits
    until it serves; ``alive`` / ``restart`` replace a pod that died; ``stop`` deletes all of it.
    The same interface as the local driver's ``EngineProcess``."""
    config: object
    run_uri: str
    run_id: str
    namespace: str
    core: object = None            # kubernetes.client.CoreV1Api
    networking: object = None      # kubernetes.client.NetworkingV1Api
    owner: dict | None = None
    kfp_run_id: str = ""
    port: int = ENGINE_PORT
    ready_timeout_s: float = 900.0  # image pull and scheduling on a GPU node take minutes
    poll_s: float = 2.0
    log: object = print
    restarts: int = 0
    metrics_run: tuple[str, str] | None = None  # (MLflow run id, tracking URI) for the engine's system metrics
    token: str = field(default_factory=lambda: secrets.token_urlsafe(32))

    @property
    def name(self) -> str:
        return engine_name(self.run_id)

    @property
    def url(self) -> str:
        return f"http://{self.name}.{self.namespace}.svc:{self.port}"

    @property
    def selector(self) -> str:
        return f"{LABEL_RUN}={label_value(self.run_id)},{LABEL_COMPONENT}={COMPONENT}"

    def manifests(self) -> dict[str, dict]:
        return engine_manifests(self.config, self.run_uri, self.run_id, namespace=self.namespace, token=self.token,
                                owner=self.owner, kfp_run_id=self.kfp_run_id, port=self.port,
                                metrics_run=self.metrics_run)

    def start(self) -> "EngineWorkload":
        """Create the run's engine and wait until it serves. A driver that starts again (a retried task,
        a resumed run) finds its earlier objects: the token secret gets this attempt's token, and an
        engine pod left from before is deleted first (given its grace period to finish the trainer
        state it was writing), since it holds the old token."""
        from kubernetes.client.exceptions import ApiException

        manifests = self.manifests()
        try:
            self.core.create_namespaced_secret(self.namespace, manifests["secret"])
        except ApiException as err:
            if err.status != 409:
                raise EngineWorkloadError(self._explain(err, "create the engine's token secret"))
            try:
                self.core.replace_namespaced_secret(self.name, self.namespace, manifests["secret"])
            except ApiException as again:
                raise EngineWorkloadError(self._explain(again, "replace the engine's token secret"))
        for kind, create in (("service", self.core.create_namespaced_service),
                             ("network policy", self.networking.create_namespaced_network_policy)):
            try:
                create(self.namespace, manifests[kind.replace(" ", "_")])
            except ApiException as err:
                if err.status != 409:  # 409: there from an earlier attempt of this run, the same
                    raise EngineWorkloadError(self._explain(err, f"create the engine's {kind}"))
        if self._pod() is not None:
            self.log(f"engine pod {self.name} is left from an earlier attempt; replacing it")
            self._delete_pod(wait_s=TERMINATION_GRACE_S + 30)
        self._create_pod(manifests["pod"])
        self.wait_ready()
        return self

    def _create_pod(self, manifest: dict) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.create_namespaced_pod(self.namespace, manifest)
        except ApiException as err:
            raise EngineWorkloadError(self._explain(err, "create the engine pod")) from err

    def _pod(self):
        from kubernetes.client.exceptions import ApiException

        try:
            return self.core.read_namespaced_pod(self.name, self.namespace)
        except ApiException as err:
            if err.status == 404:
                return None
            raise EngineWorkloadError(self._explain(err, "read the engine pod"))

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        phase = ""
        while True:
            pod = self._pod()
            if pod is None:
                raise EngineWorkloadError(f"the engine pod {self.namespace}/{self.name} disappeared while starting")
            problem = pod_problem(pod)
            if problem:
                raise EngineWorkloadError(f"the engine pod {self.namespace}/{self.name} did not start: {problem}; "
                                          f"see `kubectl logs -n {self.namespace} {self.name}`")
            if _conditions(pod).get("Ready") == "True":
                return
            if pod.status and pod.status.phase != phase:
                phase = pod.status.phase
                self.log(f"engine pod {self.name}: {phase}")
            if time.monotonic() > deadline:
                raise EngineWorkloadError(
                    f"the engine pod {self.namespace}/{self.name} was not ready within {self.ready_timeout_s:.0f}s "
                    f"(phase {phase}); see `kubectl describe pod -n {self.namespace} {self.name}`")
            time.sleep(self.poll_s)

    def alive(self) -> bool:
        """Whether the engine pod exists, is not ending and serves (Ready)."""
        pod = self._pod()
        return pod is not None and not pod_problem(pod) and _conditions(pod).get("Ready") == "True"

    def restart(self) -> None:
        """Replace a dead engine pod (the secret, service and policy stay); the run's stages resume from
        the store: the new engine loads the committed weights and trainer state."""
        pod = self._pod()
        why = pod_problem(pod) if pod is not None else "the pod is gone"
        self.restarts += 1
        self.log(f"engine pod {self.name}: {why or 'not ready'}; replacing it (restart {self.restarts})")
        self._delete_pod(grace_s=0)
        self._create_pod(self.manifests()["pod"])
        self.wait_ready()

    def _delete_pod(self, grace_s: int | None = None, wait_s: float = 60.0) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.delete_namespaced_pod(self.name, self.namespace, grace_period_seconds=grace_s)
        except ApiException as err:
            if err.status != 404:
                raise EngineWorkloadError(self._explain(err, "delete the engine pod"))
        deadline = time.monotonic() + wait_s
        while self._pod() is not None and time.monotonic() < deadline:
            time.sleep(min(self.poll_s, 0.5))

    def stop(self, wait_s: float = TERMINATION_GRACE_S + 30) -> None:
        """Delete the run's engine: the pod gets its grace period to finish the trainer state it is
        writing (the driver waits for that), then the secret, service and policy go."""
        self._delete_pod(wait_s=wait_s)
        delete_engine_objects(self.core, self.networking, self.namespace, self.selector, log=self.log)

    def _explain(self, err, what: str) -> str:
        return explain_api_error(err, what, self.namespace)


def delete_engine_objects(core, networking, namespace: str, selector: str, log=print) -> None:
    """Delete every engine object matching ``selector`` (pods, services, policies, secrets), by label:
    what a driver's end and rl_train's exit handler both call. Deleting what is already gone is fine,
    and it needs no right to read secrets (``deletecollection`` only)."""
    from kubernetes.client.exceptions import ApiException

    for kind, delete in (("pods", core.delete_collection_namespaced_pod),
                         ("services", core.delete_collection_namespaced_service),
                         ("network policies", networking.delete_collection_namespaced_network_policy),
                         ("secrets", core.delete_collection_namespaced_secret)):
        try:
            delete(namespace, label_selector=selector)
        except ApiException as err:
            if err.status != 404:
                raise EngineWorkloadError(explain_api_error(err, f"delete the engine's {kind}", namespace)) from err
    log(f"deleted the engine objects labelled {selector} in {namespace}")


def explain_api_error(err, what: str, namespace: str) -> str:
    import json

    try:
        message = json.loads(err.body).get("message", "")
    except (TypeError, ValueError, AttributeError):
        message = str(err.reason or "")
    hint = ""
    if err.status == 403:
        hint = (" The pipeline runner's service account needs the engine's RBAC in this namespace "
                "(infra/terraform: kfrl_engine role), or set pipeline.engines=per_task.")
    return f"could not {what} in namespace {namespace}: HTTP {err.status} {message}.{hint}"


def kubernetes_apis(configuration=None) -> tuple:
    """(CoreV1Api, NetworkingV1Api) with ``configuration``, else the pod's service account or kubeconfig."""
    from kubernetes import client

    from kfrl.kube import api_configuration

    api = client.ApiClient(configuration or api_configuration())
    return client.CoreV1Api(api), client.NetworkingV1Api(api)


def cluster_engine(config, run_uri: str, run_id: str, *, log=print, configuration=None,
                   metrics_run: tuple[str, str] | None = None) -> EngineWorkload:
    """The run's engine workload as the cluster driver creates it: the namespace where the pipeline
    runs, owned by the driver's pod, labelled with the KFP run that drives it."""
    from kfrl.kube import workload_namespace

    core, networking = kubernetes_apis(configuration)
    return EngineWorkload(config=config, run_uri=run_uri, run_id=run_id, namespace=workload_namespace(config),
                          core=core, networking=networking, owner=owner_reference(),
                          kfp_run_id=os.environ.get(KFP_RUN_VARIABLE, ""), log=log, metrics_run=metrics_run)


def delete_for_kfp_run(kfp_run_id: str, namespace: str = "", configuration=None) -> str:
    """rl_train's exit handler: delete the engine objects of the runs this KFP run drove (the driver
    deletes them itself when it ends; this catches a driver that was killed or cancelled)."""
    from kfrl.kube import workload_namespace

    if not namespace:
        from kfrl.config import Config

        namespace = workload_namespace(Config())
    core, networking = kubernetes_apis(configuration)
    selector = f"{LABEL_KFP_RUN}={label_value(kfp_run_id)},{LABEL_COMPONENT}={COMPONENT}"
    delete_engine_objects(core, networking, namespace, selector)
    return selector


__all__ = ["EngineBinding", "EngineWorkload", "EngineWorkloadError", "cluster_engine", "delete_for_kfp_run",
           "engine_manifests", "engine_name"]
