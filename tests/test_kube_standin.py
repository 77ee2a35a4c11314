"""The Kubernetes stand-in (tests/kube_standin.py) answers the official client as the real API server does.

Every check goes through the `kubernetes` client's own HTTP calls and deserializers, so a shape the client
cannot read, or a status code it treats differently, fails here rather than in the tests that rely on it.
"""
from __future__ import annotations

import base64
import json
import os
import socket
import sys
import time

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from kube_standin import StandIn

NS = "kubeflow"


@pytest.fixture()
def kube():
    with StandIn() as standin:
        yield standin


def apis(standin: StandIn) -> tuple[client.CoreV1Api, client.NetworkingV1Api]:
    api = client.ApiClient(client.Configuration(host=standin.url))
    return client.CoreV1Api(api), client.NetworkingV1Api(api)


def pod(name: str, labels: dict | None = None, owner_uid: str | None = None, **container) -> client.V1Pod:
    owners = [client.V1OwnerReference(api_version="v1", kind="Pod", name="owner", uid=owner_uid)] if owner_uid else None
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels=labels, owner_references=owners),
        spec=client.V1PodSpec(restart_policy="Never",
                              containers=[client.V1Container(name="main", image="python:3.11", **container)]))


def service(name: str, labels: dict, owner_uid: str | None = None) -> client.V1Service:
    owners = [client.V1OwnerReference(api_version="v1", kind="Pod", name="owner", uid=owner_uid)] if owner_uid else None
    return client.V1Service(metadata=client.V1ObjectMeta(name=name, labels=labels, owner_references=owners),
                             spec=client.V1ServiceSpec(selector=labels, ports=[client.V1ServicePort(port=8000)]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not true after {timeout}s: {predicate}")


def status_of(error: ApiException) -> dict:
    return json.loads(error.body)


def test_create_read_list_and_the_api_errors(kube):
    core, _ = apis(kube)
    secret = core.create_namespaced_secret(NS, client.V1Secret(
        metadata=client.V1ObjectMeta(name="creds"), string_data={"token": "s3cret"}))
    assert secret.data == {"token": base64.b64encode(b"s3cret").decode()} and secret.string_data is None
    assert secret.type == "Opaque"
    core.create_namespaced_secret(NS, client.V1Secret(metadata=client.V1ObjectMeta(name="scratch")))
    removed = core.delete_namespaced_secret("scratch", NS)  # secrets answer a Status, pods their object
    assert isinstance(removed, client.V1Status) and removed.status == "Success"

    created = core.create_namespaced_pod(NS, pod("worker-0", {"app": "rollout", "rank": "0"}))
    assert created.metadata.uid and created.metadata.namespace == NS and created.metadata.resource_version
    assert created.metadata.creation_timestamp is not None and created.kind == "Pod"
    core.create_namespaced_pod(NS, pod("worker-1", {"app": "rollout", "rank": "1"}))
    core.create_namespaced_pod(NS, pod("trainer", {"app": "train"}))

    read = core.read_namespaced_pod("worker-0", NS)
    assert (read.status.phase, read.metadata.uid, read.metadata.labels) == ("Pending", created.metadata.uid,
                                                                             {"app": "rollout", "rank": "0"})
    listed = core.list_namespaced_pod(NS, label_selector="app=rollout")
    assert isinstance(listed, client.V1PodList) and listed.kind == "PodList" and listed.metadata.resource_version
    assert [p.metadata.name for p in listed.items] == ["worker-0", "worker-1"]
    assert [p.metadata.name for p in core.list_namespaced_pod(NS, label_selector="app=rollout,rank!=0").items] \
        == ["worker-1"]
    assert core.list_namespaced_pod("other", label_selector="app=rollout").items == []

    with pytest.raises(ApiException) as dup:
        core.create_namespaced_pod(NS, pod("worker-0"))
    assert dup.value.status == 409
    assert status_of(dup.value) == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "code": 409,
        "reason": "AlreadyExists", "message": 'pods "worker-0" already exists',
        "details": {"name": "worker-0", "kind": "pods"}}
    with pytest.raises(ApiException) as missing:
        core.read_namespaced_pod("nope", NS)
    assert (missing.value.status, status_of(missing.value)["reason"]) == (404, "NotFound")
    with pytest.raises(ApiException) as nameless:
        core.create_namespaced_pod(NS, pod(None))
    assert (nameless.value.status, status_of(nameless.value)["reason"]) == (422, "Invalid")
    assert "metadata.name: Required value" in status_of(nameless.value)["message"]
    with pytest.raises(ApiException) as upper:
        core.create_namespaced_pod(NS, pod("Worker_0"))
    assert upper.value.status == 422 and "RFC 1123" in status_of(upper.value)["message"]


def test_pod_status_driven_by_the_test(kube):
    core, _ = apis(kube)
    core.create_namespaced_pod(NS, pod("w", {"app": "w"}))
    kube.set_pod_phase(NS, "w", "Running", ready=True)
    running = core.read_namespaced_pod("w", NS).status
    assert running.phase == "Running" and running.pod_ip == "127.0.0.1"
    assert {c.type: c.status for c in running.conditions}["Ready"] == "True"
    assert running.container_statuses[0].state.running.started_at is not None and running.container_statuses[0].ready

    kube.set_pod_phase(NS, "w", "Failed", ready=False, reason="OOMKilled", exit_code=137)
    failed = core.read_namespaced_pod("w", NS).status
    terminated = failed.container_statuses[0].state.terminated
    assert (failed.phase, terminated.exit_code, terminated.reason) == ("Failed", 137, "OOMKilled")
    assert {c.type: c.status for c in failed.conditions}["Ready"] == "False" and failed.reason is None

    kube.set_pod_phase(NS, "w", "Failed", False, reason="Evicted", message="The node was low on resource: memory.")
    assert core.read_namespaced_pod("w", NS).status.reason == "Evicted"
    kube.remove("pods", NS, "w")
    with pytest.raises(ApiException) as gone:
        core.read_namespaced_pod("w", NS)
    assert gone.value.status == 404


def test_delete_delete_collection_network_policy_and_garbage_collection(kube):
    core, net = apis(kube)
    owner = core.create_namespaced_pod(NS, pod("owner", {"app": "owner"}))
    other = core.create_namespaced_pod(NS, pod("other", {"app": "other"}))
    core.create_namespaced_service(NS, service("owned-svc", {"app": "owner"}, owner.metadata.uid))
    core.create_namespaced_service(NS, service("other-svc", {"app": "other"}, other.metadata.uid))
    policy = net.create_namespaced_network_policy(NS, client.V1NetworkPolicy(
        metadata=client.V1ObjectMeta(name="owned-np", owner_references=[client.V1OwnerReference(
            api_version="v1", kind="Pod", name="owner", uid=owner.metadata.uid)]),
        spec=client.V1NetworkPolicySpec(pod_selector=client.V1LabelSelector(match_labels={"app": "owner"}),
                                        policy_types=["Ingress"])))
    assert policy.kind == "NetworkPolicy" and policy.api_version == "networking.k8s.io/v1"

    deleted = core.delete_namespaced_pod("owner", NS, grace_period_seconds=0)
    assert isinstance(deleted, client.V1Pod) and deleted.metadata.uid == owner.metadata.uid
    assert [r for r in kube.requests if r.method == "DELETE"][-1].query == {"gracePeriodSeconds": "0"}
    # Dependents stay until the garbage collector runs, as in a real cluster between owner deletion and GC.
    assert {s["metadata"]["name"] for s in kube.objects("services")} == {"owned-svc", "other-svc"}
    assert sorted(kube.collect_garbage()) == [("networkpolicies", NS, "owned-np"), ("services", NS, "owned-svc")]
    assert net.list_namespaced_network_policy(NS).items == []

    with pytest.raises(ApiException) as missing:
        net.delete_namespaced_network_policy("owned-np", NS)
    assert status_of(missing.value)["message"] == 'networkpolicies.networking.k8s.io "owned-np" not found'
    gone = core.delete_collection_namespaced_service(NS, label_selector="app=other")
    assert gone.kind == "ServiceList"
    assert kube.objects("services") == []


def test_fail_next_answers_an_rbac_forbidden_once(kube):
    core, _ = apis(kube)
    message = ('pods is forbidden: User "system:serviceaccount:kubeflow:pipeline-runner" cannot create resource '
               '"pods" in API group "" in the namespace "kubeflow"')
    kube.fail_next("POST", "pods", 403, "Forbidden", message)
    with pytest.raises(ApiException) as denied:
        core.create_namespaced_pod(NS, pod("w"))
    assert denied.value.status == 403
    assert status_of(denied.value) == {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                       "message": message, "reason": "Forbidden", "code": 403,
                                       "details": {"kind": "pods"}}
    assert kube.objects("pods") == []
    core.create_namespaced_pod(NS, pod("w"))
    assert [(r.method, r.path) for r in kube.requests] == [("POST", f"/api/v1/namespaces/{NS}/pods")] * 2
    assert kube.requests[-1].body["metadata"]["name"] == "w"


# A tiny server: ready on /health, and it ignores SIGTERM so the kubelet must SIGKILL after the grace period.
SERVER = r"""
import http.server, os, signal
print("token", os.environ["TOKEN"], "pod", os.environ["POD_NAME"], "extra", os.environ["EXTRA"], flush=True)
print("pid", os.getpid(), flush=True)
signal.signal(signal.SIGTERM, lambda *_: print("got SIGTERM", flush=True))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *_):
        pass
http.server.HTTPServer(("127.0.0.1", int(os.environ["PORT"])), Health).serve_forever()
"""


def test_kubelet_runs_the_container_until_ready_then_terminates_it_on_delete():
    port = free_port()
    with StandIn(kubelet=True, env_extra={"EXTRA": "from-test"}) as kube:
        core, _ = apis(kube)
        core.create_namespaced_secret(NS, client.V1Secret(metadata=client.V1ObjectMeta(name="creds"),
                                                          string_data={"token": "s3cret"}))
        env = [client.V1EnvVar(name="PORT", value=str(port)),
               client.V1EnvVar(name="TOKEN", value_from=client.V1EnvVarSource(
                   secret_key_ref=client.V1SecretKeySelector(name="creds", key="token"))),
               client.V1EnvVar(name="POD_NAME", value_from=client.V1EnvVarSource(
                   field_ref=client.V1ObjectFieldSelector(field_path="metadata.name")))]
        body = pod("server", {"app": "server"}, command=[sys.executable, "-c"], args=[SERVER], env=env,
                   readiness_probe=client.V1Probe(http_get=client.V1HTTPGetAction(port=port, path="/health")))
        body.spec.termination_grace_period_seconds = 1
        core.create_namespaced_pod(NS, body)

        def ready():
            status = core.read_namespaced_pod("server", NS).status
            return status.phase == "Running" and {c.type: c.status for c in status.conditions}["Ready"] == "True"
        wait_for(ready)
        assert "token s3cret pod server extra from-test" in kube.pod_log(NS, "server")
        assert core.read_namespaced_pod_log("server", NS).startswith("token s3cret")
        pid = int(kube.pod_log(NS, "server").split("pid ")[1].split()[0])

        deleted = core.delete_namespaced_pod("server", NS)
        assert deleted.metadata.deletion_timestamp is not None and deleted.metadata.deletion_grace_period_seconds == 1
        assert core.read_namespaced_pod("server", NS).metadata.deletion_timestamp is not None  # still terminating

        def gone():
            try:
                core.read_namespaced_pod("server", NS)
            except ApiException as e:
                return e.status == 404
        wait_for(gone)
        assert "got SIGTERM" in kube.pod_log(NS, "server")  # then SIGKILL, since it ignored SIGTERM
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_kubelet_reports_exit_codes_config_errors_and_close_kills():
    with StandIn(kubelet=True) as kube:
        core, _ = apis(kube)
        core.create_namespaced_pod(NS, pod("ok", command=[sys.executable, "-c", "print('done')"]))
        core.create_namespaced_pod(NS, pod("bad", command=[sys.executable, "-c", "import sys; sys.exit(3)"]))
        core.create_namespaced_pod(NS, pod("nosecret", command=[sys.executable, "-c", "pass"], env=[
            client.V1EnvVar(name="T", value_from=client.V1EnvVarSource(
                secret_key_ref=client.V1SecretKeySelector(name="missing", key="k")))]))
        core.create_namespaced_pod(NS, pod("sleeper", command=[sys.executable, "-c", "import os, time\n"
                                                               "print(os.getpid(), flush=True); time.sleep(60)"]))
        ok = wait_for(lambda: (p := core.read_namespaced_pod("ok", NS).status).phase == "Succeeded" and p)
        assert ok.container_statuses[0].state.terminated.exit_code == 0 and kube.pod_log(NS, "ok") == "done\n"
        bad = wait_for(lambda: (p := core.read_namespaced_pod("bad", NS).status).phase == "Failed" and p)
        assert (bad.container_statuses[0].state.terminated.exit_code,
                bad.container_statuses[0].state.terminated.reason) == (3, "Error")
        waiting = core.read_namespaced_pod("nosecret", NS).status.container_statuses[0].state.waiting
        assert (waiting.reason, waiting.message) == ("CreateContainerConfigError", 'secret "missing" not found')
        wait_for(lambda: core.read_namespaced_pod("sleeper", NS).status.phase == "Running")
        pid = int(wait_for(lambda: kube.pod_log(NS, "sleeper").strip()))
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert kube.pod_log(NS, "ok") == "done\n"  # logs outlive close(), for a failing test's report
