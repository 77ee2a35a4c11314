"""Multi-process stages (trainer.n_gpus_per_node > 1) on CPU over gloo: the sharded update (FSDP2,
micro-batches dealt round-robin, gradients summed) and the rollout / log-prob replicas commit what one
process commits, their trainer state resumes in one process, and a failed worker fails the stage
naming its rank with nothing committed."""
import contextlib
import os
import shutil
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from kfrl.config import load_config
from kfrl.distributed import DistributedUpdateError
from kfrl.distributed.launch import worker_env
from kfrl.run import Run
from kfrl.stages import STAGES, context, run_stage, update
from kfrl.stages.prepare import prepare_run
from kfrl.store import Store

# The demo's model; 4 prompts x 4 samples = 16 trajectories.
SMALL = ["data.train_batch_size=4", "rollout.n=4", "data.max_response_length=16", "trainer.log_generations=0",
         "trainer.val_before_train=false", "trainer.test_freq=0", "pipeline.runner=inline", "trainer.device=cpu"]
# PPO (a critic, so both updates run distributed), near-greedy rollouts; 2 mini-batches of 8
# trajectories. The actor cuts each into 3 micro-batches (3, 3, 2 rows): an odd count, so rank 1 also
# runs a zero-weighted pass; the critic into 2 (4, 4): one each.
# What one process and two compute is the same by construction wherever the work can be cut alike:
# rollout micro-batches of 2 prompts (each replica generates exactly one of them, with its seed) and
# log-prob micro-batches of 8 rows (each replica's shard), run with the same number of threads
# (``same_threads``). Greedy tokens then do not hinge on top-2 margins, and log-probs and values are
# the same numbers but for the padded width of a shard (trailing masked columns: exact zeros added to
# the attention sums), hence the 1e-5 slack. The updates differ in one way only: the gradients of the
# actor's 3 micro-batches a, b, c (each computed alike on either side) are summed as (a + b) + c by one
# process and (a + c) + b by two (the critic's 2: a + b either way, exactly); see
# ``assert_same_checkpoints`` for what that bounds.
PPO = ["algorithm.adv_estimator=gae", "rollout.top_k=1", "rollout.micro_batch_size=2",
       "rollout.log_prob_micro_batch_size_per_gpu=8", "actor.ppo_mini_batch_size=2",
       "actor.ppo_micro_batch_size_per_gpu=3", "critic.ppo_micro_batch_size_per_gpu=4"]


@contextlib.contextmanager
def same_threads(world_size: int = 2):
    """This process computes with the intra-op thread count each of ``world_size`` CPU workers gets
    (``kfrl.distributed.launch.worker_env``), so a kernel whose blocking follows the thread count splits
    its work alike on both sides."""
    saved = torch.get_num_threads()
    # What the launcher gives each worker: a share of the cores, or OMP_NUM_THREADS where it is set
    # (as under `make test`'s pytest workers).
    torch.set_num_threads(int(worker_env(0, world_size, 0, cpu=True)["OMP_NUM_THREADS"]))
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def forget_process_state() -> None:
    update.drain()
    update._RESIDENT_TRAINERS.clear()
    context._MODEL_CACHE.clear()
    context._MODEL_SLOTS.clear()


def run_iteration(root: Path, gpus: int, *extra: str, iteration: int = 1) -> Run:
    config = load_config(Path("configs/demo.yaml"), SMALL + [*extra, f"trainer.n_gpus_per_node={gpus}",
                                                             f"store.uri={root / 'store'}",
                                                             f"tracking.uri=sqlite:///{root}/m.db"])
    store = Store(str(root / "run"))
    prepare_run(store, config)
    for stage in STAGES:
        run_stage(stage, store.uri, iteration)
    return Run(store)


def committed_files(run: Run, stage: str, iteration: int = 1) -> Path:
    return run.store.committed_dir(run.manifest(stage, iteration))


