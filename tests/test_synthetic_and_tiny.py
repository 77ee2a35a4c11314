"""The synthetic arithmetic task, the tiny Qwen2 model built on it, and HF directory I/O."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kfrl.rewards.gsm8k import extract_solution
import torch

from kfrl.data.synthetic import (
    DATA_SOURCE,
    make_arith_rows,
    reference_solution,
)
from kfrl.models import tiny
from kfrl.models.hf_io import load_causal_lm, load_tokenizer, save_hf
from kfrl.models.tiny import (
    BUILTIN_MODELS,
    CHAT_TEMPLATE,
    answer_accuracy,
    arith_corpus,
    build_tiny_model,
    build_tokenizer,
    materialize_builtin,
)

BUILTIN = "tiny-qwen2-arith"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(arith_corpus(make_arith_rows(500, 0, "train")))


@pytest.fixture(scope="module")
def builtin_dir() -> Path:
    """The builtin model in the shared cache: built there by materialize_builtin on a cold cache (as on
    CI's clean clone), by this run or an earlier one. A private build of the same recipe trained the
    same model once more (~30 s on 2 cores)."""
    return materialize_builtin(f"builtin:{BUILTIN}")


# --------------------------------------------------------------------------- rows


def test_rows_have_verl_rl_dataset_schema():
    rows = make_arith_rows(20, seed=3, split="train")
    assert len(rows) == 20
    for index, row in enumerate(rows):
        assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        assert row["data_source"] == DATA_SOURCE == "kfrl/arith"
        assert row["ability"] == "math"
        assert isinstance(row["prompt"], list) and len(row["prompt"]) == 1
        assert set(row["prompt"][0]) == {"role", "content"}
        assert row["prompt"][0]["role"] == "user"
        assert row["reward_model"] == {"style": "rule", "ground_truth": row["reward_model"]["ground_truth"]}
        truth = row["reward_model"]["ground_truth"]
        assert isinstance(truth, str) and truth == str(int(truth))
        extra = row["extra_info"]
        assert set(extra) == {"split", "index", "answer", "question"}
        assert extra["split"] == "train" and extra["index"] == index and isinstance(extra["index"], int)
        assert extra["question"] == row["prompt"][0]["content"]
        # The reference answer passes veRL's gsm8k strict rule against the ground truth.
        assert extra["answer"].endswith(f"#### {truth}")
        assert extract_solution(extra["answer"], method="strict") == truth


def test_ground_truth_is_the_sum():
    for row in make_arith_rows(50, seed=0, split="test"):
        a, b = (int(x) for x in row["extra_info"]["question"].removeprefix("What is ").rstrip("?").split(" + "))
        assert row["reward_model"]["ground_truth"] == str(a + b)
        assert 0 <= a <= 99 and 0 <= b <= 99


def test_reference_solution_format():
    assert reference_solution({"a": 37, "b": 58}) == "37+58=95\n#### 95"


def test_rows_are_deterministic_per_seed_and_splits_disjoint():
    assert make_arith_rows(30, seed=7, split="train") == make_arith_rows(30, seed=7, split="train")
    assert make_arith_rows(30, seed=7, split="train") != make_arith_rows(30, seed=8, split="train")
    train_q = {r["extra_info"]["question"] for r in make_arith_rows(3000, seed=0, split="train")}
    test_q = {r["extra_info"]["question"] for r in make_arith_rows(500, seed=0, split="test")}
    assert not train_q & test_q


def test_unknown_split_is_rejected():
    with pytest.raises(ValueError, match="validation"):
        make_arith_rows(1, seed=0, split="validation")


def test_builtin_data_is_committed_in_verls_schema_and_round_trips(tmp_path):
    from kfrl.config import load_config
    from kfrl.stages.prepare import prepare_data
    from kfrl.store import Store

    cfg = load_config(None, ["data.builtin_train_size=16", "data.val_files=builtin:arith", "data.builtin_val_size=8",
                             "data.seed=5"])
    store = Store(str(tmp_path / "run"))
    prepare_data(store, cfg)
    train = pq.read_table(store.download(store.manifest("data/train"), tmp_path / "train"))
    assert train.to_pylist() == make_arith_rows(16, seed=5, split="train")
    assert train.num_rows == 16 and pq.read_table(store.download(store.manifest("data/val"), tmp_path / "val")).num_rows == 8
    assert str(train.schema.field("prompt").type) == "list<element: struct<role: string, content: string>>"
    assert str(train.schema.field("reward_model").type) == "struct<style: string, ground_truth: string>"


# --------------------------------------------------------------------------- tokenizer


def test_digits_are_single_tokens(tokenizer):
    for digit in "0123456789":
        assert len(tokenizer(digit, add_special_tokens=False)["input_ids"]) == 1
    assert tokenizer.tokenize("90817") == list("90817")
    assert len(tokenizer) < 200


def test_special_tokens_and_padding(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.padding_side == "left"
    assert len(tokenizer("<|im_start|>", add_special_tokens=False)["input_ids"]) == 1


def test_chat_template_round_trip(tokenizer):
    messages = [{"role": "user", "content": "What is 37 + 58?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nWhat is 37 + 58?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nWhat is 37 + 58?\nassistant\n"
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert without == "<|im_start|>user\nWhat is 37 + 58?<|im_end|>\n"


def test_response_is_short(tokenizer):
    answer = reference_solution({"a": 99, "b": 99})
    assert len(tokenizer(answer, add_special_tokens=False)["input_ids"]) + 1 <= 16  # + eos


def test_tokenizer_survives_save_and_auto_load(tokenizer, tmp_path):
    # AutoTokenizer picks Qwen2Tokenizer for qwen2 dirs, which rebuilds the
    # pre-tokenizer; the ids must not change.
    save_hf(build_tiny_model(tokenizer, seed=0, hidden_size=32, layers=1), tokenizer, tmp_path)
    loaded = load_tokenizer(tmp_path)
    text = "<|im_start|>user\nWhat is 7 + 45?<|im_end|>\n<|im_start|>assistant\n7+45=52\n#### 52<|im_end|>"
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.chat_template == CHAT_TEMPLATE and loaded.padding_side == "left"
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE


# --------------------------------------------------------------------------- model


def test_tiny_model_forward_shape_and_ids(tokenizer):
    model = build_tiny_model(tokenizer, seed=0)
    batch = tokenizer(["What is 1 + 2?", "What is 10 + 20?"], padding=True, return_tensors="pt")
    logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], len(tokenizer))
    cfg = model.config
    assert cfg.model_type == "qwen2" and cfg.tie_word_embeddings
    assert cfg.eos_token_id == tokenizer.eos_token_id == model.generation_config.eos_token_id
    assert cfg.pad_token_id == tokenizer.pad_token_id == model.generation_config.pad_token_id
    assert cfg.bos_token_id == model.generation_config.bos_token_id is not None
    assert sum(p.numel() for p in model.parameters()) < 1_000_000


def test_tiny_model_init_is_seeded(tokenizer):
    a = build_tiny_model(tokenizer, seed=1).state_dict()
    b = build_tiny_model(tokenizer, seed=1).state_dict()
    c = build_tiny_model(tokenizer, seed=2).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_random_init_model_does_not_solve_the_task(tokenizer):
    rows = make_arith_rows(64, seed=0, split="test")
    assert answer_accuracy(build_tiny_model(tokenizer, seed=0), tokenizer, rows, do_sample=True)["accuracy"] <= 0.05


# --------------------------------------------------------------------------- builtin


def test_builtin_is_a_loadable_hf_dir(builtin_dir):
    assert builtin_dir.name.startswith(f"{BUILTIN}-")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors"):
        assert (builtin_dir / name).is_file(), name
    model = load_causal_lm(builtin_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert load_tokenizer(builtin_dir).apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    ).endswith("<|im_start|>assistant\n")
    assert load_causal_lm(builtin_dir, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_builtin_second_call_is_cached(builtin_dir):
    started = time.perf_counter()
    again = materialize_builtin(BUILTIN, builtin_dir.parent)  # without the prefix this time
    assert time.perf_counter() - started < 1.0
    assert again == builtin_dir


@pytest.mark.numerics
def test_warm_start_learned_the_task(builtin_dir):
    # The builtin model's behaviour, which depends on the kernels it was trained with (the shared cache's,
    # as every other test and make test-portability use).
    model, tok = load_causal_lm(builtin_dir), load_tokenizer(builtin_dir)
    rows = make_arith_rows(64, seed=0, split="test")
    sampled = answer_accuracy(model, tok, rows, do_sample=True, seed=0)
    # Learnt, yet far from solved, so that RL has room to raise the reward.
    assert 0.15 <= sampled["accuracy"] <= 0.85, sampled
    assert sampled["format_rate"] >= 0.9, sampled
    metrics = json.loads((builtin_dir / "kfrl_builtin.json").read_text())["metrics"]
    assert metrics["sft/loss_last"] < metrics["sft/loss_first"]


def test_unknown_builtin_names_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="no-such-model") as err:
        materialize_builtin("builtin:no-such-model", tmp_path)
    assert all(name in str(err.value) for name in BUILTIN_MODELS)


def test_default_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KFRL_CACHE_DIR", str(tmp_path))
    assert tiny.default_cache_dir() == tmp_path
    monkeypatch.delenv("KFRL_CACHE_DIR")
    assert tiny.default_cache_dir() == Path.home() / ".cache" / "kfrl"


def test_interrupted_or_racing_builds_are_safe(monkeypatch, tmp_path):
    """A leftover staging dir is ignored; losing a race to another process is not an error."""
    final = tmp_path / f"{BUILTIN}-{tiny._recipe_key(BUILTIN_MODELS[BUILTIN])}"
    (tmp_path / f".{BUILTIN}-building-crashed").mkdir()  # what a killed build leaves behind

    def build_while_another_process_finishes(recipe, out_dir):
        (out_dir / "config.json").write_text("{}")
        final.mkdir()  # the other process renames its copy into place first
        (final / "config.json").write_text('{"winner": true}')

    monkeypatch.setattr(tiny, "build_builtin", build_while_another_process_finishes)
    assert materialize_builtin(BUILTIN, tmp_path) == final
    assert json.loads((final / "config.json").read_text()) == {"winner": True}
    assert not any(p.name.startswith(f".{BUILTIN}-building-") and p.name != f".{BUILTIN}-building-crashed"
                   for p in tmp_path.iterdir())


# --------------------------------------------------------------------------- hf_io


def test_missing_model_path_names_the_path(tmp_path):
    missing = tmp_path / "no-model-here"
    with pytest.raises(FileNotFoundError, match="no-model-here") as err:
        load_causal_lm(missing)
    assert "config.json" in str(err.value)
    with pytest.raises(FileNotFoundError, match="no-model-here"):
        load_tokenizer(missing)
    missing.mkdir()  # exists, but is not an HF directory
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_causal_lm(missing)
