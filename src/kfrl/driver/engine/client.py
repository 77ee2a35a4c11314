"""The thin side of a resident engine (``kfrl.driver.engine.server``): what a KFP task runs.

``dispatch`` sends a stage to the run's engine when one answers, and otherwise runs the stage in
this process (today's per-task path), so every pipeline still runs anywhere. Nothing here imports
torch: a task that hands its stage to the engine costs an HTTP call, not a model load.
"""
from __future__ import annotations

import os
import sys

from kfrl.results import StageResult

HEALTH_TIMEOUT_S = 3.0

# The run's engine token: the engine serves only requests that carry it; its tasks send it.
TOKEN_VARIABLE, TOKEN_FILE_VARIABLE = "KFRL_ENGINE_TOKEN", "KFRL_ENGINE_TOKEN_FILE"
# The MLflow run an engine on a cluster logs its machine's system metrics into (the driver's pod has no
# GPU): set with MLFLOW_TRACKING_URI in the engine pod's environment when tracking.system_metrics is on.
METRICS_RUN_VARIABLE = "KFRL_MLFLOW_RUN_ID"


def engine_token(environ=os.environ) -> str:
    """The run's engine token from the environment: ``KFRL_ENGINE_TOKEN``, else the contents of the file
    ``KFRL_ENGINE_TOKEN_FILE`` names; "" when neither is set."""
    token = environ.get(TOKEN_VARIABLE, "")
    path = environ.get(TOKEN_FILE_VARIABLE, "")
    if not token and path:
        with open(path) as fh:
            token = fh.read().strip()
    return token


class EngineUnavailable(RuntimeError):
    """The engine did not answer (not started, killed, unreachable)."""


class EngineStageFailed(RuntimeError):
    """The engine ran the stage and it failed; the message is the stage's error."""


class _Unreachable(Exception):
    pass


def _http(method: str, url: str, body: dict | None = None, headers: dict | None = None,
          timeout: float | None = None) -> tuple[int, dict]:
    """(status, JSON reply) of one request; ``_Unreachable`` when no answer came. The standard library's
    client: a task that hands its stage over imports no HTTP package (``requests`` alone costs a task
    ~0.05 s on 2 cores)."""
    import json
    import socket
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            status, text = answer.status, answer.read()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read()
    except (urllib.error.URLError, ConnectionError, socket.timeout, OSError) as err:
        raise _Unreachable(f"{type(err).__name__}: {getattr(err, 'reason', err)}") from err
    try:
        return status, json.loads(text or b"{}")
    except ValueError:
        return status, {"error": text[:500].decode(errors="replace")}


def find_engine(run) -> str | None:
    """The URL of the engine serving ``run``, or None when none answers for it."""
    record = run.engine()
    if not record or "url" not in record:
        return None
    url = record["url"].rstrip("/")
    try:
        status, body = _http("GET", url + "/health", timeout=HEALTH_TIMEOUT_S)
    except _Unreachable:
        return None
    return url if status == 200 and body.get("run_uri") == run.uri else None


def _authorization() -> dict:
    token = engine_token()
    return {"Authorization": f"Bearer {token}"} if token else {}


def _post_stages(url: str, body: dict, what: str) -> dict:
    try:
        status, reply = _http("POST", f"{url}/stages", body, headers=_authorization())
    except _Unreachable as err:
        raise EngineUnavailable(f"engine {url} went away during {what}: {err}") from err
    if status != 200:
        if status >= 500 and "error" in reply:
            raise EngineStageFailed(f"{what} failed in the engine ({url}): {reply['error']}")
        raise EngineUnavailable(f"engine {url} refused {what}: HTTP {status} {reply}")
    return reply


def run_on_engine(url: str, stage: str, run_uri: str, iteration: int) -> StageResult:
    """Run one stage on the engine and wait for its commit."""
    body = {"run_uri": run_uri, "iteration": int(iteration), "stage": stage}
    return StageResult(**_post_stages(url, body, f"{stage} of iteration {iteration}"))


def run_group_on_engine(url: str, group: str, run_uri: str, iteration: int) -> list[StageResult]:
    """Run a fused group's stages on the engine, in order, in one request."""
    body = {"run_uri": run_uri, "iteration": int(iteration), "group": group}
    reply = _post_stages(url, body, f"the {group} stages of iteration {iteration}")
    return [StageResult(**result) for result in reply["results"]]


REQUIRED_VARIABLE = "KFRL_ENGINE_REQUIRED"


def engine_required(environ=None) -> bool:
    """A task compiled as a client of a cluster engine (``KFRL_ENGINE_REQUIRED=1``): it has no GPU, so it
    never runs a GPU stage itself."""
    return (environ if environ is not None else os.environ).get(REQUIRED_VARIABLE, "") == "1"


URL_VARIABLE = "KFRL_ENGINE_URL"


