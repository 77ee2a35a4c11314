"""A stand-in Kubernetes API server on loopback, for tests that drive the official `kubernetes` client.

Why: code that creates pods, services, secrets and network policies should be tested through the real
client's HTTP calls and deserializers, not against a mocked `CoreV1Api`. This serves the subset of the
API that kfrl uses, with the real JSON shapes and status codes, from a ThreadingHTTPServer on 127.0.0.1.
With `kubelet=True` it also runs each pod's first container as a local subprocess, so a test can watch a
pod become Ready, succeed, fail or be deleted, for real.

    with StandIn() as kube:
        core = client.CoreV1Api(client.ApiClient(client.Configuration(host=kube.url)))
"""
from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
import uuid
import weakref
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import parse_qsl, urlsplit

# plural -> (kind, apiVersion, API group)
RESOURCES = {
    "pods": ("Pod", "v1", ""),
    "services": ("Service", "v1", ""),
    "secrets": ("Secret", "v1", ""),
    "networkpolicies": ("NetworkPolicy", "networking.k8s.io/v1", "networking.k8s.io"),
}
# The API server's DELETE answers with the deleted object for these (ReturnDeletedObject), a Status otherwise.
RETURNS_DELETED_OBJECT = {"pods", "services"}
PATH = re.compile(r"^/(?:api/v1|apis/networking\.k8s\.io/v1)/namespaces/(?P<ns>[^/]+)/(?P<plural>[a-z]+)"
                  r"(?:/(?P<name>[^/]+)(?P<log>/log)?)?$")
# Pod-level status.reason values (set by the kubelet for the whole pod, not for one container).
POD_LEVEL_REASONS = {"Evicted", "DeadlineExceeded", "Shutdown", "NodeLost", "UnexpectedAdmissionError"}
GENERATE_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # the API server's alphabet for generateName suffixes
KILL_GRACE_CAP_S = 10.0
POLL_S = 0.1
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # probes must not go via http_proxy

# Validation the API server applies at create time, with its messages (names and label values are where
# generated manifests go wrong: uppercase, underscores, over 63 characters).
DNS1123_SUBDOMAIN = (r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", 253,
                     "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.',"
                     " and must start and end with an alphanumeric character")
DNS1035_LABEL = (r"[a-z]([-a-z0-9]*[a-z0-9])?", 63,
                 "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an"
                 " alphabetic character, and end with an alphanumeric character")
LABEL_VALUE = (r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?", 63,
               "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.',"
               " and must start and end with an alphanumeric character")
NAME_RULES = {"services": DNS1035_LABEL}  # every other resource here: DNS1123_SUBDOMAIN


class Request(NamedTuple):
    """One request as the stand-in received it (body is the parsed JSON, or None)."""
    method: str
    path: str
    query: dict
    body: Any


class ApiError(Exception):
    """An error the API server answers with a Status object (the client raises ApiException from it)."""

    def __init__(self, code: int, reason: str, message: str, details: dict | None = None):
        super().__init__(message)
        self.code = code
        self.body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                     "message": message, "reason": reason, "code": code}
        if details:
            self.body["details"] = {k: v for k, v in details.items() if v not in ("", None)}


class _ConfigError(Exception):
    """A container the kubelet cannot start yet (CreateContainerConfigError: missing secret or key)."""


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def qualified(plural: str) -> str:
    """The resource name the API server uses in messages: `pods`, `networkpolicies.networking.k8s.io`."""
    group = RESOURCES[plural][2]
    return f"{plural}.{group}" if group else plural


def not_found(plural: str, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{qualified(plural)} "{name}" not found',
                    {"name": name, "group": RESOURCES[plural][2], "kind": plural})


def invalid(plural: str, name: str, field: str, message: str, value: Any = None, required: bool = False) -> ApiError:
    kind, _, group = RESOURCES[plural]
    detail = f"Required value: {message}" if required else f"Invalid value: {json.dumps(value)}: {message}"
    cause = {"reason": "FieldValueRequired" if required else "FieldValueInvalid", "message": detail, "field": field}
    return ApiError(422, "Invalid", f'{kind} "{name}" is invalid: {field}: {detail}',
                    {"name": name, "group": group, "kind": kind, "causes": [cause]})


