"""The two checkpoint kinds: every iteration commits the policy weights (inference dtype, what other
processes load); the trainer state (fp32 weights + optimizer) is its own commit, written off the
critical path where the process lives on, retained for the last few iterations, and rebuilt exactly
when a kill lost it. Inside one process the update hands its weights to the inference copies, with
the same results as loading them from the store."""
from pathlib import Path

import torch
from safetensors.torch import load_file

from kfrl import stages
from kfrl.config import load_config
from kfrl.driver.controller import train
from kfrl.run import Run
from kfrl.stages import STAGES, context, update
from run_tables import committed_tables

# The demo's model and task, small: it learns from the first iteration (non-zero advantages), so
# weights that were not handed over or restored would show in the next rollout.
SMALL = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=4", "data.max_response_length=16",
         "actor.ppo_micro_batch_size_per_gpu=8", "trainer.log_generations=0", "trainer.val_before_train=false",
         "pipeline.runner=inline", "trainer.test_freq=1", "data.builtin_val_size=8"]


def config(root: Path, *extra):
    return load_config(Path("configs/demo.yaml"), SMALL + [f"store.uri={root / 'store'}",
                                                           f"tracking.uri=sqlite:///{root}/m.db", *extra])


def forget_process_state() -> None:
    """What a new process starts with: no training copy, no loaded models."""
    update.drain()
    update._RESIDENT_TRAINERS.clear()
    context._MODEL_CACHE.clear()
    context._MODEL_SLOTS.clear()


def policy_weights(run: Run, iteration: int) -> dict[str, torch.Tensor]:
    return load_file(run.store.committed_dir(run.manifest("update_actor", iteration)) / "model.safetensors")


def test_weights_every_iteration_trainer_state_kept_for_the_window_and_at_save_freq(tmp_path):
    forget_process_state()
    summary = train(config(tmp_path, "trainer.save_freq=2", "trainer.keep_trainer_states=1"), run_id="k",
                    iterations=5)
    run = Run.at(summary.run_uri)
    assert any(run.manifest("update_actor", i).metrics["actor/grad_norm"] > 0 for i in range(1, 6))  # it learns
    for iteration in range(1, 6):
        weights = run.manifest("update_actor", iteration)
        assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(weights.names())
        assert not {"optimizer.pt", "trainer_state.json"} & set(weights.names())
        assert weights.info["optimizer_steps"] == iteration  # one mini-batch, one epoch per iteration
    # The last iteration's state (the window of 1) and those at save_freq multiples; 1 and 3 deleted.
    assert [i for i in range(1, 6) if run.is_committed("actor_state", i)] == [2, 4, 5]
    assert not list((Path(run.uri) / "iter-000001" / "actor_state").rglob("optimizer.pt"))  # files gone too
    state = run.manifest("actor_state", 5)
    assert state.info["weights_attempt"] == run.manifest("update_actor", 5).attempt
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= set(state.names())
    # The inline runner's process kept the training copy: updates 2..5 never read the store.
    assert [run.manifest("update_actor", i).info["trainer_from"] for i in range(1, 6)] == \
        ["store"] + ["memory"] * 4


def test_handing_weights_off_in_memory_commits_what_loading_them_from_the_store_commits(tmp_path, monkeypatch):
    forget_process_state()
    handed = train(config(tmp_path / "a"), run_id="a", iterations=3)
    # The inference copies this process holds are the newest commit's, with its weights.
    run = Run.at(handed.run_uri)
    newest = run.manifest("update_actor", 3)
    held = [key for key in context._MODEL_CACHE if key[1] == run.store.url(newest.prefix)]
    assert held and all(key[2] == newest.attempt for key in held)
    policy = next((context._MODEL_CACHE[key] for key in held if key[0] == "policy"), None)
    if policy is not None:
        stored = policy_weights(run, 3)
        assert all(torch.equal(stored[name], value) for name, value in policy.state_dict().items() if name in stored)

    original = stages.run_stage

    def stage_in_a_fresh_process(*args):
        result = original(*args)
        forget_process_state()  # every stage loads its inputs and weights from the store
        return result

    monkeypatch.setattr(stages, "run_stage", stage_in_a_fresh_process)
    # A task without an engine writes the trainer state every iteration (this process, an inline
    # runner, would write it every trainer_state_freq-th only).
    loaded = train(config(tmp_path / "b", "trainer.trainer_state_freq=1"), run_id="b", iterations=3)
    loaded_run = Run.at(loaded.run_uri)
    assert loaded_run.manifest("update_actor", 3).info["trainer_from"] == "store"
    expected, found = committed_tables(loaded_run, (1, 2, 3)), committed_tables(run, (1, 2, 3))
    assert sorted(found) == sorted(expected)
    for key, table in expected.items():
        assert found[key].equals(table), key
    a, b = policy_weights(run, 3), policy_weights(loaded_run, 3)
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_an_update_runs_without_the_inference_copies_it_replaces_and_keeps_the_reference(tmp_path, monkeypatch):
    forget_process_state()
    held_during_updates = []
    original = update.TRAIN_STEP["actor"]

    def step(ctx, *args):
        held_during_updates.append(sorted((key[0], "iter-000000" in key[1]) for key in context._MODEL_CACHE))
        return original(ctx, *args)

    monkeypatch.setitem(update.TRAIN_STEP, "actor", step)
    summary = train(config(tmp_path, "actor.use_kl_loss=true"), run_id="r", iterations=2)
    # Each update held the initial policy (the reference of the KL loss) and nothing else: the decoder
    # and policy copies of the weights it replaced were dropped before it began.
    assert held_during_updates == [[("policy", True)], [("policy", True)]]
    run = Run.at(summary.run_uri)
    newest = run.manifest("update_actor", 2)
    after = sorted(key[0] for key in context._MODEL_CACHE if key[1] == run.store.url(newest.prefix))
    assert "decoder" in after or "policy" in after  # rebuilt from the new weights for the next rollout
    assert newest.metrics["timing_s/hand_off"] >= 0