def _live_engine(run_uri: str, what: str) -> str | None:
    """The URL of the run's engine: the one the driver put in this task's environment (the local runner's
    tasks inherit it: no store read, no health request), else the one in the run's ENGINE.json that
    answers for the run; None when none does and this task may run ``what`` itself."""
    url = os.environ.get(URL_VARIABLE, "").rstrip("/")
    if url:
        return url
    from kfrl.run import Run

    run = Run.at(run_uri)
    url = find_engine(run)
    if url is None and engine_required():
        raise EngineUnavailable(f"no live engine serves {run_uri} (its ENGINE.json: {run.engine() or 'none'}); this "
                                f"task has no GPU and does not run {what} itself. The driver replaces a dead "
                                "engine; KFP retries this task")
    return url


def _here(err: EngineUnavailable) -> None:
    if engine_required():
        raise err
    print(f"[kfrl] {err}; running the stage in this task instead", file=sys.stderr, flush=True)


def _on_engine_else_here(run_uri: str, what: str, on_engine, here):
    """``on_engine(url)`` when the run's engine answers, else ``here()`` (unless this task is a required
    client of a cluster engine: then it fails, and KFP retries it while the driver replaces the engine)."""
    url = _live_engine(run_uri, what)
    if url is not None:
        try:
            return on_engine(url)
        except EngineUnavailable as err:
            _here(err)
    return here()


def dispatch(stage: str, run_uri: str, iteration: int) -> StageResult:
    """Run ``stage`` on the run's engine if one answers, else here."""
    def here():
        from kfrl.stages import run_stage

        return run_stage(stage, run_uri, int(iteration))

    return _on_engine_else_here(run_uri, f"{stage} of iteration {iteration}",
                                lambda url: run_on_engine(url, stage, run_uri, iteration), here)


def dispatch_group(group: str, run_uri: str, iteration: int) -> list[StageResult]:
    """A fused group (``kfrl.stages.FUSED_GROUPS``) on the run's engine in one request if one answers,
    else here, stage by stage."""
    def here():
        from kfrl.stages import FUSED_GROUPS, run_stage

        return [run_stage(stage, run_uri, int(iteration)) for stage in FUSED_GROUPS[group]]

    return _on_engine_else_here(run_uri, f"the {group} stages of iteration {iteration}",
                                lambda url: run_group_on_engine(url, group, run_uri, iteration), here)


class EngineProcess:
    """The engine `kfrl train` starts for a run (local runner): ``kfrl engine serve`` as a child that
    exits with its parent, its output in ``log_path``."""

    def __init__(self, run, log_path, start_timeout_s: float = 120.0, stop_timeout_s: float = 600.0):
        import secrets

        self.run, self.log_path, self.start_timeout_s = run, log_path, start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.proc = None
        self.url: str | None = None
        self.token = secrets.token_urlsafe(32)  # this run's; the engine and the tasks get it from the environment
        self._saved_env: dict | None = None  # the driver's own values of the variables set for its tasks

    def start(self) -> "EngineProcess":
        import os
        import subprocess
        import time

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.run.clear_engine()  # a record left by a killed engine must not be mistaken for this one
        if self._saved_env is None:  # the driver's KFP tasks inherit its environment: they send the token
            self._saved_env = {name: os.environ.get(name, "") for name in (TOKEN_VARIABLE, URL_VARIABLE)}
            os.environ[TOKEN_VARIABLE] = self.token
        os.environ.pop(URL_VARIABLE, None)
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kfrl.cli", "engine", "serve", "--run-uri", self.run.uri,
                 "--parent-pid", str(os.getpid())], stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, TOKEN_VARIABLE: self.token})
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineUnavailable(f"the engine exited with status {self.proc.returncode} while starting; "
                                        f"see {self.log_path}")
            self.url = find_engine(self.run)
            if self.url:
                os.environ[URL_VARIABLE] = self.url  # and they go to it straight away
                return self
            time.sleep(0.2)
        self.stop()
        raise EngineUnavailable(f"the engine did not answer within {self.start_timeout_s:.0f}s; see {self.log_path}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and find_engine(self.run) is not None

    def restart(self) -> None:
        self.stop()
        self.start()

    def stop(self) -> None:
        import subprocess

        self._restore_environment()
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            status, _ = _http("POST", f"{self.url}/shutdown", headers={"Authorization": f"Bearer {self.token}"},
                              timeout=HEALTH_TIMEOUT_S)
            if status != 200:
                raise _Unreachable(f"HTTP {status}")
            # It finishes writing the last trainer state first (seconds; minutes for a large model).
            self.proc.wait(timeout=self.stop_timeout_s)
        except (_Unreachable, subprocess.TimeoutExpired, TypeError):
            self.proc.kill()
            self.proc.wait()

    def _restore_environment(self) -> None:
        import os

        if self._saved_env is None:
            return
        for name, value in self._saved_env.items():
            if value:
                os.environ[name] = value
            else:
                os.environ.pop(name, None)
        self._saved_env = None
