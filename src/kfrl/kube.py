"""Kubernetes objects kfrl creates (the run's engine, multi-node update jobs): how a pod is shaped
from the config's ``cluster`` section, and how the API is reached. Plain dicts in the API's JSON form,
so every manifest can be validated against Kubernetes' schemas and read in a test."""
from __future__ import annotations

import os
import re

DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
GKE_ACCELERATOR_LABEL = "cloud.google.com/gke-accelerator"
SHM_VOLUME = "dshm"
SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class KubernetesUnavailable(RuntimeError):
    """No credentials for the Kubernetes API: not in a pod with a service account, no usable kubeconfig."""


def api_configuration():
    """The client configuration: the in-cluster service account, else kubeconfig ($KUBECONFIG, else
    ~/.kube/config)."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        try:
            # $KUBECONFIG as it is now (the client reads it once, when imported)
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None,
                                    client_configuration=configuration)
        except (config.ConfigException, OSError, TypeError) as err:
            raise KubernetesUnavailable(f"no Kubernetes credentials: not in a pod with a service account, and no "
                                        f"usable kubeconfig ({err})") from err
    return configuration


def gpus_per_node(cfg) -> int:
    """Accelerators per GPU pod: one per process (``trainer.n_gpus_per_node``) unless ``trainer.device``
    is cpu; ``cluster.gpu_stages.gpus`` may ask for more. The KFP GPU tasks use the same rule."""
    asked = cfg.cluster.gpu_stages.gpus
    return asked if cfg.trainer.device == "cpu" else max(asked, cfg.trainer.n_gpus_per_node)


def gpu_resource(cluster) -> str:
    """The extended resource to ask for: ``cluster.gpu_stages.accelerator`` when it is a resource name
    (``nvidia.com/gpu``, ``amd.com/gpu``), else nvidia.com/gpu (a GKE accelerator type then selects the
    nodes, see ``node_selector``)."""
    accelerator = cluster.gpu_stages.accelerator
    return accelerator if "/" in accelerator else DEFAULT_GPU_RESOURCE


def label_value(text: str) -> str:
    value = re.sub(r"[^A-Za-z0-9_.-]", "-", text)[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)


def secret_env(cluster) -> list[dict]:
    """The credentials secret's keys as environment variables (optional: keys missing from the secret
    are skipped, as in the KFP tasks), and unbuffered output for live logs."""
    env = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    if cluster.secret:
        env += [{"name": key, "valueFrom": {"secretKeyRef": {"name": cluster.secret, "key": key, "optional": True}}}
                for key in cluster.secret_keys]
    return env


def gpu_resources(cfg) -> dict:
    """Requests = limits per node: the GPUs, and ``cluster.gpu_stages`` cpu/memory."""
    stages = cfg.cluster.gpu_stages
    limits = {}
    gpus = gpus_per_node(cfg)
    if gpus:
        limits[gpu_resource(cfg.cluster)] = str(gpus)
    if stages.cpu:
        limits["cpu"] = stages.cpu
    if stages.memory:
        limits["memory"] = stages.memory
    return {"requests": dict(limits), "limits": limits} if limits else {}


def node_selector(cluster) -> dict:
    selector = dict(cluster.node_selector)
    accelerator = cluster.gpu_stages.accelerator
    if accelerator and "/" not in accelerator:  # a GKE accelerator type, e.g. nvidia-h100-80gb
        selector.setdefault(GKE_ACCELERATOR_LABEL, accelerator)
    return selector


def pod_tolerations(cluster) -> list[dict]:
    out = []
    for toleration in cluster.tolerations:
        entry = {"operator": toleration.operator}
        for key in ("key", "value", "effect"):
            if getattr(toleration, key):
                entry[key] = getattr(toleration, key)
        out.append(entry)
    return out


def shm_volume(cluster) -> tuple[list[dict], list[dict]]:
    """(volumes, volume mounts) of a memory-backed /dev/shm of ``cluster.shm_size`` (NCCL needs it)."""
    if not cluster.shm_size:
        return [], []
    return ([{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": cluster.shm_size}}],
            [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}])


def workload_namespace(cfg) -> str:
    """``pipeline.namespace``, else $KF_PIPELINES_NAMESPACE, else the namespace of this pod (where the
    pipeline runs), else the kubeconfig context's, else ``default``."""
    if cfg.pipeline.namespace:
        return cfg.pipeline.namespace
    if os.environ.get("KF_PIPELINES_NAMESPACE"):
        return os.environ["KF_PIPELINES_NAMESPACE"]
    try:
        with open(SA_NAMESPACE_FILE) as fh:
            namespace = fh.read().strip()
        if namespace:
            return namespace
    except OSError:
        pass
    try:
        from kubernetes import config

        _, active = config.list_kube_config_contexts(config_file=os.environ.get("KUBECONFIG") or None)
        return (active or {}).get("context", {}).get("namespace") or "default"
    except Exception:  # noqa: BLE001 - no kubeconfig: the default namespace
        return "default"


def own_pod_image(cfg, environ=os.environ) -> tuple[str, str] | None:
    """(image, imageID) of this pod's first container as the kubelet reports it (``imageID`` names the
    digest the node runs, whatever tag the spec asked for); the pod from ``KFRL_POD_NAME`` (the downward
    API). None outside a pod, or when the API does not answer."""
    name = environ.get("KFRL_POD_NAME", "")
    if not name:
        return None
    try:
        from kubernetes import client

        api = client.CoreV1Api(client.ApiClient(api_configuration()))
        statuses = api.read_namespaced_pod(name, workload_namespace(cfg)).status.container_statuses or []
    except Exception:  # noqa: BLE001 - provenance is best effort: no credentials, no RBAC, no answer
        return None
    return (statuses[0].image or "", statuses[0].image_id or "") if statuses else None
