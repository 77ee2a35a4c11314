"""GSM8K preparation (kfrl.data.gsm8k) against hand-checked veRL v0.7.1 output.

The fixture (tests/fixtures/gsm8k) holds invented GSM8K-style rows in the HF repo layout and in
the original JSONL layout; expected_{train,test}.json are the rows veRL's gsm8k.py would write,
written by hand. Everything runs on local files in a temp dir.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kfrl.data.gsm8k import (
    INSTRUCTION,
    SCHEMA,
    GSM8KError,
    PrepResult,
    extract_ground_truth,
    make_row,
    prepare_gsm8k,
)

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "gsm8k"
HF = FIXTURE / "hf"
JSONL = FIXTURE / "jsonl"
SPLITS = ("train", "test")


def expected(split: str) -> list[dict]:
    return json.loads((FIXTURE / f"expected_{split}.json").read_text())


def read_rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def raw_rows(split: str) -> list[dict]:
    return [json.loads(line) for line in (JSONL / f"{split}.jsonl").read_text().splitlines()]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------------------------
# golden output


@pytest.mark.parametrize("layout", [HF, JSONL], ids=["hf", "jsonl"])
def test_output_matches_golden(tmp_path, layout):
    results = prepare_gsm8k(layout, tmp_path / "out")
    assert set(results) == set(SPLITS)
    for split in SPLITS:
        want = expected(split)
        assert results[split] == PrepResult(path=tmp_path / "out" / f"{split}.parquet", rows=len(want))
        got = read_rows(results[split].path)
        assert got == want
        # Key order too (dict equality ignores it): columns, then struct fields.
        for got_row, want_row in zip(got, want):
            assert list(got_row) == list(want_row)
            for column in ("reward_model", "extra_info"):
                assert list(got_row[column]) == list(want_row[column])
            assert [list(m) for m in got_row["prompt"]] == [["role", "content"]]


def test_hf_and_jsonl_layouts_write_identical_files(tmp_path):
    hf = prepare_gsm8k(HF, tmp_path / "hf")
    jl = prepare_gsm8k(JSONL, tmp_path / "jsonl")
    for split in SPLITS:
        assert hf[split].path.read_bytes() == jl[split].path.read_bytes()


def test_prompt_text_is_question_space_instruction(tmp_path):
    assert INSTRUCTION == 'Let\'s think step by step and output the final answer after "####".'
    out = prepare_gsm8k(HF, tmp_path)["train"].path
    for row, raw in zip(read_rows(out), raw_rows("train")):
        assert row["prompt"] == [{"role": "user", "content": raw["question"] + " " + INSTRUCTION}]
        assert row["extra_info"]["question"] == raw["question"]
        assert row["extra_info"]["answer"] == raw["answer"]


def test_arrow_schema_types_and_field_order(tmp_path):
    schema = pq.read_schema(prepare_gsm8k(HF, tmp_path)["train"].path)
    assert schema.names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    assert schema.field("data_source").type == pa.string()
    assert schema.field("prompt").type == pa.list_(message)
    assert schema.field("ability").type == pa.string()
    assert schema.field("reward_model").type == pa.struct([("style", pa.string()), ("ground_truth", pa.string())])
    assert schema.field("extra_info").type == pa.struct([
        ("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()), ("question", pa.string())])
    assert schema.remove_metadata().equals(SCHEMA)


def test_rows_keep_input_order_and_index_within_split(tmp_path):
    results = prepare_gsm8k(JSONL, tmp_path)
    for split in SPLITS:
        rows = read_rows(results[split].path)
        assert [r["extra_info"]["index"] for r in rows] == list(range(len(rows)))
        assert [r["extra_info"]["question"] for r in rows] == [r["question"] for r in raw_rows(split)]
        assert {r["extra_info"]["split"] for r in rows} == {split}


# ---------------------------------------------------------------------------------------------
# ground truth


@pytest.mark.parametrize("answer, truth", [
    ("so 1,080 muffins.\n#### 1,080", "1080"),
    ("#### 1,234,567", "1234567"),
    ("#### -7", "-7"),
    ("#### 9.25", "9.25"),
    ("#### 5.", "5."),                       # the dot is in veRL's character class
    ("#### 12 apples", "12"),
    ("#### 3\n#### 4", "3"),                 # first match wins (re.search)
    ("####3", None),                         # needs the space
    ("the answer is 3", None),
    ("#### x", None),
])
def test_extract_ground_truth(answer, truth):
    assert extract_ground_truth(answer) == truth


def test_fixture_covers_comma_negative_and_decimal(tmp_path):
    truths = [r["reward_model"]["ground_truth"] for r in read_rows(prepare_gsm8k(HF, tmp_path)["train"].path)]
    assert "1080" in truths and "-7" in truths and "9.25" in truths
    assert not any("," in t for t in truths)


def test_make_row_is_the_golden_row():
    raw = raw_rows("train")[1]
    assert make_row(raw["question"], raw["answer"], "train", 1) == expected("train")[1]


# ---------------------------------------------------------------------------------------------
# input layouts


def test_accepts_the_main_directory_itself(tmp_path):
    a = prepare_gsm8k(HF / "main", tmp_path / "a")
    b = prepare_gsm8k(HF, tmp_path / "b")
    for split in SPLITS:
        assert a[split].path.read_bytes() == b[split].path.read_bytes()


def test_accepts_flat_parquet_directory(tmp_path):
    flat = tmp_path / "flat"
    flat.mkdir()
    for split in SPLITS:
        shutil.copy(HF / "main" / f"{split}-00000-of-00001.parquet", flat / f"{split}.parquet")
    results = prepare_gsm8k(flat, tmp_path / "out")
    for split in SPLITS:
        assert read_rows(results[split].path) == expected(split)


def test_shards_are_concatenated_in_name_order_with_a_running_index(tmp_path):
    table = pq.read_table(HF / "main" / "train-00000-of-00001.parquet")
    main = tmp_path / "repo" / "main"
    main.mkdir(parents=True)
    pq.write_table(table.slice(2), main / "train-00001-of-00002.parquet")  # written first on purpose
    pq.write_table(table.slice(0, 2), main / "train-00000-of-00002.parquet")
    shutil.copy(HF / "main" / "test-00000-of-00001.parquet", main)
    results = prepare_gsm8k(tmp_path / "repo", tmp_path / "out")
    assert read_rows(results["train"].path) == expected("train")


def test_single_file_split_from_name_or_argument(tmp_path):
    by_name = prepare_gsm8k(HF / "main" / "test-00000-of-00001.parquet", tmp_path / "a")
    assert list(by_name) == ["test"] and read_rows(by_name["test"].path) == expected("test")
    assert not (tmp_path / "a" / "train.parquet").exists()

    renamed = tmp_path / "gsm8k_eval.jsonl"
    shutil.copy(JSONL / "test.jsonl", renamed)
    with pytest.raises(GSM8KError, match="split"):
        prepare_gsm8k(renamed, tmp_path / "b")
    explicit = prepare_gsm8k(renamed, tmp_path / "b", split="test")
    assert read_rows(explicit["test"].path) == expected("test")


def test_splits_argument_limits_what_is_written(tmp_path):
    results = prepare_gsm8k(HF, tmp_path, splits=("test",))
    assert list(results) == ["test"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test.parquet"]
    assert list(prepare_gsm8k(JSONL, tmp_path / "one", split="train")) == ["train"]


# ---------------------------------------------------------------------------------------------
# errors


def test_missing_input_names_path_and_layouts(tmp_path):
    missing = tmp_path / "nowhere" / "gsm8k"
    with pytest.raises(FileNotFoundError) as err:
        prepare_gsm8k(missing, tmp_path / "out")
    message = str(err.value)
    assert str(missing) in message
    assert "main/train-*.parquet" in message and "train.jsonl" in message and "train.parquet" in message
    assert not (tmp_path / "out").exists()


def test_directory_without_a_split_names_it(tmp_path):
    write_jsonl(tmp_path / "in" / "train.jsonl", raw_rows("train"))
    with pytest.raises(GSM8KError, match=r"no 'test' split in .*in: expected"):
        prepare_gsm8k(tmp_path / "in", tmp_path / "out")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_row_without_final_answer_names_file_and_row(tmp_path, fmt):
    rows = raw_rows("train")
    rows[2] = {"question": rows[2]["question"], "answer": "He spends 9.25 dollars."}
    if fmt == "jsonl":
        path = write_jsonl(tmp_path / "in" / "train.jsonl", rows)
    else:
        path = tmp_path / "in" / "train.parquet"
        path.parent.mkdir()
        pq.write_table(pa.Table.from_pylist(rows), path)
    write_jsonl(tmp_path / "in" / "test.jsonl", raw_rows("test"))
    out = tmp_path / "out"
    with pytest.raises(GSM8KError) as err:
        prepare_gsm8k(tmp_path / "in", out)
    assert f"{path}: row 2:" in str(err.value) and "####" in str(err.value)
    assert not out.exists() or not any(out.iterdir())  # nothing written on failure


def test_parquet_without_gsm8k_columns_names_them(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"problem": ["x"], "solution": ["#### 1"]}), path)
    with pytest.raises(GSM8KError, match=r"train.parquet: missing column\(s\) \['question', 'answer'\]"):
        prepare_gsm8k(path, tmp_path / "out")


def test_two_layouts_for_one_split_is_an_error(tmp_path):
    write_jsonl(tmp_path / "in" / "train.jsonl", raw_rows("train"))
    shutil.copy(HF / "main" / "train-00000-of-00001.parquet", tmp_path / "in" / "train.parquet")
    with pytest.raises(GSM8KError, match="more than one layout"):
        prepare_gsm8k(tmp_path / "in", tmp_path / "out", splits=("train",))


# ---------------------------------------------------------------------------------------------
# re-runs and consumers


def test_rerun_is_idempotent_and_leaves_no_temp_files(tmp_path):
    first = prepare_gsm8k(HF, tmp_path)
    before = {s: r.path.read_bytes() for s, r in first.items()}
    second = prepare_gsm8k(HF, tmp_path)
    assert second == first
    assert {s: r.path.read_bytes() for s, r in second.items()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test.parquet", "train.parquet"]


def test_kfrl_loader_reads_the_output(tmp_path):
    from kfrl.batch import table_from_parquet_bytes
    from kfrl.config import load_config
    from kfrl.data.dataset import ground_truth_of, prompt_messages
    from kfrl.rewards import compute_score
    from kfrl.stages.prepare import _read_dataset_source

    path = prepare_gsm8k(HF, tmp_path)["train"].path
    table = table_from_parquet_bytes(path.read_bytes(), str(path))
    assert table.equals(_read_dataset_source(str(path), split="train", config=load_config()))
    for row, want in zip(table.to_pylist(), expected("train")):
        assert prompt_messages(row, "prompt", str(path)) == want["prompt"]
        truth = ground_truth_of(row)
        assert truth == want["reward_model"]["ground_truth"]
        # The worked answer itself scores 1 under the openai/gsm8k reward: the ground truth
        # written here is what kfrl's (veRL's) strict extraction reads from a correct response.
        assert compute_score(row["data_source"], row["extra_info"]["answer"], truth) == 1.0