def check(rule: tuple, plural: str, name: str, field: str, value: str) -> None:
    pattern, max_len, message = rule
    if len(value) > max_len:
        raise invalid(plural, name, field, f"must be no more than {max_len} characters", value)
    if not re.fullmatch(pattern, value):
        raise invalid(plural, name, field, f"{message} (regex used for validation is '{pattern}')", value)


def parse_selector(text: str) -> list[tuple[str, str, str | None]]:
    """Parses a labelSelector of comma-separated `k=v`, `k==v`, `k!=v`, `k` and `!k` terms."""
    terms = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        m = re.fullmatch(r"(!?)([A-Za-z0-9][-A-Za-z0-9_./]*)\s*(?:(==|=|!=)\s*([-A-Za-z0-9_.]*))?", term)
        if not m or (m[1] and m[3]):
            raise ApiError(400, "BadRequest", f"unable to parse requirement: invalid label selector {term!r}")
        op = "absent" if m[1] else ("exists" if not m[3] else ("!=" if m[3] == "!=" else "="))
        terms.append((m[2], op, m[4]))
    return terms


def matches(labels: dict, terms: list) -> bool:
    return all({"=": labels.get(k) == v, "!=": labels.get(k) != v, "exists": k in labels,
                "absent": k not in labels}[op] for k, op, v in terms)


def as_item(obj: dict) -> dict:
    """Items of a list response carry no kind/apiVersion of their own (the list has them)."""
    return {k: v for k, v in copy.deepcopy(obj).items() if k not in ("kind", "apiVersion")}


def pod_status(pod: dict, phase: str, ready: bool, reason: str = "", message: str = "",
               exit_code: int | None = None) -> dict:
    """The status the kubelet reports for `phase`: conditions, and one containerStatus per container."""
    t = now()
    started = (pod.get("status") or {}).get("startTime", t)
    if phase == "Pending":
        state = {"waiting": {"reason": reason or "ContainerCreating", **({"message": message} if message else {})}}
    elif phase == "Running":
        state = {"running": {"startedAt": started}}
    else:  # Succeeded, Failed
        code = exit_code if exit_code is not None else (0 if phase == "Succeeded" else 1)
        state = {"terminated": {"exitCode": code, "reason": reason or ("Completed" if code == 0 else "Error"),
                                "startedAt": started, "finishedAt": t, **({"message": message} if message else {})}}
    containers = pod["spec"].get("containers") or [{"name": "main"}]
    def image_id(image: str) -> str:  # what a node reports once it has pulled the image: its digest
        if phase == "Pending" or not image:
            return ""
        return f"{image.split(':')[0]}@sha256:{hashlib.sha256(image.encode()).hexdigest()}"

    statuses = [{"name": c["name"], "image": c.get("image", ""), "imageID": image_id(c.get("image", "")),
                 "ready": ready, "restartCount": 0,
                 "started": phase == "Running", "state": copy.deepcopy(state)} for c in containers]

    def condition(type_: str, ok: bool) -> dict:
        c = {"type": type_, "status": "True" if ok else "False", "lastProbeTime": None, "lastTransitionTime": t}
        if not ok:
            done = phase in ("Succeeded", "Failed")
            c["reason"] = "PodCompleted" if done else "ContainersNotReady"
            if not done:
                c["message"] = f"containers with unready status: [{' '.join(s['name'] for s in statuses)}]"
        return c

    status = {"phase": phase, "conditions": [condition("Initialized", True), condition("Ready", ready),
                                             condition("ContainersReady", ready), condition("PodScheduled", True)],
              "hostIP": "127.0.0.1", "startTime": started, "containerStatuses": statuses}
    if phase != "Pending":
        status.update(podIP="127.0.0.1", podIPs=[{"ip": "127.0.0.1"}])
    if reason in POD_LEVEL_REASONS:
        status.update(reason=reason, message=message)
    return status


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's urllib3 pool expects

    def setup(self) -> None:  # tracked so close() can end keep-alive connections the client still pools
        super().setup()
        self.server.connections.add(self.connection)

    def finish(self) -> None:
        super().finish()
        self.server.connections.discard(self.connection)

    def log_message(self, *args: Any) -> None:  # quiet: failures surface as Status bodies, not stderr noise
        pass

    def _serve(self) -> None:
        url = urlsplit(self.path)
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        code, payload = self.server.standin._handle(self.command, url.path, dict(parse_qsl(url.query)), raw)
        text = isinstance(payload, str)
        data = payload.encode() if text else json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain" if text else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = _serve


