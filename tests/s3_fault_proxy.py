"""A fault-injecting HTTP reverse proxy to put in front of an S3 server (moto) in tests and benchmarks.

Stdlib only. Every request is forwarded unchanged (method, path, headers including ``Host``, body:
a ``Content-Length`` body byte for byte, a ``Transfer-Encoding: chunked`` body with its chunk
framing relayed as received) to one upstream; the response's status, headers and body are streamed
back. Every response carries ``Connection: close``, so each request uses a fresh connection.

::

    proxy = S3FaultProxy(upstream="http://127.0.0.1:5000")   # listens on 127.0.0.1, a free port
    proxy.start()
    os.environ["AWS_ENDPOINT_URL"] = proxy.url
    proxy.set_faults(error_rate=0.1, seed=3)                  # thread-safe; replaces all settings
    ...
    proxy.stats            # {"requests": 120, "forwarded": 108, "errors": 12, ...}
    proxy.stop()

Fault kinds, all off by default (``*_rate`` are per-request probabilities drawn from
``random.Random(seed)``; the first that fires wins, checked in this order):

- ``outage_s``: for ``outage_s`` seconds after ``set_faults`` is called, every request is dropped
  (``outage_mode="drop"``: connection closed without an answer) or answered 503
  (``outage_mode="error"``), without forwarding.
- ``drop_rate``: close the connection without answering, without forwarding.
- ``error_rate``: answer 503 ``SlowDown`` or 500 ``InternalError`` with an S3 XML error body,
  without forwarding.
- ``lost_put_response_rate``: forward a PUT (the object IS written upstream), then close the
  connection without answering.
- ``truncate_get_rate``: forward a GET on an object; send the full ``Content-Length`` header but
  only half the body, then close.
- ``stall_rate`` with ``stall_s``: sleep ``stall_s`` before forwarding (the request then completes
  normally).

``methods`` (e.g. ``("PUT",)``) and ``key_contains`` (a substring of the path) restrict every fault
kind to matching requests. The request body is always read completely before a fault answers or
closes, so the client sees the fault itself rather than a reset while it is still sending.
"""
from __future__ import annotations

import dataclasses
import http.client
import random
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_PIECE = 64 * 1024
# Hop-by-hop response headers the proxy does not pass on (it always answers with Connection: close).
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}

