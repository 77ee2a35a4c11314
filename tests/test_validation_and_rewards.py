"""Validation as a stage (val-core metrics at the iteration step, before training too), prompt
truncation and overlong filtering, raw chat messages for reward functions, custom reward
functions, a reward-model score stage, and epoch accounting."""
import io
import json

import pytest
import torch
from mlflow.tracking import MlflowClient
from rich.console import Console

from kfrl.config import load_config
from kfrl.driver.controller import train
from kfrl.data.dataset import DatasetError, tokenize_prompt, tokenize_prompts
from kfrl.run import Run, stage_prefix
from kfrl.stages import run_stage
from kfrl.stages.context import StageContext
from kfrl.stages.prepare import prepare_run
from kfrl.store import Store

SMALL = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "rollout.n=2", "data.max_response_length=16",
         "actor.ppo_micro_batch_size_per_gpu=8", "trainer.log_generations=0", "pipeline.runner=inline"]


@pytest.fixture(scope="module")
def tiny_dir():
    from kfrl.models.tiny import materialize_builtin

    return materialize_builtin("builtin:tiny-qwen2-arith")


def test_validation_metrics_logged_at_iteration_steps_and_before_training(tmp_path):
    cfg = load_config(None, SMALL + [
        f"store.uri={tmp_path / 'store'}", f"tracking.uri=sqlite:///{tmp_path}/m.db", "data.val_files=builtin:arith",
        "data.builtin_val_size=12", "trainer.test_freq=1", "trainer.total_iterations=2"])
    summary = train(cfg, run_id="val", console=Console(file=io.StringIO()))
    key = "val-core/kfrl/arith/reward/mean@1"
    for it in (1, 2):
        assert 0.0 <= summary.iterations[it][key] <= 1.0
        assert "val-core/kfrl/arith/acc/mean@1" in summary.iterations[it]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/m.db")
    run = client.search_runs([client.get_experiment_by_name("kfrl").experiment_id], "tags.`kfrl.run_id` = 'val'")[0]
    # MLflow refuses "@": the name is written as veRL's MLflow logger writes it.
    mlflow_key = key.replace("@", "_at_")
    assert [m.step for m in client.get_metric_history(run.info.run_id, mlflow_key)] == [0, 1, 2]
    # Greedy validation of the initial policy, stored per sample.
    store = Store(summary.run_uri)
    ctx = StageContext.open(summary.run_uri, 0)
    table = ctx.read_groups("validate")
    assert table.num_rows == 12 and set(table.column("data_source").to_pylist()) == {"kfrl/arith"}
    assert store.manifest(stage_prefix(0, "validate")).metrics[key] == pytest.approx(
        sum(table.column("score").to_pylist()) / 12)


def test_validation_schedule_follows_test_freq_and_the_last_iteration():
    from kfrl.stages import skip_reason

    cfg = load_config(None, ["data.val_files=builtin:arith", "trainer.test_freq=3", "trainer.total_iterations=7",
                             "trainer.val_before_train=false"])
    due = [it for it in range(8) if not skip_reason("validate", cfg, it)]
    assert due == [3, 6, 7]
    assert "data.val_files" in skip_reason("validate", load_config(None, ["trainer.test_freq=1"]), 1)


def test_total_epochs_sets_iterations_from_the_data(tmp_path):
    from kfrl.driver.controller import resolve_total

    cfg = load_config(None, ["data.train_batch_size=100", "actor.ppo_mini_batch_size=50", "data.builtin_train_size=1050",
                             "trainer.total_epochs=3"])
    store = Store(str(tmp_path / "run"))
    prepare_run(store, cfg)
    resolved = resolve_total(Run(store), cfg)
    assert resolved.trainer.total_iterations == 30  # 1050 // 100 = 10 per epoch, drop_last
    assert "total_iterations: 30" in store.read_text("config.yaml")


def test_prompt_truncation_modes(tiny_dir):
    from kfrl.models.hf_io import load_tokenizer

    tokenizer = load_tokenizer(tiny_dir)
    messages = [{"role": "user", "content": "What is 12 + 34? " * 6}]
    full = tokenize_prompt(tokenizer, messages, 10_000, "row 0")
    assert tokenize_prompt(tokenizer, messages, 20, "row 0", "left") == full[-20:]
    assert tokenize_prompt(tokenizer, messages, 20, "row 0", "right") == full[:20]
    with pytest.raises(DatasetError, match="row 0: prompt is .* tokens, over data.max_prompt_length=20"):
        tokenize_prompt(tokenizer, messages, 20, "row 0")