def group(run: Run, stage: str, iteration: int = 1):
    manifest = run.manifest(stage, iteration)
    return pq.read_table(Path(run.store.url(f"{manifest.prefix}/{manifest.attempt}/part-00000.parquet")))


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def assert_same_checkpoints(one: Run, many: Run, stage: str, state: str, iteration: int = 1) -> None:
    """Same weights (≤ 1e-4), same trainer state: fp32 weights, a full AdamW state, the step count.

    Error model: each micro-batch's gradient is computed alike on both sides; only the sum of the
    actor's three is re-associated, so a gradient element differs by |dg| <= 2 u S (u = 2^-24, S the sum
    of its micro-batch gradients' magnitudes). AdamW's step lr g / (|g| + eps) is 1/eps-Lipschitz in g:
    over 2 steps at lr 3e-4, |dw| <= 2 lr 2 u S / eps <= 1e-4 for S <= 0.014; a larger element can only
    differ more where its micro-batch gradients cancel to within ~1e-6 of S (a sign left to rounding).
    The moments (0.1 g and 0.001 g^2 per step) move by <= 1e-6 for S up to ~40."""
    assert max_diff(load_file(committed_files(one, stage, iteration) / "model.safetensors"),
                    load_file(committed_files(many, stage, iteration) / "model.safetensors")) <= 1e-4
    a, b = committed_files(one, state, iteration), committed_files(many, state, iteration)
    assert max_diff(load_file(a / "model.safetensors"), load_file(b / "model.safetensors")) <= 1e-4
    assert (a / "trainer_state.json").read_text() == (b / "trainer_state.json").read_text()
    opt_a, opt_b = torch.load(a / "optimizer.pt"), torch.load(b / "optimizer.pt")
    assert opt_a["param_groups"] == opt_b["param_groups"]  # index-keyed, as one process writes it
    assert sorted(opt_a["state"]) == sorted(opt_b["state"]) and opt_a["state"]
    for index, moments in opt_a["state"].items():
        assert sorted(moments) == sorted(opt_b["state"][index])
        assert torch.equal(moments["step"], opt_b["state"][index]["step"])
        assert max_diff(moments, opt_b["state"][index]) <= 1e-6


@pytest.fixture(scope="module")
def ppo_runs(tmp_path_factory):
    """(one process, two processes): iteration 1 of the same PPO run."""
    forget_process_state()
    with same_threads():
        one = run_iteration(tmp_path_factory.mktemp("one"), 1, *PPO)
    forget_process_state()
    many = run_iteration(tmp_path_factory.mktemp("two"), 2, *PPO)
    return one, many


@pytest.mark.numerics
def test_a_ppo_iteration_on_two_processes_commits_what_one_process_commits(ppo_runs):
    one, many = ppo_runs
    rollout_one, rollout_many = group(one, "rollout"), group(many, "rollout")
    for column in ("sample_id", "uid", "prompt_ids", "response_ids", "finish_reason"):
        assert rollout_one.column(column).to_pylist() == rollout_many.column(column).to_pylist(), column
    for stage, column in (("rollout", "rollout_logprobs"), ("old_logprob", "old_logprobs"), ("values", "values")):
        # The same micro-batches and threads on both sides (PPO's comment): equal but for padded width.
        a, b = group(one, stage).column(column).to_pylist(), group(many, stage).column(column).to_pylist()
        assert max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b)) <= 1e-5, column
    for role, stage, state in (("actor", "update_actor", "actor_state"), ("critic", "update_critic", "critic_state")):
        m_one, m_many = one.manifest(stage, 1), many.manifest(stage, 1)
        assert m_many.info["world_size"] == 2 and m_many.info["strategy"] == "fsdp2"
        for key in ("optimizer_steps", "policy_version", "trainer_from"):
            assert m_one.info.get(key) == m_many.info.get(key), key
        assert m_many.info["optimizer_steps"] == 2  # two mini-batches
        assert sorted(m_one.metrics) == sorted(m_many.metrics)
        assert m_one.metrics[f"{role}/grad_norm"] > 0.1  # it learned: the comparison means something
        for key, value in m_one.metrics.items():
            # Means over micro-batches and the grad norm (from per-rank shards): re-associated float32
            # sums, a few u relative; the second mini-batch's values also see the first step's weight
            # differences (assert_same_checkpoints' bound, ~1e-6 relative at most): rel 1e-4.
            if not key.startswith("timing_s/"):
                assert m_many.metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
        assert many.manifest(state, 1).info["weights_attempt"] == m_many.attempt
        assert_same_checkpoints(one, many, stage, state)
    assert {"MLmodel", "tokenizer.json", "config.json"} <= set(many.manifest("update_actor", 1).names())


