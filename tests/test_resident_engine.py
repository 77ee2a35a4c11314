"""The resident engine: KFP tasks hand their stage to one long-lived process per run, with the same
committed results as tasks that each load what they need, in less time; a killed engine loses nothing."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kfrl.config import load_config
from kfrl.driver.controller import train
from kfrl.run import Run
from kfrl.stages import STAGES
from run_tables import committed_tables

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SMALL = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "rollout.n=4", "data.max_response_length=16",
         "actor.ppo_micro_batch_size_per_gpu=8", "trainer.log_generations=0", "trainer.val_before_train=false",
         "pipeline.fuse=none", "pipeline.runner=local"]


def test_resident_and_per_task_commit_the_same_batches_and_resident_is_faster(tmp_path):
    results = {}
    for engines in ("per_task", "resident"):
        config = load_config(Path("configs/demo.yaml"), SMALL + [
            f"pipeline.engines={engines}", f"store.uri={tmp_path / engines}", f"tracking.uri=sqlite:///{tmp_path}/m.db",
            f"pipeline.pipeline_root={tmp_path / 'kfp'}"])
        started = time.perf_counter()
        summary = train(config, run_id=engines, iterations=2)
        results[engines] = (time.perf_counter() - started, Run.at(summary.run_uri), summary)
    (per_task_s, per_task_run, per_task), (resident_s, resident_run, resident) = results["per_task"], results["resident"]
    expected, found = committed_tables(per_task_run, (1, 2)), committed_tables(resident_run, (1, 2))
    assert sorted(found) == sorted(expected)
    for key, table in expected.items():
        assert found[key].equals(table), key
    for iteration in (1, 2):
        assert resident.iterations[iteration]["critic/score/mean"] == per_task.iterations[iteration]["critic/score/mean"]
    # The engine's second update started from its resident copy and handed the new weights to its
    # rollout in memory; per task, each loaded them from the store: the same batches and weights.
    assert resident_run.manifest("update_actor", 2).info["trainer_from"] == "memory"
    assert per_task_run.manifest("update_actor", 2).info["trainer_from"] == "store"
    for iteration in (1, 2):
        weights = [load_file(run.store.committed_dir(run.manifest("update_actor", iteration)) / "model.safetensors")
                   for run in (per_task_run, resident_run)]
        assert weights[0].keys() == weights[1].keys()
        assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    # Tasks without an engine write a trainer state every iteration (the newest two kept); the engine
    # (trainer_state_freq 5) writes the last one, before it stops.
    assert [i for i in (1, 2) if per_task_run.is_committed("actor_state", i)] == [1, 2]
    assert [i for i in (1, 2) if resident_run.is_committed("actor_state", i)] == [2]
    engine_log = (tmp_path / "kfp" / "logs" / "resident" / "engine.log").read_text()
    assert engine_log.count("[engine] iteration") == 2 * len(STAGES)  # every stage ran in the engine
    assert resident_run.engine() is None  # stopped with the run
    assert resident_s <= 0.5 * per_task_s, (resident_s, per_task_s)


def test_a_task_without_an_engine_runs_the_stage_itself_and_never_imports_torch_with_one(tmp_path):
    from kfrl.driver.engine.client import EngineProcess
    from kfrl.stages.prepare import prepare_run

    config = load_config(Path("configs/demo.yaml"), SMALL + [f"store.uri={tmp_path / 's'}"])
    run = Run.at(str(tmp_path / "s" / "demo" / "r"))
    prepare_run(run.store, config)
    probe = ("import sys; from kfrl.driver.engine.client import dispatch; r = dispatch(sys.argv[2], sys.argv[1], 1); "
             "print(r.stage, r.cached, 'torch' in sys.modules)")
    engine = EngineProcess(run, tmp_path / "engine.log").start()
    try:
        thin = subprocess.run([sys.executable, "-c", probe, run.uri, "rollout"], capture_output=True, text=True,
                              timeout=300)
    finally:
        engine.stop()
    assert thin.stdout.split() == ["rollout", "False", "False"], thin.stderr  # ran in the engine; no torch here
    assert run.engine() is None
    alone = subprocess.run([sys.executable, "-c", probe, run.uri, "score"], capture_output=True, text=True, timeout=300)
    assert alone.stdout.split() == ["score", "False", "True"], alone.stderr  # no engine: ran here, loading torch


def test_killing_the_engine_mid_run_loses_and_repeats_nothing(tmp_path):
    store, db = tmp_path / "store", tmp_path / "m.db"
    args = [sys.executable, "-m", "kfrl.cli", "train", "--config", "configs/demo.yaml", "--store", str(store),
            "--tracking-uri", f"sqlite:///{db}", "--run-id", "k", "-n", "2", *SMALL,
            f"pipeline.pipeline_root={tmp_path / 'kfp'}"]
    run = Run.at(str(store / "demo" / "k"))
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not run.is_committed("score", 1):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    os.kill(run.engine()["pid"], signal.SIGKILL)  # the engine dies between or inside stages
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output
    assert run.latest() == 2
    first = {stage: run.manifest(stage, 1).attempt for stage in STAGES}
    again = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    assert {stage: run.manifest(stage, 1).attempt for stage in STAGES} == first  # nothing redone


def test_a_fused_task_hands_its_whole_group_over_in_one_request_and_imports_almost_nothing(tmp_path):
    """What keeps a task cheap on the local runner (~0.18 s on 2 cores): the engine's URL from the
    environment (no store read), one request for the group, and no torch, config models or HTTP
    package imported in the task."""
    import json
    import urllib.request

    from kfrl.driver.engine.client import EngineProcess
    from kfrl.stages import FUSED_GROUPS
    from kfrl.stages.prepare import prepare_run

    config = load_config(Path("configs/demo.yaml"), SMALL + [f"store.uri={tmp_path / 's'}"])
    run = Run.at(str(tmp_path / "s" / "demo" / "r"))
    prepare_run(run.store, config)
    probe = ("import sys, json; from kfrl.driver.engine.client import dispatch_group; "
             "r = dispatch_group('iteration', sys.argv[1], 1); "
             "print(json.dumps([[x.stage, x.skipped != ''] for x in r])); "
             "print(json.dumps(sorted(m for m in ('torch', 'pydantic', 'requests', 'kfrl.config', 'kfrl.store', "
             "'kfrl.stages') if m in sys.modules)))")
    engine = EngineProcess(run, tmp_path / "engine.log").start()
    try:
        assert os.environ["KFRL_ENGINE_URL"] == engine.url
        task = subprocess.run([sys.executable, "-c", probe, run.uri], capture_output=True, text=True, timeout=300)
        with urllib.request.urlopen(engine.url + "/health") as answer:
            health = json.load(answer)
        bad = urllib.request.Request(engine.url + "/stages", method="POST", data=json.dumps(
            {"run_uri": run.uri, "iteration": 1, "group": "everything"}).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {engine.token}"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(bad)
    finally:
        engine.stop()
    assert "KFRL_ENGINE_URL" not in os.environ  # the driver's environment is given back
    stages, imported = task.stdout.splitlines()
    assert [stage for stage, _ in json.loads(stages)] == list(FUSED_GROUPS["iteration"]), task.stderr
    assert json.loads(imported) == [], "a task that hands its stages over imported " + imported
    assert health["stages_run"] == len(FUSED_GROUPS["iteration"])
    assert refused.value.code == 400 and "one group of infer, train, iteration" in refused.value.read().decode()
    assert run.latest() is None and run.is_committed("update_actor", 1)  # the driver records; the stages committed