def test_a_trainer_state_lost_to_a_kill_is_rebuilt_exactly_and_nothing_else_is_redone(tmp_path):
    forget_process_state()
    reference = Run.at(train(config(tmp_path / "a"), run_id="a", iterations=3).run_uri)
    forget_process_state()
    run = Run.at(train(config(tmp_path / "b"), run_id="b", iterations=2).run_uri)
    run.store.remove_commit("iter-000002/actor_state")  # the process died while writing it
    before = {stage: run.manifest(stage, 2).attempt for stage in STAGES}
    forget_process_state()
    train(config(tmp_path / "b"), run_id="b", iterations=3)
    assert run.manifest("update_actor", 3).info["trainer_from"] == "rebuilt"
    assert {stage: run.manifest(stage, 2).attempt for stage in STAGES} == before  # iteration 2 stands
    assert run.manifest("actor_state", 2).info["weights_attempt"] == before["update_actor"]
    a, b = policy_weights(reference, 3), policy_weights(run, 3)
    assert all(torch.equal(a[name], b[name]) for name in a)
    expected_state = load_file(reference.store.committed_dir(reference.manifest("actor_state", 3)) / "model.safetensors")
    found_state = load_file(run.store.committed_dir(run.manifest("actor_state", 3)) / "model.safetensors")
    assert all(torch.equal(expected_state[name], found_state[name]) for name in expected_state)


def test_trainer_state_every_k_iterations_and_the_gap_rebuilt_exactly(tmp_path):
    """trainer_state_freq=3: a process that keeps its training copy writes the state after iterations 3
    and 5 (the last) only, with the same results; a fresh process that needs the state after 5, lost,
    redoes updates 4 and 5 from the state after 3."""
    forget_process_state()
    reference = Run.at(train(config(tmp_path / "a"), run_id="a", iterations=5).run_uri)
    forget_process_state()
    run = Run.at(train(config(tmp_path / "b", "trainer.trainer_state_freq=3"), run_id="b", iterations=5).run_uri)
    assert [i for i in range(1, 6) if run.is_committed("actor_state", i)] == [3, 5]
    a, b = policy_weights(reference, 5), policy_weights(run, 5)
    assert all(torch.equal(a[name], b[name]) for name in a)
    run.store.remove_commit("iter-000005/actor_state")  # the process died while writing it
    forget_process_state()
    ctx = context.StageContext.open(run.uri, 6)
    model, _optimizer, steps, source = update.load_trainer_state(ctx, update.ROLES["actor"], ctx.config.actor,
                                                                 run.manifest("update_actor", 5))
    assert source == "rebuilt" and steps == 5
    assert [i for i in range(1, 6) if run.is_committed("actor_state", i)] == [4, 5]  # the newest two kept
    expected = load_file(reference.store.committed_dir(reference.manifest("actor_state", 5)) / "model.safetensors")
    assert all(torch.equal(expected[name], value) for name, value in model.state_dict().items() if name in expected)


def test_weights_saved_in_another_dtype_keep_tied_tensors_once_and_load_back_cast(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from kfrl.models.hf_io import load_causal_lm, save_hf

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True))
    save_hf(model, None, tmp_path / "bf16", dtype=torch.bfloat16)
    stored = load_file(tmp_path / "bf16" / "model.safetensors")
    assert "lm_head.weight" not in stored  # the embedding is the LM head: written once
    assert all(t.dtype == torch.bfloat16 for t in stored.values())
    assert next(model.parameters()).dtype == torch.float32  # the training copy is left as it was
    loaded = load_causal_lm(tmp_path / "bf16", dtype=torch.bfloat16)
    assert loaded.config.dtype == torch.bfloat16
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value.to(torch.bfloat16)), name