@pytest.mark.numerics
def test_sampled_rollouts_on_two_replicas_are_one_process_s_draws(tmp_path):
    # Sampling at temperature 1 in rollout micro-batches of 2 prompts: each replica generates whole
    # micro-batches with the seed one process uses for them, so the draws are the same.
    extra = ["rollout.micro_batch_size=2", "rollout.top_k=-1", "actor.ppo_mini_batch_size=4"]
    # With the same thread count both sides compute the same probabilities, so no draw hinges on rounding.
    rollouts = []
    for gpus in (1, 2):
        config = load_config(Path("configs/demo.yaml"), SMALL + [*extra, f"trainer.n_gpus_per_node={gpus}",
                                                                 f"store.uri={tmp_path}/s{gpus}"])
        store = Store(str(tmp_path / f"run{gpus}"))
        prepare_run(store, config)
        with same_threads() if gpus == 1 else contextlib.nullcontext():
            run_stage("rollout", store.uri, 1)
        rollouts.append(group(Run(store), "rollout"))
    one, many = rollouts
    responses = one.column("response_ids").to_pylist()
    assert len({tuple(r) for r in responses}) > len(responses) // 4  # sampled: the 4 samples of a prompt differ
    assert responses == many.column("response_ids").to_pylist()
    assert one.column("sample_id").to_pylist() == many.column("sample_id").to_pylist()


def copy_run(run: Run, target: Path, gpus: int | None = None) -> str:
    shutil.copytree(run.uri, target)
    if gpus is not None:
        config = target / "config.yaml"
        text = config.read_text()
        assert "n_gpus_per_node: 2" in text
        config.write_text(text.replace("n_gpus_per_node: 2", f"n_gpus_per_node: {gpus}"))
    return str(target)


@pytest.mark.numerics
def test_a_trainer_state_written_by_two_processes_resumes_in_one_process(ppo_runs, tmp_path):
    one, many = ppo_runs
    forget_process_state()
    resumed = {}
    for name, run, gpus in (("one", one, None), ("many", many, 1)):
        uri = copy_run(run, tmp_path / name, gpus)
        for stage in STAGES:
            run_stage(stage, uri, 2)
        resumed[name] = Run(Store(uri))
    # Iteration 2 starts from iteration 1's weights, which one and two processes computed alike only up
    # to the re-associated sums (``assert_same_checkpoints``): the near-greedy rollouts pick the same
    # tokens wherever the top-2 margin exceeds twice the largest difference between the two policies'
    # logits. Checked along the rollout (else the comparison below would mean nothing), then the tokens.
    margins, delta = margins_and_logit_difference(one, many, group(resumed["one"], "rollout", 2))
    assert min(margins) > 4 * delta, (min(margins), delta)
    assert group(resumed["one"], "rollout", 2).column("response_ids").to_pylist() == \
        group(resumed["many"], "rollout", 2).column("response_ids").to_pylist()
    # The update of iteration 2 read the state the two processes wrote: full, loadable by one process.
    assert resumed["many"].manifest("update_actor", 2).info["trainer_from"] == "store"
    assert "world_size" not in resumed["many"].manifest("update_actor", 2).info
    assert resumed["many"].manifest("update_actor", 2).info["optimizer_steps"] == 4
    assert_same_checkpoints(resumed["one"], resumed["many"], "update_actor", "actor_state", iteration=2)
    assert_same_checkpoints(resumed["one"], resumed["many"], "update_critic", "critic_state", iteration=2)


