"""The weights commit written in the background (a process that lives on: the resident engine, the
inline runner): the process sees it at once, the next commit with files waits for it, LATEST moves
after it, and a failure stops the run with nothing committed for that update."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kfrl.config import load_config
from kfrl.models import hf_io, host_memory
from kfrl.run import Run
from kfrl.stages import STAGES, run_stage, update
from kfrl.stages.prepare import prepare_run
from kfrl import store as store_module
from kfrl.store import InFlightManifest, Store, StoreError, settle_in_flight

SMALL = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=4", "data.max_response_length=16",
         "actor.ppo_micro_batch_size_per_gpu=8", "pipeline.runner=inline", "trainer.total_iterations=3"]


@pytest.fixture()
def run(tmp_path):
    config = load_config(Path("configs/demo.yaml"), SMALL + [f"store.uri={tmp_path}"])
    store = Store(str(tmp_path / "run"))
    prepare_run(store, config)
    update.write_states_in_background(True)
    yield Run.at(store.uri)
    try:
        update.drain()
    except StoreError:
        pass
    update.write_states_in_background(False)


def slow_weights(monkeypatch, seconds: float, started: threading.Event | None = None, fail: bool = False,
                 gate: threading.Event | None = None):
    original = hf_io.write_safetensors

    def slowly(tensors, folder, **kwargs):
        if started is not None:
            started.set()
        time.sleep(seconds)
        if gate is not None:
            assert gate.wait(60)
        if fail:
            raise OSError(28, "No space left on device")
        return original(tensors, folder, **kwargs)

    monkeypatch.setattr(hf_io, "write_safetensors", slowly)


def test_the_update_returns_before_its_weights_are_written_and_the_next_rollout_commits_after_them(run, monkeypatch):
    sets_before = host_memory.host_buffers("weights/actor").sets
    for stage in STAGES:
        run_stage(stage, run.uri, 1)
    run.set_latest(1)
    settle_in_flight()  # iteration 1's weights are written before the writer is slowed
    gate = threading.Event()  # the weights stay unwritten until the test lets them
    slow_weights(monkeypatch, 0.0, gate=gate)
    for stage in STAGES[:STAGES.index("update_actor") + 1]:
        run_stage(stage, run.uri, 2)
    seen = run.store.manifest("iter-000002/update_actor")
    assert isinstance(seen, InFlightManifest)  # this process sees it committed; its files are still written
    assert run.is_committed("update_actor", 2) and seen.info["policy_version"] == 2
    manifest_file = Path(run.store.manifest_url("iter-000002/update_actor"))
    assert not manifest_file.exists()
    # The files are written from a copy: the training copy may change meanwhile (the next update).
    training = update._RESIDENT_TRAINERS["actor"][1]
    name, weight = next(iter(training.state_dict().items()))
    before = weight.detach().clone()
    with torch.no_grad():
        weight.add_(1.0)
    run.set_latest(2)
    assert run.latest() == 1  # LATEST waits for the commit
    for stage in STAGES[STAGES.index("update_actor") + 1:]:
        run_stage(stage, run.uri, 2)
    # The next rollout runs on the handed-off weights and does not wait for their files: its tables are
    # in place and readable in this process now; only its manifest is published after the update's.
    run_stage("rollout", run.uri, 3)
    rollout_seen = run.store.manifest("iter-000003/rollout")
    assert isinstance(rollout_seen, InFlightManifest) and rollout_seen.names()
    assert all(run.store.read_file(rollout_seen, name) for name in rollout_seen.names())
    rollout_file = Path(run.store.manifest_url("iter-000003/rollout"))
    assert not manifest_file.exists() and not rollout_file.exists()
    assert run.latest() == 1
    gate.set()
    settle_in_flight()
    assert manifest_file.stat().st_mtime_ns <= rollout_file.stat().st_mtime_ns
    assert run.latest() == 2
    assert {"model.safetensors", "config.json", "MLmodel"} <= set(seen.names())  # files: after the wait
    assert torch.equal(load_file(run.store.committed_dir(seen) / "model.safetensors")[name], before)
    with torch.no_grad():
        weight.sub_(1.0)
    # Each update copied the weights into the host buffers the one before had used (and given back).
    assert host_memory.host_buffers("weights/actor").sets - sets_before <= 1


def test_a_failed_background_write_commits_nothing_and_stops_the_next_commit(run, monkeypatch):
    for stage in STAGES:
        run_stage(stage, run.uri, 1)
    settle_in_flight()  # iteration 1's weights are written before the writer fails (on a busy machine: not yet)
    started = threading.Event()
    slow_weights(monkeypatch, 0.2, started, fail=True)
    for stage in STAGES[:STAGES.index("update_actor") + 1]:
        run_stage(stage, run.uri, 2)
    assert started.wait(10)
    assert store_module._IN_FLIGHT[run.store.manifest_url("iter-000002/update_actor")].done.wait(10)
    with pytest.raises(StoreError, match="iter-000002/update_actor.*No space left"):
        for stage in STAGES[STAGES.index("update_actor") + 1:] + ("rollout",):
            run_stage(stage, run.uri, 2 if stage != "rollout" else 3)
    assert not Path(run.store.manifest_url("iter-000002/update_actor")).exists()
    assert not Path(run.store.manifest_url("iter-000003/rollout")).exists()
    # Raised once: the update is not committed for this process either, and running it again commits it.
    monkeypatch.undo()
    assert run.store.manifest("iter-000002/update_actor") is None
    assert not run_stage("update_actor", run.uri, 2).cached
    update.drain()
    assert Path(run.store.manifest_url("iter-000002/update_actor")).exists()


def test_weights_written_beside_running_stages_are_paced_but_the_last_iterations(run, monkeypatch):
    """A buffered GB-sized weights write makes every small commit beside it wait for the journal (0.14-0.31
    s at worst for 3 GiB on ext4, ``bench/fsync_beside_write.py``): the background weights commits go
    through ``PacedWriter``, but the last iteration's, which the end of the run waits for."""
    written = []
    original = hf_io.write_safetensors

    def recording(tensors, folder, **kwargs):
        written.append((str(folder), kwargs.get("paced", False)))
        return original(tensors, folder, **kwargs)

    monkeypatch.setattr(hf_io, "write_safetensors", recording)
    for iteration in (1, 2, 3):
        for stage in STAGES:
            run_stage(stage, run.uri, iteration)
    update.drain()
    weights = [paced for folder, paced in written if "update_actor" in folder]
    assert weights == [True, True, False], written
    assert [run.is_committed("update_actor", i) for i in (1, 2, 3)] == [True, True, True]
