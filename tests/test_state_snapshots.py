"""Trainer-state snapshots off the critical path: host buffers built ahead on a thread are the ones a
snapshot fills (nothing is allocated when it is due), page-locked tensors on CUDA, the paced writer
writes the same bytes as a plain write, and a state due while the previous one is still being written
is put off instead of holding up the next update."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kfrl.models import hf_io, host_memory
from kfrl.models.host_memory import HostBuffers, on_host, snapshot_layout


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50))
    model[1].weight = model[0].weight  # tied, as an LM head and its embedding
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_reserved_set_is_filled_in_place_by_the_first_snapshot():
    model, optimizer = _model_and_optimizer()
    state = (model.state_dict(), optimizer.state_dict())
    layout = snapshot_layout(state)
    # Tied weights once: embedding/head weight, head bias; per parameter exp_avg, exp_avg_sq, step.
    assert [shape for shape, _, _ in layout] == [(50, 8), (50,), (), (50, 8), (50, 8), (), (50,), (50,)]
    pool = HostBuffers()
    assert pool.reserve(layout) and not pool.reserve(layout)  # once per pool
    buffers = pool.take()  # waits for the thread
    assert pool.sets == 1 and len(buffers) == len(layout)
    before = [t.data_ptr() for t in buffers]
    model_copy, optimizer_copy = on_host(state, buffers=buffers)
    assert [t.data_ptr() for t in buffers] == before  # nothing allocated at the snapshot
    assert model_copy["1.weight"] is model_copy["0.weight"]
    assert torch.equal(model_copy["0.weight"], model[0].weight.detach())
    assert torch.equal(optimizer_copy["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert not torch.equal(model_copy["0.weight"], model[0].weight.detach())  # a copy, not a view


def test_the_update_reserves_the_trainer_state_buffers_and_the_due_snapshot_uses_them(tmp_path):
    from kfrl.run import Run
    from kfrl.stages import STAGES, run_stage, update

    host_memory._HOST_BUFFERS.pop("trainer_state/actor", None)
    store = _small_run(tmp_path, "trainer.total_iterations=3", "trainer.trainer_state_freq=3")
    update.write_states_in_background(True)
    try:
        for iteration in (1, 2, 3):
            for stage in STAGES:
                run_stage(stage, store.uri, iteration)
            Run.at(store.uri).set_latest(iteration)
            pool = host_memory.host_buffers("trainer_state/actor")
            assert pool.sets == 1  # built after iteration 1's update, never again
        update.drain()
    finally:
        update.write_states_in_background(False)
    run = Run.at(store.uri)
    assert run.is_committed("actor_state", 3) and not run.is_committed("actor_state", 1)


def _small_run(tmp_path, *extra):
    from kfrl.config import load_config
    from kfrl.stages.prepare import prepare_run
    from kfrl.store import Store

    config = load_config(Path("configs/demo.yaml"), [
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "data.max_response_length=8",
        "pipeline.runner=inline", f"store.uri={tmp_path}", *extra])
    store = Store(str(tmp_path / "run"))
    prepare_run(store, config)
    return store


def test_a_state_due_while_the_last_one_is_written_is_put_off_and_the_updates_do_not_wait(tmp_path, monkeypatch):
    import threading

    from kfrl.run import Run
    from kfrl.stages import STAGES, run_stage, update

    store = _small_run(tmp_path, "trainer.total_iterations=6", "trainer.trainer_state_freq=2")
    release, writing = threading.Event(), threading.Event()
    original = update._write_state

    def slow_disk(ctx, *args, **kwargs):
        if ctx.iteration == 2:  # the first write hangs until released
            writing.set()
            assert release.wait(60), "an update waited for the trainer-state write of iteration 2"
        return original(ctx, *args, **kwargs)

    monkeypatch.setattr(update, "_write_state", slow_disk)
    update.write_states_in_background(True)
    deferred = {}
    try:
        for iteration in range(1, 7):
            if iteration == 6:
                assert update._PENDING["actor"].thread.is_alive()  # updates 3-5 ran beside the hung write
                release.set()
            for stage in STAGES:
                result = run_stage(stage, store.uri, iteration)
                if stage == "update_actor":
                    deferred[iteration] = result.metrics.get("perf/trainer_state_deferred", 0.0)
            Run.at(store.uri).set_latest(iteration)
            if iteration == 2:
                assert writing.wait(60)
        update.drain()
    finally:
        release.set()
        update.write_states_in_background(False)
    run = Run.at(store.uri)
    # Due at 2, 4 and 6 (the last): 4 was put off (the write of 2 still ran), and again at 5; the
    # last state is never put off.
    assert deferred == {1: 0.0, 2: 0.0, 3: 0.0, 4: 1.0, 5: 1.0, 6: 0.0}
    assert [i for i in range(1, 7) if run.is_committed("actor_state", i)] == [2, 6]


def test_paced_files_equal_plain_ones(tmp_path):
    torch.manual_seed(0)
    tensors = {"a": torch.randn(300, 70), "b": torch.randn(5).to(torch.bfloat16), "empty": torch.zeros(0),
               "c": torch.arange(1000, dtype=torch.int64)}
    plain, paced = tmp_path / "plain", tmp_path / "paced"
    hf_io.write_safetensors(tensors, plain)
    hf_io.write_safetensors(tensors, paced, paced=True)
    assert (paced / "model.safetensors").read_bytes() == (plain / "model.safetensors").read_bytes()
    # Chunks smaller than the file, so the write-out of earlier chunks is waited for on the way.
    state = {"state": {0: {"exp_avg": torch.randn(400, 300)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    with hf_io.PacedWriter(tmp_path / "opt.pt", chunk=64 * 1024) as out:
        torch.save(state, out)
    loaded = torch.load(tmp_path / "opt.pt", weights_only=True)
    assert torch.equal(loaded["state"][0]["exp_avg"], state["state"][0]["exp_avg"])


@pytest.mark.parametrize("paced", [False, True])
def test_a_full_disk_under_a_trainer_state_write_is_reported_as_such_naming_the_file(tmp_path, monkeypatch, paced):
    """torch.save turns a failed write into "unexpected pos 704 vs 598" (measured on a full tmpfs); the
    trainer state's writer raises the write's own error instead, with the file's path."""
    import errno
    import os

    target, real_write, writes = tmp_path / "optimizer.pt", os.write, []

    def write(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}") == str(target):
            writes.append(len(data))
            if len(writes) > 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(hf_io.os, "write", write)
    with pytest.raises(OSError, match=f"writing {target} failed: No space left on device") as caught:
        hf_io.torch_save({"exp_avg": torch.randn(100_000)}, target, paced=paced)
    assert caught.value.errno == errno.ENOSPC and len(writes) == 3