@pytest.mark.numerics
def test_a_lora_iteration_on_two_processes_commits_the_adapters_one_process_commits(tmp_path):
    """LoRA with trainer.n_gpus_per_node=2 (actor and critic adapters): every rank holds the frozen base
    and the adapters, the adapters' gradients are summed over the ranks before each step (DDP), and
    rank 0 commits what one process commits: the adapter folders, the adapter trainer states with their
    AdamW moments, the same metrics. Same error model as the full update (``assert_same_checkpoints``:
    only the sum of the actor's three micro-batch gradients is re-associated)."""
    lora = ["model.lora_rank=4", "model.lora_alpha=8", "actor.lr=5e-3", "critic.lora_rank=4", "critic.lora_alpha=8",
            "critic.lr=1e-3", "actor.use_kl_loss=true"]  # the reference: the base with the adapters off
    forget_process_state()
    with same_threads():
        one = run_iteration(tmp_path / "one", 1, *PPO, *lora)
    forget_process_state()
    many = run_iteration(tmp_path / "two", 2, *PPO, *lora)
    assert group(one, "rollout").column("response_ids").to_pylist() == \
        group(many, "rollout").column("response_ids").to_pylist()
    for role, stage, state in (("actor", "update_actor", "actor_state"), ("critic", "update_critic", "critic_state")):
        m_one, m_many = one.manifest(stage, 1), many.manifest(stage, 1)
        assert (m_many.info["world_size"], m_many.info["strategy"]) == (2, "ddp")
        assert m_one.info["optimizer_steps"] == m_many.info["optimizer_steps"] == 2
        assert m_one.metrics[f"{role}/grad_norm"] > 1e-3  # it learned: the comparison means something
        for key, value in m_one.metrics.items():
            if not key.startswith("timing_s/"):
                assert m_many.metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
        names = set(m_one.names())
        assert "adapter_model.safetensors" in names and "model.safetensors" not in names
        assert names == set(m_many.names())
        a, b = committed_files(one, stage), committed_files(many, stage)
        assert max_diff(load_file(a / "adapter_model.safetensors"), load_file(b / "adapter_model.safetensors")) <= 1e-4
        a, b = committed_files(one, state), committed_files(many, state)
        assert max_diff(load_file(a / "adapter_model.safetensors"), load_file(b / "adapter_model.safetensors")) <= 1e-4
        opt_a, opt_b = torch.load(a / "optimizer.pt"), torch.load(b / "optimizer.pt")
        assert opt_a["param_groups"] == opt_b["param_groups"] and sorted(opt_a["state"]) == sorted(opt_b["state"])
        for index, moments in opt_a["state"].items():
            assert torch.equal(moments["step"], opt_b["state"][index]["step"])
            assert max_diff(moments, opt_b["state"][index]) <= 1e-6


@torch.no_grad()
def margins_and_logit_difference(one: Run, many: Run, rollout) -> tuple[list[float], float]:
    """Along ``rollout``'s responses (teacher-forced): the top-2 logit margins of one process's policy
    after iteration 1, and the largest |logit difference| between that policy and two processes'."""
    from kfrl.models.hf_io import load_causal_lm
    from numerics import top2_margins

    policies = [load_causal_lm(committed_files(run, "update_actor"), torch.float32).eval() for run in (one, many)]
    margins, delta = [], 0.0
    for prompt, response in zip(rollout.column("prompt_ids").to_pylist(), rollout.column("response_ids").to_pylist()):
        ids = torch.tensor([prompt + response])
        logits = [p(ids).logits[0, len(prompt) - 1:len(prompt) - 1 + len(response)].double() for p in policies]
        margins += top2_margins(logits[0]).tolist()
        delta = max(delta, float((logits[0] - logits[1]).abs().max()))
    return margins, delta


def without_actor_update(many: Run, tmp_path: Path) -> tuple[str, Run, dict]:
    """A copy of the two-process run with iteration 1's actor update (weights and state) uncommitted,
    and the weights that update had committed."""
    uri = copy_run(many, tmp_path / "run")
    run = Run(Store(uri))
    expected = load_file(committed_files(many, "update_actor") / "model.safetensors")
    for prefix in ("iter-000001/update_actor", "iter-000001/actor_state"):
        run.store.remove_commit(prefix)
    return uri, run, expected


def test_a_worker_killed_at_commit_fails_the_stage_naming_its_rank_and_commits_nothing(ppo_runs, tmp_path,
                                                                                       monkeypatch):
    uri, run, expected = without_actor_update(ppo_runs[1], tmp_path)
    forget_process_state()
    monkeypatch.setenv("KFRL_KILL_AT", "commit@1")  # rank 0, the only one that commits, dies at its first
    with pytest.raises(DistributedUpdateError, match=r"distributed update_actor of iteration 1: rank 0 of 2 was "
                                                      r"killed by SIGKILL \(the other processes were stopped\)"):
        run_stage("update_actor", uri, 1)
    assert not run.is_committed("update_actor", 1) and not run.is_committed("actor_state", 1)
    monkeypatch.delenv("KFRL_KILL_AT")
    result = run_stage("update_actor", uri, 1)  # the retry commits what the first launch would have
    assert not result.cached and run.manifest("actor_state", 1).info["weights_attempt"] == \
        run.manifest("update_actor", 1).attempt
    assert max_diff(expected, load_file(committed_files(run, "update_actor") / "model.safetensors")) <= 1e-6


