"""The run layout (kfrl.run): prefixes, LATEST, which checkpoint holds the weights after iteration N,
an iteration's committed metrics. Local folder and S3 (moto's server)."""
import pytest

from kfrl.run import INIT_ITERATION, POLICY_STAGE, Run, RunLayoutError, stage_prefix
from kfrl.store import Store, StoreError


@pytest.fixture(params=["local", "s3"])
def run(request, tmp_path):
    if request.param == "local":
        return Run(Store(str(tmp_path / "exp" / "run1")))
    bucket = request.getfixturevalue("s3_bucket")
    return Run(Store(f"s3://{bucket}/exp/run1"))


def commit(run: Run, stage: str, iteration: int, *, skipped: str = "", metrics=None):
    attempt = run.store.open_attempt(stage_prefix(iteration, stage))
    if not skipped:
        attempt.write_bytes("model.safetensors", f"{stage}-{iteration}".encode())
    return attempt.commit(metrics=metrics or {}, info={"skipped": skipped} if skipped else {})


def test_stage_prefix():
    assert stage_prefix(12, "rollout") == "iter-000012/rollout"
    assert stage_prefix(0, "update_actor") == "iter-000000/update_actor"
    with pytest.raises(ValueError):
        stage_prefix(-1, "rollout")


def test_latest(run):
    assert run.latest() is None
    run.set_latest(3)
    run.set_latest(4)
    assert run.latest() == 4
    run.store.write_text("LATEST", "garbage")
    with pytest.raises(StoreError, match="LATEST"):
        run.latest()


def test_checkpoint_walks_back_over_skipped_updates(run):
    commit(run, POLICY_STAGE, INIT_ITERATION)
    commit(run, POLICY_STAGE, 1, skipped="critic warm-up")
    commit(run, POLICY_STAGE, 2, skipped="critic warm-up")
    commit(run, POLICY_STAGE, 3)
    assert run.checkpoint(POLICY_STAGE, 2)[1] == 0
    assert run.checkpoint(POLICY_STAGE, 3)[1] == 3
    manifest, _ = run.checkpoint(POLICY_STAGE, 1)
    assert manifest.prefix == stage_prefix(0, POLICY_STAGE)
    with pytest.raises(RunLayoutError, match=r"update_actor of iteration 4 is not committed .*iter-000004"):
        run.checkpoint(POLICY_STAGE, 4)


def test_checkpoint_of_a_run_whose_updates_were_all_skipped(run):
    commit(run, "update_critic", 0, skipped="no critic")
    with pytest.raises(RunLayoutError, match="every update_critic .* up to iteration 0 was skipped"):
        run.checkpoint("update_critic", 0)


def test_iteration_metrics_later_stages_win_and_committed_iterations(run):
    commit(run, "rollout", 1, metrics={"a": 1.0, "shared": 1.0})
    commit(run, "old_logprob", 1, metrics={"shared": 2.0})
    assert run.iteration_metrics(1, ("rollout", "score", "old_logprob")) == {"a": 1.0, "shared": 2.0}
    commit(run, POLICY_STAGE, 0)
    commit(run, POLICY_STAGE, 5)
    assert run.committed_iterations(POLICY_STAGE) == [0, 5]


def test_config_missing_names_the_uri(run):
    assert not run.has_config()
    with pytest.raises(RunLayoutError, match=r"no config.yaml at .*exp/run1/config.yaml"):
        run.config_text()


def test_stage_seeds_are_stable_and_distinct():
    from kfrl.stages.context import stage_seed

    seeds = {stage_seed(1, stage, it, k) for stage in ("rollout", "update_actor") for it in (1, 2) for k in (0, 1)}
    assert len(seeds) == 8 and all(0 <= s < 2**31 for s in seeds)
    assert stage_seed(1, "rollout", 3) == stage_seed(1, "rollout", 3) != stage_seed(2, "rollout", 3)