def test_paced_writes_wait_chunk_by_chunk_until_someone_waits_for_them(tmp_path):
    calls = []
    for hurry in (False, True):
        writer = hf_io.PacedWriter(tmp_path / f"f{hurry}", chunk=1024)
        writer._sync_range = lambda fd, offset, length, flags: calls.append((hurry, offset, length, flags))
        if hurry:
            hf_io.PACING_OFF.set()
        try:
            with writer:
                writer.write(bytes(4096))
        finally:
            hf_io.PACING_OFF.clear()
    wait = hf_io._SYNC_WAIT_BEFORE | hf_io._SYNC_WRITE | hf_io._SYNC_WAIT_AFTER
    # Each 1 KiB chunk's write-out started as it was written; the one before it waited for.
    assert calls == [(False, 0, 1024, hf_io._SYNC_WRITE), (False, 1024, 1024, hf_io._SYNC_WRITE),
                     (False, 0, 1024, wait), (False, 2048, 1024, hf_io._SYNC_WRITE), (False, 1024, 1024, wait),
                     (False, 3072, 1024, hf_io._SYNC_WRITE), (False, 2048, 1024, wait)]
    assert (tmp_path / "fTrue").stat().st_size == 4096


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_snapshots_from_cuda_land_in_page_locked_memory():
    source = torch.randn(1024, 1024, device="cuda")  # 4 MiB: over SMALL_TENSOR
    host = host_memory.host_empty(source.shape, source.dtype, page_locked=True)
    assert host_memory.is_page_locked(host) and host.is_pinned()
    host.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(host, source.cpu())
    host_memory.release(host)
    assert not host_memory.is_page_locked(host)