class StandIn:
    """The API server (and optionally a kubelet), on http://127.0.0.1:<free port>; see the module docstring."""

    def __init__(self, kubelet: bool = False, env_extra: dict | None = None):
        self.kubelet = kubelet
        self.env_extra = {k: str(v) for k, v in (env_extra or {}).items()}
        self.requests: list[Request] = []
        self._store: dict[str, dict[tuple[str, str], dict]] = {plural: {} for plural in RESOURCES}
        self._lock = threading.RLock()  # one lock for the store: HTTP threads and kubelet threads share it
        self._rv = 0
        self._failures: list[tuple[str, str, int, str, str]] = []
        self._procs: dict[str, subprocess.Popen] = {}  # pod uid -> its running container process
        self._kubelets: list[threading.Thread] = []
        self._logs: dict[tuple[str, str], Path] = {}
        self._closing = threading.Event()
        self._logdir = Path(tempfile.mkdtemp(prefix="kube-standin-"))
        weakref.finalize(self, shutil.rmtree, self._logdir, ignore_errors=True)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.standin = self
        self._server.connections = set()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, args=(0.05,), name="kube-standin", daemon=True).start()

    # ---- test-facing API -------------------------------------------------------------------------------

    def __enter__(self) -> StandIn:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stops the server and kills every container process. Logs stay readable (pod_log) until the
        stand-in is garbage-collected, when its temporary directory goes."""
        if self._closing.is_set():
            return
        self._closing.set()
        with self._lock:
            for proc in self._procs.values():
                _kill(proc, signal.SIGKILL)
        for t in self._kubelets:
            t.join(timeout=5)
        self._server.shutdown()
        self._server.server_close()
        for conn in list(self._server.connections):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def objects(self, kind: str) -> list[dict]:
        """Copies of the stored objects of a kind, by plural ("pods") or Kind ("Pod")."""
        with self._lock:
            return [copy.deepcopy(o) for o in self._store[self._plural(kind)].values()]

    def remove(self, kind: str, ns: str, name: str) -> dict | None:
        """Deletes an object behind the client's back (eviction, a node lost, kubectl delete --force).

        A pod's process is SIGKILLed at once. Returns the removed object, or None if there was none."""
        with self._lock:
            obj = self._store[self._plural(kind)].pop((ns, name), None)
            if obj is not None and obj["metadata"]["uid"] in self._procs:
                _kill(self._procs[obj["metadata"]["uid"]], signal.SIGKILL)
            return obj

    def set_pod_phase(self, ns: str, name: str, phase: str, ready: bool, reason: str = "", message: str = "",
                      exit_code: int | None = None) -> None:
        """Sets a pod's status as the kubelet would report it (see pod_status); KeyError if there is no pod."""
        with self._lock:
            pod = self._store["pods"][(ns, name)]
            pod["status"] = pod_status(pod, phase, ready, reason, message, exit_code)
            pod["metadata"]["resourceVersion"] = self._bump()

    def pod_log(self, ns: str, name: str) -> str:
        """The output (stdout and stderr) of the pod's latest process; KeyError if it never started one."""
        with self._lock:
            return self._logs[(ns, name)].read_text(errors="replace")

    def fail_next(self, method: str, plural: str, code: int, reason: str, message: str) -> None:
        """Makes the next `method` request on `plural` answer this Status (e.g. 403 Forbidden from RBAC)."""
        with self._lock:
            self._failures.append((method.upper(), self._plural(plural), code, reason, message))

    def collect_garbage(self) -> list[tuple[str, str, str]]:
        """Does what Kubernetes' garbage collector does for dependents of deleted owners, when a test asks.

        An object none of whose ownerReferences' uids exist any more is deleted (a running pod starts its
        graceful termination); one with some owners left loses only the dangling references. Repeats until
        nothing changes, since a collected pod may own others. Returns (plural, ns, name) of each deletion."""
        collected = []
        with self._lock:
            while True:
                uids = {o["metadata"]["uid"] for store in self._store.values() for o in store.values()}
                doomed = []
                for plural, store in self._store.items():
                    for (ns, name), obj in store.items():
                        refs = obj["metadata"].get("ownerReferences") or []
                        alive = [r for r in refs if r.get("uid") in uids]
                        if refs and not alive and "deletionTimestamp" not in obj["metadata"]:
                            doomed.append((plural, ns, name))
                        elif alive and len(alive) < len(refs):
                            obj["metadata"]["ownerReferences"] = alive
                if not doomed:
                    return collected
                for plural, ns, name in doomed:
                    self._delete(plural, ns, name, None)
                    collected.append((plural, ns, name))

    # ---- the API server --------------------------------------------------------------------------------

    def _handle(self, method: str, path: str, query: dict, raw: bytes) -> tuple[int, Any]:
        """Serves one request; returns (HTTP status, JSON-able body or log text)."""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        with self._lock:
            self.requests.append(Request(method, path, query, body))
        try:
            m = PATH.match(path)
            plural = m and m["plural"]
            if not m or plural not in RESOURCES or not path.startswith(
                    "/api/v1/" if not RESOURCES[plural][2] else f"/apis/{RESOURCES[plural][1]}/"):
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            ns, name, grace = m["ns"], m["name"], _grace(query, body)
            route = (method, "log" if m["log"] else "item" if name else "collection")
            with self._lock:
                self._inject(method, plural, name)
                if route == ("GET", "collection"):
                    return 200, self._list(plural, ns, query, self._store[plural].values())
                if route == ("POST", "collection"):
                    return 201, self._create(plural, ns, body)
                if route == ("DELETE", "collection"):  # answers the list of what it deleted, as the API does
                    doomed = self._list(plural, ns, query, self._store[plural].values())["items"]
                    return 200, self._list(plural, ns, {}, [self._delete(plural, ns, o["metadata"]["name"], grace)
                                                            for o in doomed])
                if route == ("GET", "item"):
                    return 200, copy.deepcopy(self._get(plural, ns, name))
                if route == ("DELETE", "item"):
                    obj = self._delete(plural, ns, name, grace)
                    if plural in RETURNS_DELETED_OBJECT or "deletionTimestamp" in obj["metadata"]:
                        return 200, obj
                    details = {"name": name, "group": RESOURCES[plural][2], "kind": plural,
                               "uid": obj["metadata"]["uid"]}
                    return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                 "details": {k: v for k, v in details.items() if v}}
                if route == ("PUT", "item") and plural == "secrets":
                    return 200, self._replace(plural, ns, name, body)
                if route == ("GET", "log") and plural == "pods":
                    return 200, self._read_log(ns, name)
            raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")
        except ApiError as e:
            return e.code, e.body
        except Exception as e:  # a stand-in bug: answer it rather than drop the connection
            return 500, ApiError(500, "InternalError", f"Internal error occurred: {e!r}").body

    def _inject(self, method: str, plural: str, name: str | None) -> None:
        for i, (m, p, code, reason, message) in enumerate(self._failures):
            if m == method and p == plural:
                del self._failures[i]
                raise ApiError(code, reason, message, {"name": name, "kind": plural})

    def _get(self, plural: str, ns: str, name: str) -> dict:
        try:
            return self._store[plural][(ns, name)]
        except KeyError:
            raise not_found(plural, name) from None

    def _list(self, plural: str, ns: str, query: dict, objs: Any) -> dict:
        terms = parse_selector(query.get("labelSelector", ""))
        kind, api_version, _ = RESOURCES[plural]
        items = [as_item(o) for o in objs if o["metadata"]["namespace"] == ns and matches(_labels(o), terms)]
        return {"kind": f"{kind}List", "apiVersion": api_version, "metadata": {"resourceVersion": str(self._rv)},
                "items": sorted(items, key=lambda o: o["metadata"]["name"])}

    def _create(self, plural: str, ns: str, body: Any) -> dict:
        kind, api_version, _ = RESOURCES[plural]
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the body of the request was in an unknown format - accepted media "
                                              "types include: application/json")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if meta.get("namespace") not in (None, ns):
            raise ApiError(400, "BadRequest", "the namespace of the provided object does not match the namespace "
                                              "sent on the request")
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(random.choices(GENERATE_NAME_CHARS, k=5))
        name = meta.get("name") or ""
        if not name:
            raise invalid(plural, "", "metadata.name", "name or generateName is required", required=True)
        check(NAME_RULES.get(plural, DNS1123_SUBDOMAIN), plural, name, "metadata.name", name)
        for value in _labels(obj).values():
            check(LABEL_VALUE, plural, name, "metadata.labels", value)
        if (ns, name) in self._store[plural]:
            raise ApiError(409, "AlreadyExists", f'{qualified(plural)} "{name}" already exists',
                           {"name": name, "group": RESOURCES[plural][2], "kind": plural})
        meta.update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=now(), resourceVersion=self._bump())
        obj.update(kind=kind, apiVersion=api_version)
        if plural == "pods":
            obj["spec"] = {"restartPolicy": "Always", "terminationGracePeriodSeconds": 30,
                           "dnsPolicy": "ClusterFirst", **obj.get("spec", {})}
            obj["status"] = {"phase": "Pending"}
        elif plural == "secrets":  # stringData is write-only: the API server folds it into base64 data
            obj.setdefault("type", "Opaque")
            for k, v in (obj.pop("stringData", None) or {}).items():
                obj.setdefault("data", {})[k] = base64.b64encode(v.encode()).decode()
        elif plural == "services":  # ClusterIP, with an address the service-IP allocator would hand out
            spec = obj.setdefault("spec", {})
            spec.setdefault("type", "ClusterIP")
            spec.setdefault("clusterIP", f"10.96.{self._rv // 250 % 250}.{self._rv % 250 + 1}")
            obj["status"] = {"loadBalancer": {}}
        self._store[plural][(ns, name)] = obj
        if plural == "pods" and self.kubelet and not self._closing.is_set():
            t = threading.Thread(target=self._kubelet, args=(ns, name, meta["uid"]), daemon=True,
                                 name=f"kubelet-{ns}-{name}")
            self._kubelets.append(t)
            self._procs[meta["uid"]] = None  # reserved: deletion is graceful from here until the thread ends
            t.start()
        return copy.deepcopy(obj)

    def _replace(self, plural: str, ns: str, name: str, body: Any) -> dict:
        """PUT (the client's replace_*) of a secret: the new content under the same uid, a new resourceVersion."""
        old = self._get(plural, ns, name)
        if not isinstance(body, dict) or (body.get("metadata") or {}).get("name") != name:
            raise ApiError(400, "BadRequest", "the name of the object does not match the name on the URL")
        obj = copy.deepcopy(body)
        meta = obj["metadata"]
        meta.update(namespace=ns, uid=old["metadata"]["uid"], creationTimestamp=old["metadata"]["creationTimestamp"],
                    resourceVersion=self._bump())
        obj.update(kind=RESOURCES[plural][0], apiVersion=RESOURCES[plural][1])
        obj.setdefault("type", old.get("type", "Opaque"))
        for k, v in (obj.pop("stringData", None) or {}).items():
            obj.setdefault("data", {})[k] = base64.b64encode(v.encode()).decode()
        self._store[plural][(ns, name)] = obj
        return copy.deepcopy(obj)

    def _delete(self, plural: str, ns: str, name: str, grace: int | None) -> dict:
        """Deletes at once, except a pod the kubelet runs: that one is marked and terminated gracefully."""
        obj = self._get(plural, ns, name)
        meta = obj["metadata"]
        if plural == "pods" and meta["uid"] in self._procs:
            if "deletionTimestamp" not in meta:
                default = obj["spec"].get("terminationGracePeriodSeconds", 30)
                meta.update(deletionTimestamp=now(), deletionGracePeriodSeconds=default if grace is None else grace,
                            resourceVersion=self._bump())
            return copy.deepcopy(obj)
        del self._store[plural][(ns, name)]
        return copy.deepcopy(obj)

    def _read_log(self, ns: str, name: str) -> str:
        pod = self._get("pods", ns, name)
        if (ns, name) not in self._logs:
            container = (pod["spec"].get("containers") or [{"name": "main"}])[0]["name"]
            raise ApiError(400, "BadRequest", f'container "{container}" in pod "{name}" is waiting to start: '
                                              "ContainerCreating")
        return self._logs[(ns, name)].read_text(errors="replace")

    def _bump(self) -> str:
        self._rv += 1
        return str(self._rv)

    @staticmethod
    def _plural(kind: str) -> str:
        for plural, (k, _, _) in RESOURCES.items():
            if kind.lower() in (plural, k.lower()):
                return plural
        raise KeyError(f"the stand-in serves {sorted(RESOURCES)}, not {kind!r}")

    # ---- the kubelet -----------------------------------------------------------------------------------

    def _kubelet(self, ns: str, name: str, uid: str) -> None:
        """Runs the pod's first container until it exits, the pod is deleted or removed, or close().

        Polls every POLL_S: starts the process once its env resolves, probes readiness, and on deletion
        sends SIGTERM, then SIGKILL after the grace period (capped at KILL_GRACE_CAP_S). The pod object
        goes when its process has ended, as the real kubelet confirms a graceful deletion."""
        proc: subprocess.Popen | None = None
        term_at = ready = None
        try:
            while not self._closing.is_set():
                with self._lock:
                    pod = self._store["pods"].get((ns, name))
                    if pod is None or pod["metadata"]["uid"] != uid:
                        return  # removed behind the client's back: the finally kills the process
                    container = (pod["spec"].get("containers") or [{}])[0]
                    deleting = "deletionTimestamp" in pod["metadata"]
                    if proc is None and deleting:
                        del self._store["pods"][(ns, name)]
                        return
                    if proc is None:
                        try:
                            proc = self._start(pod, container)
                        except _ConfigError as e:  # the real kubelet retries until the secret appears
                            waiting = ((pod["status"].get("containerStatuses") or [{}])[0].get("state") or {})
                            if (waiting.get("waiting") or {}).get("message") != str(e):
                                self.set_pod_phase(ns, name, "Pending", False, "CreateContainerConfigError", str(e))
                        except OSError as e:
                            self.set_pod_phase(ns, name, "Failed", False, "StartError", str(e), exit_code=128)
                            return
                        else:
                            ready = not container.get("readinessProbe")  # no probe: ready once running
                            self.set_pod_phase(ns, name, "Running", ready)
                    elif proc.poll() is not None:
                        if deleting:
                            del self._store["pods"][(ns, name)]
                        else:
                            code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
                            self.set_pod_phase(ns, name, "Succeeded" if code == 0 else "Failed", False,
                                               exit_code=code)
                        return
                    elif deleting and term_at is None:
                        _kill(proc, signal.SIGTERM)
                        term_at = time.monotonic()
                    elif deleting and time.monotonic() - term_at >= min(
                            float(pod["metadata"].get("deletionGracePeriodSeconds") or 0), KILL_GRACE_CAP_S):
                        _kill(proc, signal.SIGKILL)
                if proc is not None and not ready and not deleting and _probe(container):
                    with self._lock:
                        pod = self._store["pods"].get((ns, name))
                        if pod is not None and pod["metadata"]["uid"] == uid and proc.poll() is None:
                            self.set_pod_phase(ns, name, "Running", True)
                            ready = True
                self._closing.wait(POLL_S)
        finally:
            with self._lock:
                self._procs.pop(uid, None)
            if proc is not None:  # the whole group, as a runtime tears down a container, strays included
                _kill(proc, signal.SIGKILL, even_if_exited=True)
                proc.wait()

    def _start(self, pod: dict, container: dict) -> subprocess.Popen:
        """Starts the container's command + args (called with the lock held), output to the pod's log."""
        argv = list(container.get("command") or []) + list(container.get("args") or [])
        if not container.get("command"):
            raise OSError("the stand-in kubelet has no images: the container needs an explicit command")
        env = self._container_env(pod, container)
        meta = pod["metadata"]
        log = self._logdir / f"{meta['namespace']}_{meta['name']}_{meta['uid']}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self._logs[(meta["namespace"], meta["name"])] = log
        self._procs[meta["uid"]] = proc
        return proc

    def _container_env(self, pod: dict, container: dict) -> dict[str, str]:
        """os.environ + env_extra + the container's env, with valueFrom resolved as the kubelet does."""
        meta = pod["metadata"]
        env = {**os.environ, **self.env_extra}
        fields = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
                  "metadata.uid": meta["uid"], "status.podIP": "127.0.0.1"}
        for var in container.get("env") or []:
            source = var.get("valueFrom")
            if not source:
                env[var["name"]] = var.get("value", "")
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                secret = self._store["secrets"].get((meta["namespace"], ref["name"]))
                data = (secret or {}).get("data") or {}
                if ref["key"] not in data:
                    if ref.get("optional"):
                        continue
                    raise _ConfigError(f'secret "{ref["name"]}" not found' if secret is None else
                                       f"couldn't find key {ref['key']} in Secret {meta['namespace']}/{ref['name']}")
                env[var["name"]] = base64.b64decode(data[ref["key"]]).decode()
            elif "fieldRef" in source and source["fieldRef"].get("fieldPath") in fields:
                env[var["name"]] = fields[source["fieldRef"]["fieldPath"]]
            else:
                raise _ConfigError(f"the stand-in kubelet cannot resolve env {var['name']}: {source}")
        return env