_ERRORS = (
    (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    (500, "Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
)

STAT_KEYS = ("requests", "forwarded", "outage", "drops", "errors", "lost_put_responses", "truncated_gets",
             "stalls", "upstream_errors", "client_disconnects")


@dataclasses.dataclass(frozen=True)
class Faults:
    """One fault setting (see the module docstring)."""

    error_rate: float = 0.0
    drop_rate: float = 0.0
    lost_put_response_rate: float = 0.0
    truncate_get_rate: float = 0.0
    stall_rate: float = 0.0
    stall_s: float = 0.0
    outage_s: float = 0.0
    outage_mode: str = "drop"
    methods: tuple[str, ...] | None = None
    key_contains: str | None = None
    seed: int = 0

    def __post_init__(self):
        for name in ("error_rate", "drop_rate", "lost_put_response_rate", "truncate_get_rate", "stall_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {value!r}")
        if self.stall_s < 0 or self.outage_s < 0:
            raise ValueError("stall_s and outage_s must be >= 0")
        if self.outage_mode not in ("drop", "error"):
            raise ValueError(f"outage_mode must be 'drop' or 'error', got {self.outage_mode!r}")
        if self.methods is not None:
            object.__setattr__(self, "methods", tuple(m.upper() for m in self.methods))

    def applies_to(self, method: str, path: str) -> bool:
        if self.methods is not None and method.upper() not in self.methods:
            return False
        return self.key_contains is None or self.key_contains in path


def _is_object_path(path: str) -> bool:
    """True for a path-style object URL (/bucket/key...), False for a bucket or the service root."""
    bare = urlsplit(path).path.lstrip("/")
    bucket, _, key = bare.partition("/")
    return bool(bucket) and bool(key)


def _error_body(code: str, message: str, path: str, request_id: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message><Resource>{path}</Resource>"
        f"<RequestId>{request_id}</RequestId><HostId>kfrl-s3-fault-proxy</HostId></Error>"
    ).encode("utf-8")


class S3FaultProxy:
    """A reverse proxy for one upstream HTTP endpoint that injects faults (see the module docstring)."""

    def __init__(self, upstream: str, *, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0,
                 seed: int = 0):
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream must be an http://host:port URL, got {upstream!r}")
        self.upstream = upstream
        self._upstream_host = parts.hostname
        self._upstream_port = parts.port or 80
        self._timeout_s = timeout_s
        self._host, self._port = host, port
        self._lock = threading.Lock()
        self._faults = Faults(seed=seed)
        self._random = random.Random(seed)
        self._outage_until = 0.0
        self._stats = dict.fromkeys(STAT_KEYS, 0)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> "S3FaultProxy":
        if self._server is not None:
            raise RuntimeError("proxy already started")
        handler = type("BoundHandler", (_Handler,), {"proxy": self})
        self._server = ThreadingHTTPServer((self._host, self._port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-fault-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        self._server = self._thread = None

    def __enter__(self) -> "S3FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("proxy not started")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # -- faults and counters ------------------------------------------------------------------

    def set_faults(self, **settings) -> Faults:
        """Replace every fault setting (unnamed ones go back to off); an ``outage_s`` starts now."""
        faults = Faults(**settings)
        with self._lock:
            self._faults = faults
            self._random = random.Random(faults.seed)
            self._outage_until = time.monotonic() + faults.outage_s if faults.outage_s else 0.0
        return faults

    @property
    def faults(self) -> Faults:
        with self._lock:
            return self._faults

    @property
    def outage_active(self) -> bool:
        with self._lock:
            return time.monotonic() < self._outage_until

    @property
    def stats(self) -> dict:
        with self._lock:
            return dict(self._stats)

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = dict.fromkeys(STAT_KEYS, 0)

    def _count(self, key: str) -> None:
        with self._lock:
            self._stats[key] += 1

    def _decide(self, method: str, path: str) -> tuple[str | None, Faults, float]:
        """(fault to inject or None, the settings, a uniform draw for choosing an error kind)."""
        with self._lock:
            self._stats["requests"] += 1
            faults = self._faults
            # One draw per kind on every request, so a seed gives the same sequence whatever matches.
            draws = {kind: self._random.random() for kind in ("drop", "error", "lost_put", "truncate", "stall")}
            pick = self._random.random()
            in_outage = time.monotonic() < self._outage_until
        if not faults.applies_to(method, path):
            return None, faults, pick
        if in_outage:
            return "outage", faults, pick
        if draws["drop"] < faults.drop_rate:
            return "drop", faults, pick
        if draws["error"] < faults.error_rate:
            return "error", faults, pick
        if method == "PUT" and draws["lost_put"] < faults.lost_put_response_rate:
            return "lost_put", faults, pick
        if method == "GET" and _is_object_path(path) and draws["truncate"] < faults.truncate_get_rate:
            return "truncate", faults, pick
        if faults.stall_s > 0 and draws["stall"] < faults.stall_rate:
            return "stall", faults, pick
        return None, faults, pick

    def _upstream_connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self._upstream_host, self._upstream_port, timeout=self._timeout_s)


class _Handler(BaseHTTPRequestHandler):
    proxy: S3FaultProxy  # set on the bound subclass
    protocol_version = "HTTP/1.1"  # needed for Content-Length framing, 100-continue and chunked requests

    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass

    # Every method is handled the same way.
    def do_GET(self):
        self._handle()

    do_PUT = do_POST = do_HEAD = do_DELETE = do_OPTIONS = do_PATCH = do_GET

    # -- one request ---------------------------------------------------------------------------

    def _handle(self) -> None:
        self.close_connection = True
        proxy = self.proxy
        fault, faults, pick = proxy._decide(self.command, self.path)
        try:
            body = self._read_body()
        except (OSError, ValueError, http.client.HTTPException):
            proxy._count("client_disconnects")
            return
        try:
            if fault == "outage":
                proxy._count("outage")
                if faults.outage_mode == "error":
                    self._send_error_response(_ERRORS[0])
                return  # "drop": close without answering
            if fault == "drop":
                proxy._count("drops")
                return
            if fault == "error":
                proxy._count("errors")
                self._send_error_response(_ERRORS[0] if pick < 0.5 else _ERRORS[1])
                return
            if fault == "stall":
                proxy._count("stalls")
                time.sleep(faults.stall_s)
            self._forward(body, fault)
        except (BrokenPipeError, ConnectionResetError):
            proxy._count("client_disconnects")

    def _read_body(self) -> bytes:
        """The request body exactly as sent: Content-Length bytes, or the raw chunked framing."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._read_chunked_raw()
        length = int(self.headers.get("Content-Length") or 0)
        if length < 0:
            raise ValueError("negative Content-Length")
        data = self.rfile.read(length) if length else b""
        if len(data) != length:
            raise ConnectionResetError("client closed before sending its whole body")
        return data

    def _read_chunked_raw(self) -> bytes:
        """Read a chunked body up to and including its trailer section, keeping the framing as is."""
        raw = bytearray()
        while True:
            size_line = self.rfile.readline(65537)
            if not size_line:
                raise ConnectionResetError("client closed inside a chunked body")
            raw += size_line
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                break
            chunk = self.rfile.read(size + 2)  # data and its CRLF
            if len(chunk) != size + 2:
                raise ConnectionResetError("client closed inside a chunk")
            raw += chunk
        while True:  # trailers, then the empty line
            line = self.rfile.readline(65537)
            if not line:
                raise ConnectionResetError("client closed inside the chunked trailer")
            raw += line
            if line in (b"\r\n", b"\n"):
                return bytes(raw)

    def _forward(self, body: bytes, fault: str | None) -> None:
        proxy = self.proxy
        conn = proxy._upstream_connection()
        try:
            try:
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    conn.putheader(name, value)
                conn.endheaders()
                if body:
                    conn.send(body)
                response = conn.getresponse()
            except (OSError, http.client.HTTPException) as err:
                proxy._count("upstream_errors")
                self._send_plain(502, "Bad Gateway", f"s3 fault proxy: upstream {proxy.upstream} failed: {err}")
                return
            proxy._count("forwarded")
            if fault == "lost_put":
                response.read()  # the write happened upstream; the client never hears of it
                proxy._count("lost_put_responses")
                return
            self._relay(response, truncate=fault == "truncate")
        finally:
            conn.close()

    def _relay(self, response: http.client.HTTPResponse, *, truncate: bool) -> None:
        length_header = response.getheader("Content-Length")
        length = int(length_header) if length_header is not None and length_header.isdigit() else None
        no_body = self.command == "HEAD" or response.status in (204, 304) or 100 <= response.status < 200
        if truncate and (no_body or length is None or length < 2 or response.status not in (200, 206)):
            truncate = False  # nothing worth cutting: answer normally
        self.send_response_only(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in _HOP_BY_HOP:
                self.send_header(name, value)
        self.send_header("Connection", "close")
        self.end_headers()
        if no_body:
            return
        # With no Content-Length (upstream chunked), the body ends when this connection closes.
        remaining = length // 2 if truncate else None
        while remaining is None or remaining > 0:
            piece = response.read(_PIECE if remaining is None else min(_PIECE, remaining))
            if not piece:
                break
            self.wfile.write(piece)
            if remaining is not None:
                remaining -= len(piece)
        self.wfile.flush()
        if truncate:
            self.proxy._count("truncated_gets")

    def _send_error_response(self, error: tuple[int, str, str, str]) -> None:
        status, reason, code, message = error
        request_id = uuid.uuid4().hex[:16].upper()
        body = b"" if self.command == "HEAD" else _error_body(code, message, self.path, request_id)
        self.send_response_only(status, reason)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("x-amz-request-id", request_id)
        if status == 503:
            self.send_header("Retry-After", "1")
        self.send_header("Connection", "close")
        self.end_headers()
        if body:
            self.wfile.write(body)
        self.wfile.flush()

    def _send_plain(self, status: int, reason: str, text: str) -> None:
        body = b"" if self.command == "HEAD" else text.encode("utf-8")
        self.send_response_only(status, reason)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        if body:
            self.wfile.write(body)
        self.wfile.flush()


__all__ = ["Faults", "S3FaultProxy", "STAT_KEYS"]
