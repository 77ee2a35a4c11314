"""Batch contract: schemas, validation errors that name file and column, joins, padding."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from kfrl.batch import (
    OPTIONAL_COLUMNS,
    GROUPS,
    PER_TOKEN_COLUMNS,
    BatchError,
    join,
    make_table,
    read_group,
    to_torch_padded,
    validate,
    write_group,
)
from kfrl.store import Store, StoreError

PREFIX = "exp/run/iter-000000"


def rollout_columns(ids=("s0", "s1", "s2"), lengths=(3, 1, 2)) -> dict:
    return {
        "sample_id": list(ids),
        "uid": ["p0", "p0", "p1"][: len(ids)],
        "iteration": [0] * len(ids),
        "policy_version": [0] * len(ids),
        "data_source": ["synthetic"] * len(ids),
        "prompt_ids": [[1, 2]] * len(ids),
        "response_ids": [list(range(n)) for n in lengths],
        "response_mask": [[1] * n for n in lengths],
        "rollout_logprobs": [[-0.5] * n for n in lengths],
        "finish_reason": ["stop"] * len(ids),
        "ground_truth": ["42"] * len(ids),
        "extra_info": ["{}"] * len(ids),
        "raw_prompt": ["[]"] * len(ids),
    }


def score_table(ids=("s0", "s1", "s2")) -> pa.Table:
    n = len(ids)
    return make_table("score", {"sample_id": list(ids), "score": [1.0] * n, "acc": [1.0] * n,
                                "reward_extra": ["{}"] * n})


def test_groups_use_contract_types():
    assert GROUPS["rollout"].field("response_ids").type == pa.list_(pa.int32())
    assert GROUPS["advantage"].field("advantages").type == pa.list_(pa.float32())
    assert GROUPS["score"].field("score").type == pa.float32()
    for schema in GROUPS.values():
        assert schema.names[0] == "sample_id"
        for name in set(schema.names) & PER_TOKEN_COLUMNS:
            assert pa.types.is_list(schema.field(name).type)


# The rollout group without the multi-turn columns (num_turns, turn_offsets), which only a
# multi-turn rollout writes.
SINGLE_TURN_ROLLOUT = pa.schema([f for f in GROUPS["rollout"] if f.name not in OPTIONAL_COLUMNS["rollout"]])


def test_make_table_accepts_numpy_and_torch():
    columns = rollout_columns()
    columns["iteration"] = np.zeros(3, dtype=np.int32)
    columns["response_ids"] = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10])]
    columns["rollout_logprobs"] = [np.full(n, -1.0, dtype=np.float64) for n in (3, 1, 2)]
    table = make_table("rollout", columns)
    assert table.schema == SINGLE_TURN_ROLLOUT
    assert table.column("response_ids").to_pylist() == [[5, 6, 7], [8], [9, 10]]
    assert table.column("rollout_logprobs").to_pylist()[1] == [-1.0]

    old = make_table("old_logprob", {"sample_id": ["a"], "old_logprobs": torch.tensor([[0.5, 0.25]]).tolist(),
                                     "entropy": [torch.tensor([1.0, 2.0], dtype=torch.bfloat16)]})
    assert old.column("entropy").to_pylist() == [[1.0, 2.0]]


def test_validate_casts_and_orders_columns():
    table = pa.table({"score": pa.array([1.0, 0.0], pa.float64()), "acc": [1, 0],
                      "reward_extra": ["{}", "{}"], "sample_id": ["a", "b"]})
    checked = validate("score", table, "scores.parquet")
    assert checked.schema == GROUPS["score"]
    assert checked.column_names == ["sample_id", "score", "acc", "reward_extra"]


def test_missing_extra_and_wrong_type_name_source_and_column():
    good = score_table()
    with pytest.raises(BatchError, match=r"s3://b/score\.parquet.*'acc' is missing") as err:
        validate("score", good.drop_columns(["acc"]), "s3://b/score.parquet")
    assert err.value.column == "acc" and err.value.source == "s3://b/score.parquet"

    with pytest.raises(BatchError, match=r"f\.parquet.*'bonus' is not part of the 'score' group"):
        validate("score", good.append_column("bonus", pa.array([1, 2, 3])), "f.parquet")

    wrong = good.set_column(1, "score", pa.array(["high", "low", "mid"]))
    with pytest.raises(BatchError, match=r"f\.parquet: column 'score' has type string, expected float"):
        validate("score", wrong, "f.parquet")

    with pytest.raises(BatchError, match="'sample_id' repeats 's0'"):
        score_table(ids=("s0", "s0"))
    with pytest.raises(BatchError, match="unknown column group 'scores'"):
        make_table("scores", {})


def test_rollout_validation_checks_token_lengths_and_finish_reason():
    columns = rollout_columns()
    columns["response_mask"][2] = [1]
    with pytest.raises(BatchError, match=r"'response_mask' has 1 values for sample 's2'.*2 tokens"):
        make_table("rollout", columns)
    columns = rollout_columns()
    columns["finish_reason"][0] = "eos"
    with pytest.raises(BatchError, match="finish_reason"):
        make_table("rollout", columns)


def test_join_keeps_rollout_order_and_checks_lengths():
    rollout = make_table("rollout", rollout_columns())
    scores = score_table(ids=("s2", "s0", "s1")).set_column(
        1, "score", pa.array([2.0, 0.0, 1.0], pa.float32()))
    values = make_table("values", {"sample_id": ["s1", "s2", "s0"],
                                   "values": [[0.1], [0.2, 0.2], [0.0, 0.0, 0.0]]})
    joined = join({"score": scores, "values": values, "rollout": rollout})
    assert joined.column("sample_id").to_pylist() == ["s0", "s1", "s2"]
    assert joined.column("score").to_pylist() == [0.0, 1.0, 2.0]
    assert joined.column_names[:len(SINGLE_TURN_ROLLOUT.names)] == SINGLE_TURN_ROLLOUT.names

    bad_values = make_table("values", {"sample_id": ["s0", "s1", "s2"],
                                       "values": [[0.0, 0.0, 0.0], [0.1, 0.1], [0.2, 0.2]]})
    with pytest.raises(BatchError, match=r"'values' has 2 values for sample 's1'"):
        join({"rollout": rollout, "values": bad_values})


def test_join_reports_missing_sample_ids():
    rollout = make_table("rollout", rollout_columns())
    with pytest.raises(BatchError, match=r"1 sample id\(s\) of 'rollout' are missing from 'score'"):
        join({"rollout": rollout, "score": score_table(ids=("s0", "s2"))})
    with pytest.raises(BatchError, match="missing from 'rollout'"):
        join({"rollout": rollout, "score": score_table(ids=("s0", "s1", "s2", "s3"))})


def test_write_and_read_group_through_store(tmp_path):
    store = Store(str(tmp_path))
    attempt = store.open_attempt(f"{PREFIX}/rollout")
    write_group(attempt, "rollout", make_table("rollout", rollout_columns(ids=("a", "b"), lengths=(1, 2))),
                name="part-00000.parquet")
    write_group(attempt, "rollout", make_table("rollout", rollout_columns(ids=("c",), lengths=(4,))),
                name="part-00001.parquet")
    manifest = attempt.commit()
    table = read_group(store, manifest, "rollout")
    assert table.schema == SINGLE_TURN_ROLLOUT
    assert table.column("sample_id").to_pylist() == ["a", "b", "c"]

    with pytest.raises(BatchError, match="'old_logprobs' is missing") as err:
        read_group(store, manifest, "old_logprob")
    assert store.file_url(manifest, "part-00000.parquet") in str(err.value)


def test_corrupt_parquet_file_is_named(tmp_path):
    store = Store(str(tmp_path))
    attempt = store.open_attempt(f"{PREFIX}/score")
    attempt.write_bytes("part-00000.parquet", b"PAR1 this is not parquet")
    manifest = attempt.commit()
    with pytest.raises(BatchError, match="not a readable Parquet file") as err:
        read_group(store, manifest, "score")
    assert store.file_url(manifest, "part-00000.parquet") in str(err.value)

    # A file changed after commit is caught by the store's checksum before Parquet sees it.
    good = store.open_attempt(f"{PREFIX}/values")
    write_group(good, "values", make_table("values", {"sample_id": ["a"], "values": [[1.0]]}))
    manifest = good.commit()
    path = tmp_path / manifest.prefix / manifest.attempt / "part-00000.parquet"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(StoreError, match="part-00000.parquet"):
        read_group(store, manifest, "values")


def test_to_torch_padded():
    table = make_table("rollout", rollout_columns(lengths=(3, 1, 2)))
    ids = to_torch_padded(table, "response_ids", pad_value=-1)
    assert ids.dtype == torch.long
    assert ids.tolist() == [[0, 1, 2], [0, -1, -1], [0, 1, -1]]
    logprobs = to_torch_padded(table.slice(1), "rollout_logprobs")
    assert logprobs.dtype == torch.float32 and logprobs.tolist() == [[-0.5, 0.0], [-0.5, -0.5]]
    assert to_torch_padded(table, "response_mask", dtype=torch.bool).sum().item() == 6
    with pytest.raises(BatchError, match="expected a list"):
        to_torch_padded(table, "iteration")


def test_left_padding_for_generation():
    from kfrl.engines.rollout import left_pad

    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0, device="cpu", width=4)
    assert ids.tolist() == [[0, 5, 6, 7], [0, 0, 0, 8]]
    assert mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]


def test_trajectories_from_a_table_put_each_prompt_before_its_response_and_vectors_make_the_same_columns():
    from kfrl.trajectory import Trajectories

    prompts, responses = [[11, 12, 13], [21], [31, 32]], [[1, 2], [3, 4, 5, 6], []]
    table = pa.table({"prompt_ids": pa.array(prompts, pa.list_(pa.int32())),
                      "response_ids": pa.array(responses, pa.list_(pa.int32())),
                      "response_mask": pa.array([[1] * len(r) for r in responses], pa.list_(pa.int32()))})
    batch = Trajectories.from_table(table, pad_id=-7)
    assert batch.input_ids.tolist() == [[11, 12, 13, 1, 2], [21, 3, 4, 5, 6], [31, 32, -7, -7, -7]]
    assert batch.input_ids.dtype == torch.long and batch.lengths.tolist() == [2, 4, 0]
    assert batch.attention_mask.tolist() == [[1] * 5, [1] * 5, [1, 1, 0, 0, 0]]
    # Each response token's logits sit one position before it, in the row's own layout.
    assert batch.gather_positions.tolist() == [[2, 3, 4, 4], [0, 1, 2, 3], [1, 1, 1, 1]]
    values = torch.arange(12, dtype=torch.bfloat16).view(3, 4) / 3
    vectors, lists = batch.unpad_vectors(values), batch.unpad(values)
    assert [v.tolist() for v in vectors] == lists and [len(v) for v in lists] == [2, 4, 0]
    columns = {"sample_id": ["a", "b", "c"], "token_level_rewards": vectors, "advantages": vectors, "returns": vectors}
    listed = {**columns, "token_level_rewards": lists, "advantages": lists, "returns": lists}
    assert make_table("advantage", columns).equals(make_table("advantage", listed))
    with pytest.raises(BatchError, match="Trajectories.from_table: column 'prompt_ids' has 1 null row"):
        Trajectories.from_table(table.set_column(0, "prompt_ids", pa.array([[1], None, [2]], pa.list_(pa.int32()))),
                                pad_id=0)