def _labels(obj: dict) -> dict:
    return obj["metadata"].get("labels") or {}


def _grace(query: dict, body: Any) -> int | None:
    """gracePeriodSeconds from the query, or from a DeleteOptions body."""
    value = query.get("gracePeriodSeconds", body.get("gracePeriodSeconds") if isinstance(body, dict) else None)
    return None if value is None else int(value)


def _kill(proc: subprocess.Popen | None, sig: int, even_if_exited: bool = False) -> None:
    """Signals the container's whole process group (its own session), as a container runtime would."""
    if proc is not None and (even_if_exited or proc.poll() is None):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass


def _probe(container: dict) -> bool:
    """One readinessProbe.httpGet on 127.0.0.1: success is a 2xx or 3xx answer, as the kubelet counts it."""
    get = (container.get("readinessProbe") or {}).get("httpGet")
    if not get:
        return False
    port = get.get("port")
    if isinstance(port, str) and not port.isdigit():  # a named port: look it up among the container's ports
        port = next((p["containerPort"] for p in container.get("ports") or [] if p.get("name") == port), None)
    try:
        with _NO_PROXY.open(f"http://127.0.0.1:{port}{get.get('path', '/')}", timeout=0.5) as r:
            return 200 <= r.status < 400
    except Exception:
        return False
