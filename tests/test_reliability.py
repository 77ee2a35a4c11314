"""Faults and bad inputs end cleanly: one `error:` line and exit 2 for what is refused, nothing
half-written that blocks the next start, no secret stored, caches that do not grow with the run."""
import math
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from kfrl.cli import app
from kfrl.config import ConfigError, load_config
from kfrl.driver.controller import TrainingRefused, train
from kfrl.run import Run
from kfrl.store import CorruptManifestError, Store

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]
# One quick iteration of the builtin task (inline runner: no KFP subprocesses).
TINY = ["model.path=builtin:tiny-qwen2-arith", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
        "rollout.n=2", "data.max_response_length=4", "trainer.val_before_train=false", "trainer.log_generations=0",
        "pipeline.runner=inline", "data.builtin_train_size=16"]


def tiny_config(tmp_path, *extra):
    return load_config(None, TINY + [f"store.uri={tmp_path / 'store'}", f"tracking.uri=sqlite:///{tmp_path}/m.db",
                                     *extra])


def refused(result) -> str:
    """The CLI refused with exit 2 and a single `error:` line (no traceback)."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.output
    return lines[0]


# --- 1. MLflow's SQLite database survives a kill while it is created --------------------------------

def test_kill_during_mlflow_database_creation_leaves_no_half_database(tmp_path):
    db = tmp_path / "mlflow.db"
    code = "from kfrl.tracking import resolve_tracking_uri; import sys; resolve_tracking_uri(sys.argv[1])"
    killed = subprocess.run([sys.executable, "-c", code, f"sqlite:///{db}"], env={**os.environ, "KFRL_KILL_AT": "mlflow_init"},
                            capture_output=True, timeout=120)
    assert killed.returncode == -9
    assert not db.exists()  # the schema was built under a temporary name, never moved into place
    from kfrl.tracking import Tracker

    tracker = Tracker(f"sqlite:///{db}", "exp", "run-1")
    assert tracker.last_logged_iteration() == -1
    assert [p.name for p in tmp_path.iterdir()] == ["mlflow.db"]  # the killed process's temporary is gone


def test_half_created_database_from_an_older_kill_is_moved_aside_and_rebuilt(tmp_path):
    import sqlalchemy
    from mlflow.store.db.utils import InitialBase

    from kfrl.tracking import Tracker

    db = tmp_path / "mlflow.db"
    engine = sqlalchemy.create_engine(f"sqlite:///{db}")
    InitialBase.metadata.create_all(engine)  # what MLflow has done when a kill lands before its migrations
    engine.dispose()
    tracker = Tracker(f"sqlite:///{db}", "exp", "run-1")
    tracker.log_iteration(1, {"x": 1.0})
    assert tracker.last_logged_iteration() == 1
    assert len(list(tmp_path.glob("mlflow.db.broken-*"))) == 1


# --- 2. a failed preparation can be repaired --------------------------------------------------------

def _corrupt_model(tmp_path) -> Path:
    from kfrl.models.tiny import materialize_builtin

    model = tmp_path / "model"
    source = materialize_builtin("builtin:tiny-qwen2-arith")
    model.mkdir()
    for path in source.iterdir():
        if path.is_file():
            (model / path.name).write_bytes(path.read_bytes())
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return model


def test_corrupt_initial_weights_are_refused_then_the_fixed_config_wins(tmp_path):
    model = _corrupt_model(tmp_path)
    with pytest.raises(TrainingRefused, match=r"model\.safetensors \(model\.path\) is not a readable safetensors"):
        train(tiny_config(tmp_path, f"model.path={model}"), run_id="r", iterations=1)
    run = Run.at(str(tmp_path / "store" / "demo" / "r"))
    assert not run.has_config() and run.manifest("update_actor", 0) is None  # nothing of it committed
    summary = train(tiny_config(tmp_path), run_id="r", iterations=1)  # same id, the fixed model.path
    assert sorted(summary.iterations) == [1]
    assert run.config().model.path == "builtin:tiny-qwen2-arith"


def test_reprepare_redoes_a_run_that_recorded_nothing_and_refuses_one_that_did(tmp_path):
    from kfrl.stages.prepare import prepare_run

    run = Run.at(str(tmp_path / "store" / "demo" / "r"))
    prepare_run(run.store, tiny_config(tmp_path, "data.seed=5"))  # prepared, then failed before iteration 1
    first = run.manifest("update_actor", 0).attempt
    summary = train(tiny_config(tmp_path), run_id="r", iterations=1, reprepare=True)
    assert sorted(summary.iterations) == [1]
    assert run.config().data.seed == 1 and run.manifest("update_actor", 0).attempt != first
    with pytest.raises(TrainingRefused, match="recorded iterations up to 1; --reprepare only repairs"):
        train(tiny_config(tmp_path), run_id="r", iterations=2, reprepare=True)


# --- 3./4. bad inputs: one error line, exit 2 --------------------------------------------------------

@pytest.mark.parametrize("args, expected", [
    (["-n", "0"], "--iterations must be at least 1 (got 0)"),
    (["-n", "-1"], "--iterations must be at least 1 (got -1)"),
    (["rollout.temperature=inf"], "rollout.temperature: Input should be a finite number"),
    (["actor.lr=nan"], "actor.lr: Input should be a finite number"),
])
def test_bad_arguments_are_refused_with_one_line(tmp_path, args, expected):
    result = runner.invoke(app, ["train", "--store", str(tmp_path / "s"), *args])
    assert expected in refused(result) or expected in result.output
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("text, expected", [
    ("actor:\n  lr: 1e-5\n  lr: 2e-5\n", "line 3 column 3: key 'lr' appears twice in one mapping (first on line 2)"),
    ("actor:\n  lr: [1,\n", "line 3 column 1: expected the node content"),
])
def test_bad_yaml_files_are_refused_with_the_line(tmp_path, text, expected):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    result = runner.invoke(app, ["train", "--config", str(path), "--dry-run"])
    assert f"{path}, {expected}" in refused(result)


def _arith_without(tmp_path, column: str) -> Path:
    from kfrl.data.synthetic import make_arith_rows

    table = pa.Table.from_pylist(make_arith_rows(16, 1, "train"))
    path = tmp_path / f"no-{column}.parquet"
    pq.write_table(table.drop_columns([column]), path)
    return path


@pytest.mark.parametrize("column, key", [("reward_model", "reward_model.ground_truth"),
                                         ("prompt", "data.prompt_key")])
def test_data_without_a_needed_column_is_refused_naming_the_users_file(tmp_path, column, key):
    data = _arith_without(tmp_path, column)
    args = ["train", "--store", str(tmp_path / "s"), "--tracking-uri", f"sqlite:///{tmp_path}/m.db", "--runner",
            "inline", *TINY, f"data.train_files={data}"]
    line = refused(runner.invoke(app, args))
    assert str(data) in line and f"'{column}' ({key}" in line and "(data.train_files)" in line
    # The dry run finds the same from the Parquet footer.
    dry = runner.invoke(app, ["train", "--dry-run", *TINY, f"data.train_files={data}"])
    assert f"data.train_files: {data} lacks column '{column}'" in dry.output


def test_unreadable_user_data_file_says_to_write_it_again(tmp_path):
    data = tmp_path / "broken.parquet"
    data.write_bytes(b"PAR1 not really")
    line = refused(runner.invoke(app, ["train", "--store", str(tmp_path / "s"), "--tracking-uri",
                                       f"sqlite:///{tmp_path}/m.db", *TINY, f"data.train_files={data}"]))
    assert str(data) in line and "write it again (you (data.train_files))" in line
    assert "re-run the stage" not in line


def test_dry_run_checks_the_reward_file(tmp_path):
    result = runner.invoke(app, ["train", "--dry-run", "reward.custom_function_path=/nowhere/reward.py"])
    assert "reward.custom_function_path: FileNotFoundError: custom reward file '/nowhere/reward.py' not found" \
        in result.output
    reward = tmp_path / "reward.py"
    reward.write_text("def other(**kw):\n    return 1.0\n")
    result = runner.invoke(app, ["train", "--dry-run", f"reward.custom_function_path={reward}"])
    assert "reward function 'compute_score' not found" in result.output


@pytest.mark.parametrize("returned, expected", [
    ("float('nan')", "returned a non-finite reward for sample 's1' (data_source 'kfrl/arith'): score=nan"),
    ("{'score': float('inf')}", "returned a non-finite reward for sample 's1'"),
    ("'high'", "failed on sample 's1' (data_source 'kfrl/arith'): ValueError"),
    ("{'acc': 1.0}", "failed on sample 's1' (data_source 'kfrl/arith'): ValueError: a reward function returned a "
                     "dict without a 'score' key"),
])
def test_a_bad_reward_stops_scoring_naming_the_function_and_sample(tmp_path, returned, expected):
    from kfrl.rewards.manager import RewardError, rule_reward_fn, score_responses

    reward = tmp_path / "reward.py"
    reward.write_text(f"def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      f"    return 1.0 if solution_str == 'ok' else {returned}\n")
    fn = rule_reward_fn(str(reward), "compute_score")
    with pytest.raises(RewardError) as info:
        score_responses(["ok", "bad"], ["kfrl/arith"] * 2, ["1", "1"], [None, None], [1, 1], max_response_length=4,
                        reward_fn=fn, sample_ids=["s0", "s1"])
    assert f"compute_score in {reward} (reward.custom_function_path)" in str(info.value)
    assert expected in str(info.value)


def test_registry_scorer_is_named_when_it_fails():
    from kfrl.rewards import register
    from kfrl.rewards.manager import RewardError, score_responses

    def exploding(solution_str, ground_truth):
        raise ZeroDivisionError("boom")

    register("test/exploding", exploding, overwrite=True)
    with pytest.raises(RewardError, match=r"test_reliability\..*exploding failed on response 0 "
                                          r"\(data_source 'test/exploding'\): ZeroDivisionError: boom"):
        score_responses(["x"], ["test/exploding"], ["1"], [None], [1], max_response_length=4)


def test_non_finite_log_probs_stop_the_stage_naming_column_and_sample():
    from kfrl.batch import BatchError, make_table

    columns = {"sample_id": ["a", "b"], "old_logprobs": [[-0.1, -0.2], [-0.3, math.nan]], "entropy": [[1.0], [1.0]]}
    with pytest.raises(BatchError) as info:
        make_table("old_logprob", {**columns, "entropy": [[1.0, 1.0], [1.0, 1.0]]})
    assert "column 'old_logprobs' holds nan for sample 'b' (1 of 2 samples" in str(info.value)
    assert info.value.column == "old_logprobs"
    with pytest.raises(BatchError, match="column 'score' holds inf for sample 'a'"):
        make_table("score", {"sample_id": ["a"], "score": [math.inf], "acc": [1.0], "reward_extra": ["{}"]})


@pytest.mark.parametrize("mini_batch_size, poisoned_row, named, where", [
    (2, 1, "'s0', 's1'", "mini-batch 1"),
    # The check runs once per mini-batch, after its passes: it still names the micro-batch that failed.
    (4, 3, "'s2', 's3'", "mini-batch 1"),
    (2, 2, "'s2', 's3'", "mini-batch 2"),
])
def test_a_non_finite_loss_stops_the_update_naming_the_samples(mini_batch_size, poisoned_row, named, where):
    import torch

    from kfrl.engines.minibatch import NonFiniteLossError, optimize

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    inputs = torch.tensor([[1.0, 2.0], [0.5, 1.0], [0.0, 1.0], [1.0, 1.0]])
    inputs[poisoned_row, 0] = math.nan

    def micro_step(rows):
        return model(inputs[rows]).mean()

    with pytest.raises(NonFiniteLossError, match=rf"actor loss is nan on the micro-batch of samples \[{named}\] "
                                                 rf"\(epoch 1, {where}\)"):
        optimize(model, optimizer, 4, micro_step, mini_batch_size=mini_batch_size, micro_batch_size=2, epochs=1,
                 shuffle=False, seed=0, grad_clip=1.0, prefix="actor", sample_ids=["s0", "s1", "s2", "s3"])
    if where == "mini-batch 1":  # no step was taken before the failing mini-batch
        assert torch.equal(model.weight, before)
    else:  # the first mini-batch's step was, and the failing one's was not
        assert not torch.equal(model.weight, before) and torch.isfinite(model.weight).all()


# --- 5./6. resumption that cannot go on as asked -----------------------------------------------------

def test_iterations_below_latest_are_refused_before_anything_changes(tmp_path):
    run = Run.at(str(tmp_path / "store" / "demo" / "r"))
    run.set_latest(3)
    line = refused(runner.invoke(app, ["train", "--store", str(tmp_path / "store"), "--run-id", "r", "-n", "2",
                                       "--tracking-uri", f"sqlite:///{tmp_path}/m.db"]))
    assert "run r has already recorded 3 iterations (LATEST); --iterations 2" in line
    assert run.latest() == 3 and not run.has_config()


def test_corrupt_manifest_advice_depends_on_whether_the_iteration_is_recorded(tmp_path):
    run = Run.at(str(tmp_path / "run"))
    for iteration in (1, 3):
        run.store.write_text(f"iter-{iteration:06d}/rollout/_COMMITTED", "{not json")
    run.set_latest(2)
    with pytest.raises(CorruptManifestError, match="Iteration 1 is already recorded .LATEST=2., so resuming will "
                                                   "not run the stage again: restore the manifest"):
        run.manifest("rollout", 1)
    with pytest.raises(CorruptManifestError, match="Delete it and resume .kfrl train --run-id.: the stage runs again"):
        run.manifest("rollout", 3)


# --- 7./8. tracking server: fail fast, no credentials stored or printed ------------------------------

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_tracking_server_fails_in_seconds_before_the_store_is_written(tmp_path):
    uri = f"http://alice:hunter22@127.0.0.1:{_free_port()}"
    started = time.monotonic()
    result = runner.invoke(app, ["train", "--store", str(tmp_path / "s"), "--tracking-uri", uri, *TINY])
    line = refused(result)
    assert time.monotonic() - started < 10
    assert f"MLflow tracking server http://127.0.0.1:{uri.rsplit(':', 1)[1]} is unreachable" in line
    assert "hunter22" not in result.output and "alice" not in result.output
    assert not (tmp_path / "s").exists()


def test_tracking_credentials_never_reach_the_store_or_mlflow_params(tmp_path, mlflow_server, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    with_credentials = mlflow_server.replace("http://", "http://alice:hunter22@")
    config = tiny_config(tmp_path, f"tracking.uri={with_credentials}", "trainer.experiment_name=creds")
    summary = train(config, run_id="c", iterations=1)
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "hunter22"  # MLflow's own variable carries them
    stored = (tmp_path / "store" / "creds" / "c" / "config.yaml").read_text()
    assert "hunter22" not in stored and "alice" not in stored
    params = MlflowClient(tracking_uri=mlflow_server).get_run(summary.mlflow_run_id).data.params
    assert params["tracking.uri"] == mlflow_server
    assert not any("hunter22" in value for value in params.values())


# --- 9. caches hold the current checkpoints only -----------------------------------------------------

def test_local_store_checkpoints_are_read_in_place_and_models_do_not_pile_up(tmp_path, monkeypatch):
    from run_tables import forget_process_state

    from kfrl.models import hf_io
    from kfrl.stages import context
    from kfrl.stages.context import StageContext

    forget_process_state()  # what earlier tests in this process loaded does not count
    loaded_from = []
    read_folder = hf_io.load_tokenizer
    monkeypatch.setattr(hf_io, "load_tokenizer", lambda path: loaded_from.append(path) or read_folder(path))
    summary = train(tiny_config(tmp_path, "trainer.test_freq=1", "data.val_files=builtin:arith",
                                "data.builtin_val_size=4"), run_id="c", iterations=3)
    ctx = StageContext.open(summary.run_uri, 3)
    manifest = ctx.policy_manifest(3)
    folder = ctx.checkpoint_dir(manifest)
    assert folder == Path(summary.run_uri) / manifest.prefix / manifest.attempt  # no copy of the checkpoint
    policies = [key for key in context._MODEL_CACHE if key[0] in ("policy", "decoder") and summary.run_uri in key[1]]
    # The initial policy (the reference) and the newest one: never the policies of iterations 1 and 2.
    assert len(policies) <= 2, policies
    assert not any(f"iter-00000{i}" in key[1] for key in policies for i in (1, 2))
    assert len(context._TOKENIZER_CACHE) <= 2  # one tokenizer for every checkpoint of the run
    # Read from disk once, from the initial commit: the later commits carry the tokenizer this process
    # saved, and the object it saved is used for them.
    assert len(loaded_from) == 1 and "iter-000000" in str(loaded_from[0]), loaded_from
    assert len({id(tokenizer) for tokenizer in context._TOKENIZER_CACHE.values()}) == 1
    newest = ctx.load_tokenizer(manifest)
    assert newest.decode(newest("12+3=15").input_ids) == "12+3=15"


def test_s3_checkpoint_cache_skips_trainer_state_and_keeps_initial_and_newest(tmp_path, s3_bucket, monkeypatch):
    from kfrl.config import Config
    from kfrl.stages.context import StageContext

    monkeypatch.setenv("KFRL_CACHE_DIR", str(tmp_path / "cache"))
    run = Run.at(f"s3://{s3_bucket}/runs/demo/s")
    for iteration in range(4):  # checkpoints as update_actor commits them
        attempt = run.store.open_attempt(f"iter-{iteration:06d}/update_actor")
        for name in ("config.json", "model.safetensors", "optimizer.pt", "trainer_state.json"):
            attempt.write_text(name, f"{name} after {iteration}")
        attempt.commit()
    ctx = StageContext(run.uri, 3, run, Config())
    for iteration in range(4):
        local = ctx.checkpoint_dir(ctx.policy_manifest(iteration))
        assert (local / "model.safetensors").read_text() == f"model.safetensors after {iteration}"
    entries = sorted((tmp_path / "cache" / "checkpoints").iterdir())
    assert [e.name.split("-")[1] for e in entries] == ["000000", "000003"]  # 1 and 2 were removed
    assert not (entries[1] / "optimizer.pt").exists()  # inference reads weights only
    full = ctx.checkpoint_dir(ctx.policy_manifest(3), training_state=True)
    assert full == entries[1] and (full / "optimizer.pt").read_text() == "optimizer.pt after 3"


# --- 10. the store and MLflow must agree -------------------------------------------------------------

def test_a_wiped_store_is_reported_not_silently_recomputed(tmp_path):
    import shutil

    train(tiny_config(tmp_path), run_id="w", iterations=2)
    shutil.rmtree(tmp_path / "store")
    with pytest.raises(TrainingRefused, match=r"has recorded iterations up to 2, but the store at .* has no LATEST"):
        train(tiny_config(tmp_path), run_id="w", iterations=2)
    assert not Run.at(str(tmp_path / "store" / "demo" / "w")).latest()


@pytest.mark.parametrize("uncommitted", [["update_actor"], ["update_actor", "validate", "advantage", "score"]],
                         ids=["weights", "weights_and_queued_stages"])
def test_a_kill_while_an_update_commits_in_the_background_resumes_with_nothing_logged_twice(tmp_path, uncommitted):
    """The controller logs an iteration while its update's weights (and the commits queued behind them)
    are still being written in the background, and moves LATEST once they are durable. The store a kill
    leaves in between (MLflow at 2, LATEST at 1, iteration 2's update not committed) resumes: the update
    runs again and no metric of iteration 2 is logged twice."""
    import shutil

    from mlflow.tracking import MlflowClient

    def history():
        client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/m.db")
        (run,) = client.search_runs([client.get_experiment_by_name("kfrl").experiment_id],
                                    "tags.`kfrl.run_id` = 'k'")
        return {key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
                for key in run.data.metrics if not key.startswith(("timing_s/", "perf/"))}

    train(tiny_config(tmp_path), run_id="k", iterations=2)
    before = history()
    run = Run.at(str(tmp_path / "store" / "demo" / "k"))
    for stage in uncommitted:
        if run.is_committed(stage, 2):
            shutil.rmtree(Path(run.url(stage, 2)))
    run.set_latest(1)
    assert not run.is_committed("update_actor", 2)
    train(tiny_config(tmp_path), run_id="k", iterations=2)
    assert run.latest() == 2 and run.is_committed("update_actor", 2)
    assert history() == before  # the redone update's metrics equal the logged ones, logged once


def test_a_store_far_behind_mlflow_is_refused(tmp_path):
    import shutil

    train(tiny_config(tmp_path), run_id="b", iterations=3)
    run = Run.at(str(tmp_path / "store" / "demo" / "b"))
    for iteration in (2, 3):
        shutil.rmtree(Path(run.url("rollout", iteration)).parent)
    run.set_latest(1)
    with pytest.raises(TrainingRefused, match=r"recorded iterations up to 3, but the store at .* has LATEST=1 and "
                                              r"lacks iteration 2's commits"):
        train(tiny_config(tmp_path), run_id="b", iterations=3)


# --- 11. S3 retry budget and read timeout ------------------------------------------------------------

@pytest.fixture()
def fault_proxy(s3_server):
    from s3_fault_proxy import S3FaultProxy

    proxy = S3FaultProxy(upstream=s3_server)
    proxy.start()
    yield proxy
    proxy.stop()


def test_stalled_s3_reads_time_out_and_are_retried_with_warnings(s3_bucket, fault_proxy, monkeypatch, caplog):
    Store(f"s3://{s3_bucket}/t").write_text("a.txt", "hello")
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.url)
    store = Store(f"s3://{s3_bucket}/t", retries=8, backoff_s=0.1, read_timeout_s=1.0)
    fault_proxy.set_faults(stall_s=5.0, stall_rate=1.0, methods=["GET"], key_contains="a.txt")
    started = time.monotonic()
    with pytest.raises(Exception, match="gave up after 2 attempts"):
        Store(f"s3://{s3_bucket}/t", retries=1, backoff_s=0.1, read_timeout_s=1.0).read_text("a.txt")
    assert time.monotonic() - started < 8  # 2 attempts x 1 s, not 2 x 60 s
    fault_proxy.set_faults(outage_s=3.0)
    with caplog.at_level("WARNING", logger="kfrl.store"):
        assert store.read_text("a.txt") == "hello"  # a 3 s outage is ridden out
    assert any("s so far; retrying in" in r.getMessage() for r in caplog.records)


# --- 12. a corrupt checkpoint file is named ----------------------------------------------------------

def test_corrupt_safetensors_is_named_when_loading(tmp_path):
    from kfrl.models.hf_io import CorruptWeightsError, load_causal_lm

    model = _corrupt_model(tmp_path)
    with pytest.raises(CorruptWeightsError, match=rf"{model / 'model.safetensors'} is not a readable safetensors"):
        load_causal_lm(model)


def test_config_duplicate_key_in_stored_config_names_the_store_file(tmp_path):
    run = Run.at(str(tmp_path / "run"))
    run.write_config("actor:\n  lr: 1\n  lr: 2\n")
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'run' / 'config.yaml'}, line 3"):
        run.config()


def test_sqlite_schema_is_current_after_creation(tmp_path):
    from mlflow.store.db.utils import _get_latest_schema_revision

    from kfrl.tracking import resolve_tracking_uri

    resolve_tracking_uri(f"sqlite:///{tmp_path}/x.db")
    with sqlite3.connect(tmp_path / "x.db") as con:
        assert con.execute("select version_num from alembic_version").fetchone()[0] == _get_latest_schema_revision()
