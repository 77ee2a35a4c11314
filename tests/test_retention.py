"""Store retention of policy weights (trainer.keep_policy_weights, kfrl gc): what goes, what always stays
(the initial model, save_freq multiples, weights beside a kept trainer state, registered versions), a
run that resumes after retention, and a gc killed half-way that loses nothing."""
from __future__ import annotations


from mlflow import MlflowClient
from typer.testing import CliRunner

from kfrl.cli import app
from kfrl.config import load_config
from kfrl.driver.controller import train
from kfrl.retention import collect_garbage, policies_to_delete
from kfrl.run import ACTOR_STATE, POLICY_STAGE, Run, stage_prefix
from kfrl.store import Store

runner = CliRunner()
TINY = ["model.path=builtin:tiny-qwen2-arith", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
        "rollout.n=2", "data.max_response_length=4", "trainer.log_generations=0", "pipeline.runner=inline",
        "data.builtin_train_size=16", "trainer.test_freq=0", "trainer.val_before_train=false"]


def test_the_rule_keeps_the_window_the_initial_model_save_multiples_and_the_protected():
    assert policies_to_delete(list(range(0, 11)), latest=10, keep=2, save_freq=4, protected={5}) == [1, 2, 3, 6, 7]
    assert policies_to_delete(list(range(0, 11)), latest=10, keep=0, save_freq=4, protected=set()) == []
    # Nothing beyond LATEST (an iteration at work) is ever a candidate.
    assert policies_to_delete([1, 2, 3, 4], latest=2, keep=1, save_freq=0, protected=set()) == [1]


def committed_policies(run: Run, upto: int) -> list[int]:
    return [i for i in range(0, upto + 1) if run.is_committed(POLICY_STAGE, i)]


def test_the_run_deletes_old_policies_as_it_goes_and_resumes_after(tmp_path):
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = TINY + [f"store.uri={tmp_path / 'store'}", f"tracking.uri={tracking}", "trainer.save_freq=4",
                        "trainer.keep_policy_weights=2", "trainer.trainer_state_freq=3", "trainer.keep_trainer_states=1"]
    summary = train(load_config(None, overrides + ["trainer.total_iterations=9"]), run_id="ret", iterations=7)
    run = Run.at(summary.run_uri)
    states = [i for i in range(0, 8) if run.is_committed(ACTOR_STATE, i)]
    assert states == [4, 7]  # the save_freq multiple's and the newest (a run's last iteration writes one)
    registered = {int(v.tags["iteration"]) for v in MlflowClient(tracking_uri=tracking).search_model_versions(
        "tag.`kfrl.run_id`='ret'")}
    assert registered == {4, 7}  # save_freq's, and this session's last
    # Kept: the initial model, 4 (save_freq, registered, beside a kept state), 6-7 (the window).
    assert committed_policies(run, 7) == [0, 4, 6, 7]
    assert Store(summary.run_uri).list(stage_prefix(2, POLICY_STAGE)) == []  # files gone, not only the manifest
    # The run goes on from LATEST: the policy it reads is there.
    resumed = train(load_config(None, overrides + ["trainer.total_iterations=9"]), run_id="ret")
    assert resumed.resumed_from == 7 and sorted(resumed.iterations) == [8, 9]
    assert committed_policies(run, 9) == [0, 4, 7, 8, 9]  # 7 stays: registered (and 6 went, as 2-5 did)


def test_gc_on_a_finished_run_dry_run_first_and_a_killed_gc_loses_nothing(tmp_path):
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    store = tmp_path / "store"
    summary = train(load_config(None, TINY + [f"store.uri={store}", f"tracking.uri={tracking}", "trainer.save_freq=0"]),
                    run_id="old", iterations=5)
    run = Run.at(summary.run_uri)
    assert committed_policies(run, 5) == [0, 1, 2, 3, 4, 5]  # keep_policy_weights 0: all kept
    MlflowClient(tracking_uri=tracking).set_registered_model_alias(summary.registered_model, "champion",
                                                                    summary.registered_versions[5])
    base = ["gc", "--run", "old", "--store", str(store), "--tracking-uri", tracking, "--keep", "1"]
    assert runner.invoke(app, base[:-2]).exit_code == 1  # the run keeps all: --keep is needed
    dry = runner.invoke(app, base + ["--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "would delete the policy weights of 4 iteration(s)" in dry.output and "1, 2, 3, 4" in dry.output
    assert committed_policies(run, 5) == [0, 1, 2, 3, 4, 5]

    # A gc killed after it withdrew iteration 2's manifest, before its files: the files are orphans,
    # nothing a reader could find is damaged.
    orphan_files = Store(summary.run_uri).list(stage_prefix(2, POLICY_STAGE))
    run.store.uncommit(stage_prefix(2, POLICY_STAGE))
    result = runner.invoke(app, base)
    assert result.exit_code == 0, result.output
    assert "deleted the policy weights of 3 iteration(s)" in result.output  # 1, 3, 4 (2 was withdrawn)
    assert f"deleted {len(orphan_files) - 1} file(s) no commit names" in result.output  # all but the manifest
    assert committed_policies(run, 5) == [0, 5]  # the initial model, and the registered, aliased newest
    assert Store(summary.run_uri).list(stage_prefix(2, POLICY_STAGE)) == []
    for iteration in (0, 5):  # what stays is intact: every digest checked on the way out
        Store(summary.run_uri).committed_dir(run.manifest(POLICY_STAGE, iteration))
    again = collect_garbage(run, 1, 0, {5})
    assert again.deleted == [] and again.orphans == []


def test_gc_names_a_missing_run(tmp_path):
    result = runner.invoke(app, ["gc", "--run", "nope", "--store", str(tmp_path), "--keep", "1"])
    assert result.exit_code == 1 and "nope" in result.output
