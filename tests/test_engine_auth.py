"""The engine is not an open door: a request without the run's token, with another token, or for
another run is refused and changes nothing; the token never appears in ENGINE.json, the engine's log
or its command line."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import requests

from kfrl.config import load_config
from kfrl.run import Run

REPO = Path(__file__).resolve().parents[1]
SMALL = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "data.max_response_length=8",
         "trainer.log_generations=0", "trainer.val_before_train=false"]


def test_requests_without_the_runs_token_or_for_another_run_are_refused(tmp_path):
    from kfrl.driver.engine.client import EngineProcess
    from kfrl.driver.engine.server import TOKEN_VARIABLE
    from kfrl.stages.prepare import prepare_run

    config = load_config(REPO / "configs/demo.yaml", SMALL + [f"store.uri={tmp_path / 's'}"])
    run = Run.at(str(tmp_path / "s" / "demo" / "r"))
    prepare_run(run.store, config)
    before = os.environ.get(TOKEN_VARIABLE)
    engine = EngineProcess(run, tmp_path / "engine.log").start()
    try:
        stage = {"run_uri": run.uri, "iteration": 1, "stage": "rollout"}
        missing = requests.post(f"{engine.url}/stages", json=stage, timeout=30)
        wrong = requests.post(f"{engine.url}/stages", json=stage, timeout=30,
                              headers={"Authorization": "Bearer " + "x" * 43})
        other = requests.post(f"{engine.url}/stages", json={**stage, "run_uri": str(tmp_path / "other")}, timeout=30,
                              headers={"Authorization": f"Bearer {engine.token}"})
        stop = requests.post(f"{engine.url}/shutdown", timeout=30)
        assert (missing.status_code, wrong.status_code, other.status_code, stop.status_code) == (401, 403, 409, 401)
        assert not run.is_committed("rollout", 1) and engine.alive()  # nothing ran, nothing stopped
        assert os.environ[TOKEN_VARIABLE] == engine.token  # the driver's KFP tasks inherit it
        ran = requests.post(f"{engine.url}/stages", json=stage, timeout=300,
                            headers={"Authorization": f"Bearer {engine.token}"})
        assert ran.status_code == 200 and run.is_committed("rollout", 1)
        record = run.engine()
        assert record and engine.token not in str(record)
        command = Path(f"/proc/{engine.proc.pid}/cmdline").read_bytes().decode(errors="replace")
        assert engine.token not in command
    finally:
        engine.stop()
    assert os.environ.get(TOKEN_VARIABLE) == before  # given back as it was
    assert engine.proc.returncode == 0 and run.engine() is None  # the authorised shutdown stopped it
    assert engine.token not in (tmp_path / "engine.log").read_text()


def test_an_engine_without_a_token_does_not_start(tmp_path):
    from kfrl.stages.prepare import prepare_run

    config = load_config(REPO / "configs/demo.yaml", SMALL + [f"store.uri={tmp_path / 's'}"])
    run = Run.at(str(tmp_path / "s" / "demo" / "r"))
    prepare_run(run.store, config)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KFRL_ENGINE_TOKEN")}
    result = subprocess.run([sys.executable, "-m", "kfrl.cli", "engine", "serve", "--run-uri", run.uri],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0 and "KFRL_ENGINE_TOKEN" in result.stderr
    assert run.engine() is None
    # A token from a file (a mounted Kubernetes secret) is read like the variable.
    from kfrl.driver.engine.server import engine_token

    (tmp_path / "token").write_text("s3cr3t-token-from-a-secret\n")
    assert engine_token({"KFRL_ENGINE_TOKEN_FILE": str(tmp_path / "token")}) == "s3cr3t-token-from-a-secret"
