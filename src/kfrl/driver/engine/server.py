"""The resident engine: one long-lived process per run that executes stages by name.

`kfrl engine serve --run-uri URI` (started and stopped by `kfrl train` for the local runner when
``pipeline.engines=resident``) serves the run's stages over HTTP with the same stage functions a KFP
task would call (``kfrl.stages.run_stage``). Because the process lives across stages and
iterations, models, tokenizers and the rollout decoder stay loaded in it (``kfrl.stages.context``
caches them by slot), and the import of torch and transformers is paid once instead of per task.

KFP tasks become thin clients (``kfrl.driver.engine.client``): they find the engine through the run's
``ENGINE.json`` in the store, send (run_uri, iteration, stage) and return when the stage is
committed. Stages run one at a time (one accelerator). Nothing lives only in the engine: every
stage still commits to the store, so a killed engine loses at most the stage it was running.

API (JSON): ``GET /health`` → ``{"status", "run_uri", "pid", "stages_run"}``; ``POST /stages`` with
``{"run_uri", "iteration", "stage"}`` → the stage's result (``StageResult`` fields), or with
``"group"`` instead of ``"stage"`` → ``{"results": [...]}`` for the fused group's stages; status 500
with ``{"error"}`` naming the failure; ``POST /shutdown``.

The engine is not an open door: it holds the run's store credentials and its accelerator. ``/stages``
and ``/shutdown`` need the run's token (``Authorization: Bearer <token>``; 401 without one, 403 with
another, and nothing changes), and it runs stages of its own run only (409). The token reaches the
engine and its tasks through the environment (``KFRL_ENGINE_TOKEN``, or a file named by
``KFRL_ENGINE_TOKEN_FILE``: a mounted Kubernetes secret), never through an argument, a log line or the
store; ``kfrl train`` makes one per run for the engine it starts.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
import traceback

from pydantic import BaseModel

from kfrl.driver.engine.client import TOKEN_FILE_VARIABLE, TOKEN_VARIABLE, engine_token
from kfrl.run import Run


class StageRequest(BaseModel):
    """One stage, or a fused group of them (``kfrl.stages.FUSED_GROUPS``: run in order, one request)."""
    run_uri: str
    iteration: int
    stage: str = ""
    group: str = ""


MIN_TOKEN_LENGTH = 16


def create_app(run_uri: str, token: str, on_shutdown=None):
    import hmac

    from fastapi import FastAPI, Header
    from fastapi.responses import JSONResponse

    from kfrl.stages import run_stage
    from kfrl.store import settle_in_flight

    if len(token) < MIN_TOKEN_LENGTH:
        raise ValueError(f"the engine needs a token of at least {MIN_TOKEN_LENGTH} characters "
                         f"(${TOKEN_VARIABLE} or ${TOKEN_FILE_VARIABLE})")
    app = FastAPI(title="kfrl engine", docs_url=None, redoc_url=None)
    lock = threading.Lock()
    state = {"stages_run": 0}
    expected = f"Bearer {token}".encode()

    def refusal(given: str) -> JSONResponse | None:
        if not given:
            return JSONResponse({"error": "this engine needs the run's token (Authorization: Bearer ...)"},
                                status_code=401)
        if not hmac.compare_digest(given.encode(), expected):
            return JSONResponse({"error": "wrong token for this engine"}, status_code=403)
        return None

    @app.get("/health")
    def health():
        return {"status": "ok", "run_uri": run_uri, "pid": os.getpid(), "stages_run": state["stages_run"]}

    @app.post("/stages")
    def stages(request: StageRequest, authorization: str = Header("")):  # a plain def: run in a worker thread
        refused = refusal(authorization)
        if refused is not None:
            return refused
        if request.run_uri != run_uri:
            return JSONResponse({"error": f"this engine serves {run_uri}, not {request.run_uri}"}, status_code=409)
        from kfrl.stages import FUSED_GROUPS

        if bool(request.stage) == bool(request.group) or (request.group and request.group not in FUSED_GROUPS):
            return JSONResponse({"error": "name one stage, or one group of " + ", ".join(FUSED_GROUPS)},
                                status_code=400)
        results = []
        for stage in FUSED_GROUPS[request.group] if request.group else (request.stage,):
            with lock:  # one stage at a time: they share the accelerator and the model cache
                started = time.perf_counter()
                try:
                    result = run_stage(stage, request.run_uri, request.iteration)
                    # A task returns when its stage is committed for every process: the weights an update
                    # writes in the background are finished before the engine answers.
                    settle_in_flight()
                except Exception as err:  # noqa: BLE001 - reported to the task, which fails with it
                    traceback.print_exc()
                    return JSONResponse({"error": f"{stage}: {type(err).__name__}: {err}",
                                         "results": results}, status_code=500)
                state["stages_run"] += 1
            print(f"[engine] iteration {request.iteration} {stage}: "
                  f"{'skipped' if result.skipped else 'already committed' if result.cached else 'done'} "
                  f"in {time.perf_counter() - started:.1f}s", flush=True)
            results.append(dataclasses.asdict(result))
        return {"results": results} if request.group else results[0]

    @app.post("/shutdown")
    def shutdown(authorization: str = Header("")):
        refused = refusal(authorization)
        if refused is not None:
            return refused
        if on_shutdown is not None:
            on_shutdown()
        return {"status": "stopping"}

    return app


def serve(run_uri: str, *, host: str = "127.0.0.1", port: int = 0, advertise: str | None = None,
          parent_pid: int | None = None) -> None:
    """Serve ``run_uri``'s stages until shut down (or until ``parent_pid`` exits); the address goes
    into the run's ENGINE.json (``advertise`` overrides it, e.g. a cluster Service URL)."""
    import uvicorn

    probe = Run.at(run_uri)
    run = Run.at(run_uri, **probe.config().store.options())
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    url = advertise or f"http://{host}:{sock.getsockname()[1]}"
    server: uvicorn.Server | None = None

    def stop() -> None:
        if server is not None:
            server.should_exit = True

    server = uvicorn.Server(uvicorn.Config(create_app(run.uri, engine_token(), on_shutdown=stop),
                                           log_level="warning", timeout_keep_alive=600))
    if parent_pid:
        threading.Thread(target=_exit_with_parent, args=(parent_pid, stop), daemon=True).start()
    # A pod being deleted gets SIGTERM, then its grace period: uvicorn stops serving on it and, once
    # stopped, raises the signal again with the handler it found. The engine's handler then only lets
    # the `finally` below run, so the trainer state being written is finished before the pod goes.
    import signal

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: print("[engine] SIGTERM: stopping", flush=True))
    run.set_engine({"url": url, "pid": os.getpid(), "host": socket.gethostname()})
    from kfrl.stages import update

    update.write_states_in_background(True)  # this process outlives its stages: trainer state off the critical path
    print(f"[engine] serving {run.uri} at {url} (pid {os.getpid()})", flush=True)
    metrics = start_engine_system_metrics()
    try:
        server.run(sockets=[sock])
    finally:
        if metrics is not None:
            from kfrl.tracking import stop_system_metrics

            stop_system_metrics(metrics)
        started = time.perf_counter()
        update.drain()  # trainer state still being written is finished before the engine goes
        print(f"[engine] trainer state written ({time.perf_counter() - started:.1f}s)", flush=True)
        engine = run.engine()
        if engine is not None and engine.get("pid") == os.getpid():
            run.clear_engine()
        print("[engine] stopped", flush=True)


def start_engine_system_metrics(environ=os.environ):
    """MLflow's system metrics of the engine's machine (its GPUs: the driver's pod on a cluster has none),
    logged as ``system/engine/...`` into the run's MLflow run when the driver named it
    (``KFRL_MLFLOW_RUN_ID`` and ``MLFLOW_TRACKING_URI``); None otherwise."""
    from kfrl.driver.engine.client import METRICS_RUN_VARIABLE

    mlflow_run_id, tracking_uri = environ.get(METRICS_RUN_VARIABLE, ""), environ.get("MLFLOW_TRACKING_URI", "")
    if not mlflow_run_id or not tracking_uri:
        return None
    from kfrl.tracking import start_system_metrics

    monitor = start_system_metrics(mlflow_run_id, tracking_uri, node_id="engine")
    if monitor is not None:
        print(f"[engine] system metrics into MLflow run {mlflow_run_id} (system/engine/...)", flush=True)
    return monitor


def _exit_with_parent(parent_pid: int, stop) -> None:
    # An engine whose driver was killed must not hold the accelerator forever.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            stop()
            return