def test_the_launcher_stops_the_other_ranks_when_one_fails():
    from kfrl.distributed.launch import run_processes

    script = ("import os, sys, time\n"
              "if os.environ['RANK'] == '1':\n"
              "    print('loading', flush=True); print('ValueError: bad input', file=sys.stderr); sys.exit(3)\n"
              "time.sleep(120)\n")
    started = time.monotonic()
    with pytest.raises(DistributedUpdateError) as err:
        run_processes([sys.executable, "-c", script], 2, what="a test group", cpu=True)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("a test group: rank 1 of 2 exited with status 3 (the other processes were stopped)")
    assert message.endswith("its last lines: loading | ValueError: bad input")
    assert time.monotonic() - started < 30  # rank 0 was killed, not waited for


def test_micro_batches_are_dealt_round_robin_and_shards_follow_prompt_groups():
    from kfrl.distributed.parallel import DataParallel
    from kfrl.distributed.replicas import group_bounds, shard_bounds

    # 3 micro-batches on 2 ranks: rank 0 gets 0 and 2, rank 1 gets 1 and one zero-weighted pass.
    assert DataParallel(0, 2).assignment(3) == ([0, 2], 0)
    assert DataParallel(1, 2).assignment(3) == ([1], 1)
    assert DataParallel(3, 4).assignment(2) == ([], 1)
    plan = DataParallel(1, 2)
    micro = [torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([4])]
    passes = [(rows.tolist(), real) for rows, real in plan.passes(micro)]
    assert passes == [([2, 3], True), ([0, 1], False)]
    metrics = {"loss": []}
    for real in (True, False):
        metrics["loss"].append(1.0)
        plan.recorded(metrics, real)
    assert metrics == {"loss": [1.0]}  # the zero-weighted pass reports nothing
    assert shard_bounds(10, 2, unit=4) == [(0, 8), (8, 10)]
    assert shard_bounds(3, 4) == [(0, 1), (1, 2), (2, 3)]
    assert group_bounds(["a", "a", "b", "b", "c", "c"], 2) == [(0, 4), (4, 6)]


def test_deepspeed_that_is_not_installed_is_one_line_naming_the_extra():
    import importlib.util
    from types import SimpleNamespace

    from kfrl.distributed.launch import run_distributed_update

    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("deepspeed is installed here")
    ctx = SimpleNamespace(config=load_config(None, ["actor.strategy=deepspeed", "trainer.n_gpus_per_node=2"]),
                          run_uri="/nowhere", iteration=1, device="cpu")
    with pytest.raises(DistributedUpdateError, match=r"needs DeepSpeed, which is not installed: pip install "
                                                      r"kfrl\[gpu\], or use actor.strategy=fsdp2"):
        run_distributed_update(ctx, "actor", "update_actor", 2)


def test_the_trainjob_command_under_torchrun_commits_what_the_launcher_commits(ppo_runs, tmp_path):
    """What every node of a multi-node job runs (the TrainJob's command, with torchrun's settings in the
    PET_* variables the torch-distributed runtime sets), here one node with two CPU processes."""
    import os
    import socket
    import subprocess

    from kfrl.distributed.multinode import trainjob_manifest

    uri, run, expected = without_actor_update(ppo_runs[1], tmp_path)
    config = load_config(Path("configs/demo.yaml"), SMALL + PPO + ["trainer.nnodes=2", "trainer.n_gpus_per_node=2"])
    command = trainjob_manifest(config, uri, 1, "actor", "kfrl-test")["spec"]["trainer"]["command"]
    assert command[:3] == ["torchrun", "-m", "kfrl.stages.update_worker"]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PET_NNODES": "1", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "0",
           "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", *command[1:]], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = run.manifest("update_actor", 1)
    assert manifest.info["world_size"] == 2
    assert run.manifest("actor_state", 1).info["weights_attempt"] == manifest.attempt
    assert max_diff(expected, load_file(committed_files(run, "update_actor") / "model.safetensors")) <= 1e-6
    again = subprocess.run([sys.executable, "-m", "torch.distributed.run", *command[1:]], env=env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and run.manifest("update_actor", 1).attempt == manifest.attempt  # a retry: no-op
