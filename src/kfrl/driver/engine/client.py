"""The thin side of a resident engine (``kfrl.driver.engine.server``): what a KFP task runs.

``dispatch`` sends a stage to the run's engine when one answers, and otherwise runs the stage in
this process (today's per-task path), so every pipeline still runs anywhere. Nothing here imports
torch: a task that hands its stage to the engine costs an HTTP call, not a model load.
"""
from __future__ import annotations

import sys

from kfrl.run import Run

HEALTH_TIMEOUT_S = 3.0


class EngineUnavailable(RuntimeError):
    """The engine did not answer (not started, killed, unreachable)."""


class EngineStageFailed(RuntimeError):
    """The engine ran the stage and it failed; the message is the stage's error."""


def find_engine(run: Run) -> str | None:
    """The URL of the engine serving ``run``, or None when none answers for it."""
    import requests

    record = run.engine()
    if not record or "url" not in record:
        return None
    try:
        answer = requests.get(record["url"].rstrip("/") + "/health", timeout=HEALTH_TIMEOUT_S)
        body = answer.json() if answer.ok else {}
    except (requests.RequestException, ValueError):
        return None
    return record["url"].rstrip("/") if body.get("run_uri") == run.uri else None


def _authorization() -> dict:
    from kfrl.driver.engine.server import engine_token

    token = engine_token()
    return {"Authorization": f"Bearer {token}"} if token else {}


def run_on_engine(url: str, stage: str, run_uri: str, iteration: int):
    """Run one stage on the engine and wait for its commit; returns a ``StageResult``."""
    import requests

    from kfrl.stages import StageResult

    try:
        answer = requests.post(f"{url}/stages", json={"run_uri": run_uri, "iteration": int(iteration),
                                                      "stage": stage}, headers=_authorization(), timeout=None)
    except requests.RequestException as err:
        raise EngineUnavailable(f"engine {url} went away during {stage} of iteration {iteration}: "
                                f"{type(err).__name__}") from err
    try:
        body = answer.json()
    except ValueError:
        body = {"error": answer.text[:500]}
    if answer.status_code != 200:
        if answer.status_code >= 500 and "error" in body:
            raise EngineStageFailed(f"{stage} of iteration {iteration} failed in the engine ({url}): {body['error']}")
        raise EngineUnavailable(f"engine {url} refused {stage}: HTTP {answer.status_code} {body}")
    return StageResult(**body)


REQUIRED_VARIABLE = "KFRL_ENGINE_REQUIRED"


def engine_required(environ=None) -> bool:
    """A task compiled as a client of a cluster engine (``KFRL_ENGINE_REQUIRED=1``): it has no GPU, so it
    never runs a GPU stage itself."""
    import os

    return (environ if environ is not None else os.environ).get(REQUIRED_VARIABLE, "") == "1"


def dispatch(stage: str, run_uri: str, iteration: int):
    """Run ``stage`` on the run's engine if one answers, else here (unless this task is a required
    client of a cluster engine: then it fails, and KFP retries it while the driver replaces the
    engine). Returns its ``StageResult``."""
    run = Run.at(run_uri)
    url = find_engine(run)
    required = engine_required()
    if url is None and required:
        raise EngineUnavailable(f"no live engine serves {run_uri} (its ENGINE.json: {run.engine() or 'none'}); this "
                                f"task has no GPU and does not run {stage} of iteration {iteration} itself. The driver "
                                "replaces a dead engine; KFP retries this task")
    if url is not None:
        try:
            return run_on_engine(url, stage, run_uri, iteration)
        except EngineUnavailable as err:
            if required:
                raise
            print(f"[kfrl] {err}; running the stage in this task instead", file=sys.stderr, flush=True)
    from kfrl.stages import run_stage

    return run_stage(stage, run_uri, int(iteration))


class EngineProcess:
    """The engine `kfrl train` starts for a run (local runner): ``kfrl engine serve`` as a child that
    exits with its parent, its output in ``log_path``."""

    def __init__(self, run: Run, log_path, start_timeout_s: float = 120.0, stop_timeout_s: float = 600.0):
        import secrets

        self.run, self.log_path, self.start_timeout_s = run, log_path, start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.proc = None
        self.url: str | None = None
        self.token = secrets.token_urlsafe(32)  # this run's; the engine and the tasks get it from the environment
        self._saved_token: str | None = None

    def start(self) -> "EngineProcess":
        import os
        import subprocess
        import time

        from kfrl.driver.engine.server import TOKEN_VARIABLE

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.run.clear_engine()  # a record left by a killed engine must not be mistaken for this one
        if self._saved_token is None:  # the driver's KFP tasks inherit its environment: they send it
            self._saved_token = os.environ.get(TOKEN_VARIABLE, "")
            os.environ[TOKEN_VARIABLE] = self.token
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

        import requests

        self._restore_token()
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            answer = requests.post(f"{self.url}/shutdown", headers={"Authorization": f"Bearer {self.token}"},
                                   timeout=HEALTH_TIMEOUT_S)
            answer.raise_for_status()
            # It finishes writing the last trainer state first (seconds; minutes for a large model).
            self.proc.wait(timeout=self.stop_timeout_s)
        except (requests.RequestException, subprocess.TimeoutExpired, TypeError):
            self.proc.kill()
            self.proc.wait()

    def _restore_token(self) -> None:
        import os

        from kfrl.driver.engine.server import TOKEN_VARIABLE

        if self._saved_token is None:
            return
        if self._saved_token:
            os.environ[TOKEN_VARIABLE] = self._saved_token
        else:
            os.environ.pop(TOKEN_VARIABLE, None)
        self._saved_token = None
