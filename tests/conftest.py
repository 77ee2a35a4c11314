"""Shared fixtures: real services on loopback (moto's S3 server, an MLflow tracking server).

Both are started once per test session, as subprocesses of the test run, and stopped at the end.
Nothing here mocks a service inside the process.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# `make test` runs two pytest workers (pytest-xdist) on 2 cores: each computes with one torch thread, or
# the two would oversubscribe the cores and spin in OpenMP barriers. Set before any test module imports
# torch (the subprocesses a test starts inherit it too).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker
        import torch

        torch.set_num_threads(1)


# The builtin models and the test files that use them (None: nearly every file).
BUILTIN_USERS = {"tiny-qwen2-arith": None, "tiny-qwen2-arith-tools": "tests/test_agent.py"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """The xdist controller builds the builtin models the collected tests use before any test runs,
    with all of this machine's cores, as one serial run would: workers racing to build the same model
    on a cold cache both train it, oversubscribed, for many minutes."""
    from kfrl.models.tiny import materialize_builtin

    for name, user in BUILTIN_USERS.items():
        if user is None or any(test_id.startswith(user + "::") for test_id in ids):
            materialize_builtin(name)  # built by the first worker's call; found in the cache after


# The test files that take longest (seconds of a worker's time), collected and handed out first: two
# workers take whole files in collection order (`-n 2 --dist loadfile --no-loadscope-reorder`), so
# starting the long ones first keeps both busy to the end instead of leaving one to finish a long file
# alone.
LONGEST_FIRST = ("test_distributed", "test_resident_engine", "test_chaos", "test_cluster", "test_e2e", "test_agent",
                 "test_kernels", "test_reliability", "test_synthetic_and_tiny", "test_mlflow_home",
                 "test_engine_workload", "test_tracking", "test_algo_kfp", "test_lora", "test_trainer_state")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.path)).stem, len(rank)))  # stable: files keep their order


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"service exited with {proc.returncode}; log:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status < 500:
                    return
        except Exception:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"service at {url} not healthy after {timeout}s; log:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A moto S3 server on loopback. Yields its endpoint URL; AWS_* variables point at it."""
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=fh, stderr=subprocess.STDOUT,
        )
    endpoint = f"http://127.0.0.1:{port}"
    wait_http(endpoint + "/", 60, proc, log)
    saved = {k: os.environ.get(k) for k in
             ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update({
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    })
    yield endpoint
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    proc.terminate()
    proc.wait(10)


@pytest.fixture()
def s3_bucket(s3_server):
    """A fresh, empty bucket on the moto server; yields its name."""
    import uuid

    import boto3

    name = f"kfrl-test-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """An `mlflow server` with a SQLite backend on loopback. Yields its tracking URI."""
    port = free_port()
    root = tmp_path_factory.mktemp("mlflow")
    log = root / "mlflow.log"
    exe = Path(sys.executable).with_name("mlflow")
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [str(exe), "server", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
             "--default-artifact-root", str(root / "artifacts"), "--host", "127.0.0.1",
             "--port", str(port), "--workers", "1"],
            stdout=fh, stderr=subprocess.STDOUT,
        )
    uri = f"http://127.0.0.1:{port}"
    wait_http(uri + "/health", 120, proc, log)
    yield uri
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