def test_a_copy_made_beside_the_stages_holds_the_values_at_the_call_in_the_pool_buffers():
    pool = host_memory.HostBuffers()
    source = {"w": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(2)}
    buffers = pool.take()
    copying = host_memory.on_host_later(source, torch.bfloat16, buffers)
    source["w"].add_(100.0)  # on the CPU the copy is made at the call
    copied = copying.result()
    assert torch.equal(copied["w"], torch.arange(6, dtype=torch.bfloat16).view(2, 3))
    assert copied["b"].dtype == torch.bfloat16 and len(buffers) == 2
    assert copied["w"].data_ptr() == buffers[0].data_ptr()  # into the set, reused by the next copy


def test_a_weights_pool_builds_a_spare_set_ahead_when_its_free_sets_run_out():
    pool = host_memory.HostBuffers(spare_up_to=3)
    source = {"w": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(2)}
    first = pool.take()
    assert first == [] and pool.sets == 1  # nothing to copy the layout of yet: allocated by the copy
    host_memory.on_host_later(source, torch.bfloat16, first).result()
    pool.give_back(first)  # its files are written
    assert pool.take() is first and pool.sets == 2  # the last free set taken: a spare is being built
    spare = pool.take()  # a snapshot due while the first is still being written gets the spare
    assert [(tuple(t.shape), t.dtype) for t in spare] == [((2, 3), torch.bfloat16), ((2,), torch.bfloat16)]
    assert {t.data_ptr() for t in spare}.isdisjoint(t.data_ptr() for t in first)
    before = [t.data_ptr() for t in spare]
    copied = host_memory.on_host_later(source, torch.bfloat16, spare).result()
    assert [t.data_ptr() for t in spare] == before and torch.equal(copied["b"], torch.ones(2, dtype=torch.bfloat16))
    assert pool.sets == 3 and pool.spares_built == 2  # taking the spare started the next, up to three sets
    assert len(pool.take()) == 2 and pool.sets == 3
    assert pool.take() == [] and pool.sets == 4  # past three: built on the spot, as without spares
    unspared = host_memory.HostBuffers()
    unspared.give_back(unspared.take())
    unspared.take()
    assert unspared.sets == 1 and unspared.spares_built == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_copy_from_cuda_runs_beside_the_next_kernels_and_keeps_the_values_at_the_call():
    big = torch.zeros(64, 2**20, device="cuda", dtype=torch.bfloat16)  # 128 MiB: ~2.5 ms over PCIe
    small = torch.zeros(16, device="cuda", dtype=torch.bfloat16)  # page-locked too: no copy blocks the host
    torch.cuda._sleep(50_000_000)  # queued before the copy, with the changes below: the copy waits for them
    big.add_(1.0)
    small.add_(2.0)
    copying = host_memory.on_host_later({"big": big, "small": small}, buffers=[])
    torch.cuda._sleep(2_000_000_000)  # ~1 s queued after the copy: it must not wait for this
    copying.wait()
    still_running = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    big.add_(1.0)
    copied = copying.result()
    assert still_running
    assert bool((copied["big"] == 1.0).all()) and bool((copied["small"] == 2.0).all())
    assert host_memory.is_page_locked(copied["big"]) and host_memory.is_page_locked(copied["small"])