def test_prompts_tokenized_in_one_batch_equal_one_at_a_time(tiny_dir):
    from kfrl.data.synthetic import make_arith_rows
    from kfrl.models.hf_io import load_tokenizer

    tokenizer = load_tokenizer(tiny_dir)
    conversations = [row["prompt"] for row in make_arith_rows(16, 0, "train")]
    conversations += [[{"role": "system", "content": "Add."}, {"role": "user", "content": "What is 1 + 2? " * k}]
                      for k in (1, 5)]
    where = [f"row {i}" for i in range(len(conversations))]
    for length, truncation in ((10_000, "error"), (12, "left"), (12, "right")):
        assert tokenize_prompts(tokenizer, conversations, length, where, truncation) == [
            tokenize_prompt(tokenizer, m, length, w, truncation) for m, w in zip(conversations, where)]
    with pytest.raises(DatasetError, match="row 17: prompt is .* tokens, over data.max_prompt_length=40"):
        tokenize_prompts(tokenizer, conversations, 40, where)
    assert tokenize_prompts(tokenizer, [], 40, []) == []


def test_filter_overlong_prompts_drops_rows_when_the_run_is_prepared(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "kfrl/arith", "prompt": [{"role": "user", "content": text}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": "5"}, "extra_info": {"index": i}}
            for i, text in enumerate(["What is 2 + 3?", "What is 2 + 3? " * 20, "What is 1 + 4?"])]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    cfg = load_config(None, [f"data.train_files={path}", "data.max_prompt_length=40", "data.filter_overlong_prompts=true",
                             "data.train_batch_size=2", "actor.ppo_mini_batch_size=2"])
    store = Store(str(tmp_path / "run"))
    prepare_run(store, cfg)
    manifest = store.manifest("data/train")
    assert manifest.info["rows"] == 2 and manifest.info["filtered_overlong"] == 1


def test_custom_reward_function_receives_raw_chat_and_its_extra_keys_reach_the_batch(tmp_path):
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(
        "def my_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    prompt = extra_info['raw_prompt'][0]['content']\n"
        "    return {'score': float(len(solution_str) % 3), 'prompt_chars': len(prompt), 'source_ok': data_source == 'kfrl/arith'}\n")
    cfg = load_config(None, SMALL + [f"reward.custom_function_path={reward_file}", "reward.custom_function_name=my_score",
                                     "data.return_raw_chat=true"])
    store = Store(str(tmp_path / "run"))
    prepare_run(store, cfg)
    run_stage("rollout", store.uri, 1)
    result = run_stage("score", store.uri, 1)
    ctx = StageContext.open(store.uri, 1)
    table = ctx.read_groups("rollout", "score")
    extras = [json.loads(e) for e in table.column("reward_extra").to_pylist()]
    prompts = [json.loads(p)[0]["content"] for p in table.column("raw_prompt").to_pylist()]
    assert [e["prompt_chars"] for e in extras] == [len(p) for p in prompts]
    assert all(e["source_ok"] for e in extras)
    assert set(table.column("score").to_pylist()) <= {0.0, 1.0, 2.0}
    assert "reward_extra/prompt_chars/mean" in result.metrics


@pytest.mark.numerics
def test_reward_model_scores_are_batched_and_equal_a_direct_forward(tmp_path, tiny_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_dir, num_labels=1)
    rm_dir = tmp_path / "rm"
    rm.save_pretrained(rm_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    tokenizer.save_pretrained(rm_dir)

    cfg = load_config(None, SMALL + ["reward.name=model", f"reward.model_path={rm_dir}", "reward.micro_batch_size=3"])
    store = Store(str(tmp_path / "run"))
    prepare_run(store, cfg)
    run_stage("rollout", store.uri, 1)
    run_stage("score", store.uri, 1)
    table = StageContext.open(store.uri, 1).read_groups("rollout", "score")
    # One conversation scored alone, by hand.
    messages = json.loads(table.column("raw_prompt")[0].as_py())
    response = tokenizer.decode(table.column("response_ids")[0].as_py(), skip_special_tokens=True)
    text = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    rm = AutoModelForSequenceClassification.from_pretrained(rm_dir, num_labels=1).eval()
    rm.config.pad_token_id = tokenizer.pad_token_id
    with torch.no_grad():
        expected = rm(**ids).logits[0, 0].item()
    # The stage scores in micro-batches of 3, padded; by hand one sequence alone: two float32 passes of
    # other shapes. The score is a 96-term dot product of the final hidden state with the head (a fresh
    # N(0, 0.02^2) row: |terms| summing to ~5), within gamma(96) * 5 ~ 3e-5 from its own summation
    # order, plus the hidden state's rounding (relative ~1e-6 through 3 layers): abs 1e-4.
    assert table.column("score")[0].as_py() == pytest.approx(expected, abs=1e-4)
    assert len(set(table.column("score").to_pylist())) > 1


def test_vllm_backend_is_named_when_it_cannot_run(tmp_path, monkeypatch):
    import sys

    from kfrl.engines.rollout_vllm import VllmRollout

    monkeypatch.setitem(sys.modules, "vllm", None)  # as on a machine without the gpu extra
    with pytest.raises(RuntimeError, match=r"rollout.name=vllm needs the vllm package.*rollout.name=torch or hf"):
        VllmRollout(tmp_path, {2})
