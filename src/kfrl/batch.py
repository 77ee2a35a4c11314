"""The Parquet batch contract: one row per trajectory, one column group per writing stage.

Every stage writes only the columns it adds, keyed by ``sample_id``, as its own Parquet file
under its own committed prefix; readers join the groups they need. Token sequences are
``list<int32>``; per-token floats are ``list<float32>`` over the response tokens only (veRL's
``(bs, response_length)`` without the padding), so each has the length of ``response_ids``.

Validation happens at both ends (on write and on read) so that a bad batch is reported by the
stage that made it, with the file and column named, rather than as a shape error three stages on.
"""
from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kfrl.store import Attempt, Manifest, Store

_TOKENS = pa.list_(pa.int32())
_TOKEN_FLOATS = pa.list_(pa.float32())


def _schema(*fields: tuple[str, pa.DataType]) -> pa.Schema:
    return pa.schema([pa.field("sample_id", pa.string()), *(pa.field(n, t) for n, t in fields)])


GROUPS: dict[str, pa.Schema] = {
    "rollout": _schema(
        ("uid", pa.string()),
        ("iteration", pa.int64()),
        ("policy_version", pa.int64()),
        ("data_source", pa.string()),
        ("prompt_ids", _TOKENS),
        ("response_ids", _TOKENS),
        ("response_mask", _TOKENS),
        ("rollout_logprobs", _TOKEN_FLOATS),
        ("finish_reason", pa.string()),
        ("ground_truth", pa.string()),
        ("extra_info", pa.string()),
        ("raw_prompt", pa.string()),  # the prompt's chat messages (JSON), for reward models and functions
        # Multi-turn rollouts only (rollout.multi_turn.enable): veRL's turn count, where each turn
        # (assistant, tool, assistant, ...) starts in the response, and the row's agent (veRL's
        # agent_name: tool_agent or single_turn_agent), which ReMax's greedy baseline runs again.
        ("num_turns", pa.int64()),
        ("turn_offsets", _TOKENS),
        ("agent_name", pa.string()),
    ),
    "score": _schema(
        ("score", pa.float32()),
        ("acc", pa.float32()),
        ("reward_extra", pa.string()),
    ),
    # sum_pi_squared (optional): sum over the vocabulary of the squared token probabilities, written
    # only when algorithm.adv_estimator=optimal_token_baseline needs it (veRL's `sum_pi_squared`).
    "old_logprob": _schema(("old_logprobs", _TOKEN_FLOATS), ("entropy", _TOKEN_FLOATS),
                           ("sum_pi_squared", _TOKEN_FLOATS)),
    "ref_logprob": _schema(("ref_logprobs", _TOKEN_FLOATS)),
    "values": _schema(("values", _TOKEN_FLOATS)),
    "gen_max": _schema(("reward_baselines", pa.float32())),
    # Validation generations (one file per validation; not joined with the training groups).
    "validate": _schema(
        ("data_source", pa.string()),
        ("prompt_ids", _TOKENS),
        ("response_ids", _TOKENS),
        ("ground_truth", pa.string()),
        ("score", pa.float32()),
        ("acc", pa.float32()),
        ("reward_extra", pa.string()),
    ),
    "advantage": _schema(
        ("token_level_rewards", _TOKEN_FLOATS),
        ("advantages", _TOKEN_FLOATS),
        ("returns", _TOKEN_FLOATS),
    ),
}

PER_TOKEN_COLUMNS: set[str] = {
    "response_mask", "rollout_logprobs", "old_logprobs", "entropy", "sum_pi_squared", "ref_logprobs", "values",
    "token_level_rewards", "advantages", "returns",
}

# Columns of a group that a stage writes only when the configuration asks for them: a table of the
# group either has the column (with the group's type) or lacks it; nothing else may be missing.
OPTIONAL_COLUMNS: dict[str, frozenset[str]] = {"old_logprob": frozenset({"sum_pi_squared"}),
                                               "rollout": frozenset({"num_turns", "turn_offsets", "agent_name"})}

FINISH_REASONS = ("stop", "length")


class BatchError(ValueError):
    """A batch breaks the contract. The message names the file (or source) and the column."""

    def __init__(self, message: str, *, source: str | None = None, column: str | None = None):
        super().__init__(message)
        self.source = source
        self.column = column


def _schema_of(group: str, present: Iterable[str] | None = None) -> pa.Schema:
    """``group``'s schema; with ``present`` (the column names of a table), less the optional columns
    the table does not have."""
    try:
        schema = GROUPS[group]
    except KeyError:
        raise BatchError(f"unknown column group {group!r}; known groups: {', '.join(GROUPS)}") from None
    absent = OPTIONAL_COLUMNS.get(group, frozenset()) - set(present if present is not None else schema.names)
    return pa.schema([f for f in schema if f.name not in absent]) if absent else schema


# ---------------------------------------------------------------------------------------------
# building and validating tables


def make_table(group: str, columns: dict[str, Any]) -> pa.Table:
    """A table with exactly ``group``'s schema from python lists, numpy arrays or ``tensor.tolist()``.

    List columns also accept a sequence of 1-D numpy arrays or torch tensors (one per row).
    """
    schema = _schema_of(group, columns)
    source = f"make_table({group!r})"
    _check_column_names(group, schema, list(columns), source)
    arrays = [_to_arrow(columns[f.name], f.type, source, f.name) for f in schema]
    lengths = {f.name: len(a) for f, a in zip(schema, arrays)}
    if len(set(lengths.values())) > 1:
        raise BatchError(f"{source}: columns have different row counts: {lengths}", source=source)
    return validate(group, pa.Table.from_arrays(arrays, schema=schema), source)


def validate(group: str, table: pa.Table, source: str) -> pa.Table:
    """Check ``table`` against ``group``'s schema; return it cast to the schema, in schema order."""
    _schema_of(group)  # unknown group: fail first
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    if not isinstance(table, pa.Table):
        raise BatchError(f"{source}: expected a pyarrow.Table for group {group!r}, got "
                         f"{type(table).__name__}", source=source)
    schema = _schema_of(group, table.column_names)
    _check_column_names(group, schema, table.column_names, source)
    columns = [_cast_column(table.column(f.name), f, source) for f in schema]
    table = pa.Table.from_arrays(columns, schema=schema)
    _check_sample_ids(table, source)
    if group == "rollout":
        _check_finish_reasons(table, source)
    check_token_lengths(table, source)
    check_finite(table, source)
    return table


def check_finite(table: pa.Table, source: str) -> None:
    """No NaN or infinity in a float column: a NaN log-prob, value or advantage would silently turn
    every later loss into NaN, so the stage that produced it stops, naming the column and sample."""
    for field in table.schema:
        per_token = pa.types.is_list(field.type) and pa.types.is_floating(field.type.value_type)
        if not (per_token or pa.types.is_floating(field.type)):
            continue
        column = table.column(field.name).combine_chunks()
        values = pc.list_flatten(column) if per_token else column
        finite = pc.fill_null(pc.is_finite(values), True)
        if pc.all(finite).as_py():
            continue
        position = pc.index(finite, False).as_py()
        row = pc.list_parent_indices(column)[position].as_py() if per_token else position
        bad_rows = len(set(pc.list_parent_indices(column).filter(pc.invert(finite)).to_pylist())) if per_token \
            else pc.sum(pc.invert(finite).cast(pa.int64())).as_py()
        raise BatchError(
            f"{source}: column {field.name!r} holds {values[position].as_py()} for sample "
            f"{table.column('sample_id')[row].as_py()!r} ({bad_rows} of {table.num_rows} samples have a non-finite "
            "value); the stage that computed it diverged or was given non-finite inputs", source=source,
            column=field.name)


def _check_column_names(group: str, schema: pa.Schema, found: list[str], source: str) -> None:
    expected = schema.names
    missing = [c for c in expected if c not in found]
    duplicated = sorted({c for c in found if list(found).count(c) > 1})
    extra = [c for c in found if c not in expected]
    problems = (
        (missing, f"is missing from the {group!r} batch (missing: {missing}; expected columns: {expected}; "
                  f"found: {list(found)})"),
        (duplicated, "appears more than once"),
        (extra, f"is not part of the {group!r} group (extra: {extra}; the group has: {expected}); drop it or "
                "write it as part of the group that owns it"),
    )
    for columns, problem in problems:
        if columns:
            raise BatchError(f"{source}: column {columns[0]!r} {problem}", source=source, column=columns[0])


def _cast_column(column: pa.ChunkedArray, field: pa.Field, source: str) -> pa.ChunkedArray:
    if column.type == field.type:
        return column
    try:
        return column.cast(field.type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as err:
        raise BatchError(
            f"{source}: column {field.name!r} has type {column.type}, expected {field.type} "
            f"and it cannot be converted ({err})", source=source, column=field.name) from err


def _to_arrow(values: Any, type_: pa.DataType, source: str, column: str) -> pa.Array:
    try:
        if pa.types.is_list(type_) and _is_sequence_of_vectors(values):
            return _list_array_from_vectors(values, type_)
        if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
            values = values.tolist()  # numpy arrays and torch tensors
        return pa.array(values, type=type_)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError, ValueError) as err:
        raise BatchError(f"{source}: column {column!r} cannot be converted to {type_} ({err})",
                         source=source, column=column) from err


def _is_sequence_of_vectors(values: Any) -> bool:
    return (isinstance(values, (list, tuple)) and len(values) > 0
            and all(hasattr(v, "tolist") and getattr(v, "ndim", None) == 1 for v in values))


def _list_array_from_vectors(rows: Iterable[Any], type_: pa.DataType) -> pa.Array:
    # One concatenation instead of per-element python conversion: rollouts have ~1e6 tokens.
    vectors = [_as_numpy(v) for v in rows]
    lengths = np.fromiter((len(v) for v in vectors), dtype=np.int64, count=len(vectors))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    flat = np.concatenate(vectors) if vectors else np.array([])
    value_type = type_.value_type
    flat_array = pa.array(flat).cast(value_type)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), flat_array, type=type_)


def _as_numpy(vector: Any) -> np.ndarray:
    if isinstance(vector, np.ndarray):
        return vector
    if hasattr(vector, "detach"):  # torch: bf16/fp16 have no numpy dtype, go through float32
        vector = vector.detach().cpu()
        if vector.is_floating_point():
            vector = vector.float()
        return vector.numpy()
    return np.asarray(vector.tolist())


def _check_sample_ids(table: pa.Table, source: str) -> None:
    ids = table.column("sample_id")
    if ids.null_count:
        raise BatchError(f"{source}: column 'sample_id' has {ids.null_count} null value(s); every row "
                         "needs a unique sample_id", source=source, column="sample_id")
    if pc.count_distinct(ids).as_py() != len(ids):
        counts = pc.value_counts(ids)
        duplicate = next(c["values"] for c in counts.to_pylist() if c["counts"] > 1)
        raise BatchError(f"{source}: column 'sample_id' repeats {duplicate!r}; sample ids must be "
                         "unique within a batch", source=source, column="sample_id")


def _check_finish_reasons(table: pa.Table, source: str) -> None:
    reasons = table.column("finish_reason")
    bad = pc.invert(pc.is_in(reasons, value_set=pa.array(FINISH_REASONS)))
    if pc.any(bad).as_py():
        index = pc.index(bad, True).as_py()
        raise BatchError(
            f"{source}: column 'finish_reason' holds {reasons[index].as_py()!r} for sample "
            f"{table.column('sample_id')[index].as_py()!r}; expected one of {list(FINISH_REASONS)}",
            source=source, column="finish_reason")


def check_token_lengths(table: pa.Table, source: str) -> None:
    """Every per-token column must have, row by row, the length of ``response_ids``."""
    if "response_ids" not in table.column_names:
        return
    expected = pc.list_value_length(table.column("response_ids"))
    for name in table.column_names:
        if name not in PER_TOKEN_COLUMNS:
            continue
        found = pc.list_value_length(table.column(name))
        bad = pc.fill_null(pc.not_equal(found, expected), True)
        if pc.any(bad).as_py():
            index = pc.index(bad, True).as_py()
            raise BatchError(
                f"{source}: column {name!r} has {found[index].as_py()} values for sample "
                f"{table.column('sample_id')[index].as_py()!r} but its response_ids has "
                f"{expected[index].as_py()} tokens; per-token columns cover the response tokens only",
                source=source, column=name)


# ---------------------------------------------------------------------------------------------
# files


def table_from_parquet_bytes(data: bytes, source: str, *, written_by: str = "") -> pa.Table:
    """Parse Parquet bytes; anything unreadable becomes a BatchError naming ``source``. ``written_by``
    names who can fix the file (a user's data file); by default, the stage that wrote it."""
    try:
        return pq.read_table(pa.BufferReader(data))
    except (pa.ArrowException, OSError) as err:
        fix = (f"write it again ({written_by})" if written_by else "re-run the stage that wrote it")
        raise BatchError(f"{source}: not a readable Parquet file ({err}); it is corrupt or truncated, {fix}",
                         source=source) from err


def write_group(attempt: "Attempt", group: str, table: pa.Table, name: str = "part-00000.parquet") -> None:
    """Validate ``table`` as ``group`` and write it into the attempt."""
    table = validate(group, table, source=f"{group!r} batch for {attempt.url}/{name}")
    attempt.write_parquet(name, table)


def read_group(store: "Store", manifest: "Manifest", group: str, *, pattern: str = "*.parquet") -> pa.Table:
    """Read, verify, validate and concatenate a committed group.

    ``pattern`` (fnmatch over the committed names) picks the files when one commit holds
    several groups, e.g. ``"old_logprob/*.parquet"`` for a fused stage.
    """
    _schema_of(group)  # unknown group: fail before reading anything
    names = sorted(n for n in manifest.names() if fnmatch.fnmatch(n, pattern))
    prefix_url = store.url(f"{manifest.prefix}/{manifest.attempt}")
    if not names:
        raise BatchError(f"{prefix_url}: no committed file matches {pattern!r} for group {group!r} "
                         f"(files: {manifest.names()})", source=prefix_url)
    tables = []
    for name in names:
        source = store.file_url(manifest, name)
        raw = table_from_parquet_bytes(store.read_file(manifest, name), source)
        tables.append(validate(group, raw, source))
    if len(tables) == 1:
        return tables[0]
    combined = pa.concat_tables(tables).combine_chunks()
    _check_sample_ids(combined, f"{prefix_url}/{pattern}")
    return combined


# ---------------------------------------------------------------------------------------------
# joining groups


def join(tables: dict[str, pa.Table]) -> pa.Table:
    """Join column groups on ``sample_id``, in the row order of "rollout" (else the first table).

    Every group must hold exactly the same sample ids: a missing row means a stage skipped a
    sample, which would silently bias the update if it were dropped here.
    """
    if not tables:
        raise BatchError("join() needs at least one table")
    order = sorted(tables, key=lambda g: g != "rollout")  # stable: rollout first, others as given
    base_name = order[0]
    base = tables[base_name]
    _require_sample_id(base_name, base)
    base_ids = base.column("sample_id").combine_chunks()
    result = base
    for group in order[1:]:
        other = tables[group]
        _require_sample_id(group, other)
        result = _append_group(result, base_name, base_ids, group, other)
    check_token_lengths(result, source=f"join({', '.join(order)})")
    return result


def _require_sample_id(group: str, table: pa.Table) -> None:
    if "sample_id" not in table.column_names:
        raise BatchError(f"join: the {group!r} table has no 'sample_id' column (it has "
                         f"{table.column_names})", source=f"join:{group}", column="sample_id")


def _append_group(result: pa.Table, base_name: str, base_ids: pa.Array, group: str,
                  other: pa.Table) -> pa.Table:
    other_ids = other.column("sample_id").combine_chunks()
    if pc.count_distinct(other_ids).as_py() != len(other_ids):
        raise BatchError(f"join: the {group!r} table repeats sample ids", source=f"join:{group}",
                         column="sample_id")
    positions = pc.index_in(base_ids, value_set=other_ids)
    missing = positions.null_count
    if missing:
        first = base_ids.filter(pc.is_null(positions))[0].as_py()
        raise BatchError(f"join: {missing} sample id(s) of {base_name!r} are missing from {group!r} "
                         f"(first: {first!r})", source=f"join:{group}", column="sample_id")
    extra = len(other_ids) - len(base_ids)
    if extra:
        unknown = other_ids.filter(pc.invert(pc.is_in(other_ids, value_set=base_ids)))[0].as_py()
        raise BatchError(f"join: {extra} sample id(s) of {group!r} are missing from {base_name!r} "
                         f"(first: {unknown!r})", source=f"join:{base_name}", column="sample_id")
    aligned = other.take(positions)
    for name in aligned.column_names:
        if name == "sample_id":
            continue
        if name in result.column_names:
            raise BatchError(f"join: column {name!r} of {group!r} is already provided by another group",
                             source=f"join:{group}", column=name)
        result = result.append_column(aligned.schema.field(name), aligned.column(name))
    return result


# ---------------------------------------------------------------------------------------------
# torch


def to_torch_padded(table: pa.Table, column: str, pad_value: float | int = 0,
                    dtype: "torch.dtype | None" = None, side: str = "right") -> "torch.Tensor":
    """A ``(rows, max_len)`` tensor from a list column, padded on the right (or, with
    ``side="left"``, on the left, as generation wants its prompts).

    Integer lists default to ``torch.long`` (what embedding lookups and ``gather`` want),
    float lists to ``torch.float32``.
    """
    import torch

    flat, lengths = list_column_values(table, column, "to_torch_padded")
    if dtype is None:
        dtype = torch.long if np.issubdtype(flat.dtype, np.integer) else torch.float32
    rows, width = len(lengths), int(lengths.max()) if len(lengths) else 0
    out = torch.full((rows, width), pad_value, dtype=dtype)
    scatter_rows(out, flat, lengths, (width - lengths) if side == "left" else 0)
    return out


def list_column_values(table: pa.Table, column: str, caller: str) -> tuple[np.ndarray, np.ndarray]:
    """(the values of every row one after another, each row's length) of a list column; a missing
    column, another type or a null row is a ``BatchError`` naming ``caller`` and the column."""
    if column not in table.column_names:
        raise BatchError(f"{caller}: no column {column!r} (columns: {table.column_names})", column=column)
    array = table.column(column).combine_chunks()
    if not pa.types.is_list(array.type) and not pa.types.is_large_list(array.type):
        raise BatchError(f"{caller}: column {column!r} has type {array.type}, expected a list", column=column)
    if array.null_count:
        raise BatchError(f"{caller}: column {column!r} has {array.null_count} null row(s)", column=column)
    lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = array.flatten().to_numpy(zero_copy_only=False)
    if not flat.flags.writeable:  # arrow buffers are read-only; torch warns on those
        flat = flat.copy()
    return flat, lengths


def scatter_rows(out: "torch.Tensor", flat: np.ndarray, lengths: np.ndarray, first_column=0) -> None:
    """Writes row i's ``lengths[i]`` values (consecutive in ``flat``) into ``out[i]`` from column
    ``first_column`` (a number, or one per row) on, in one indexed assignment."""
    import torch

    if not flat.size:
        return
    rows = len(lengths)
    starts = np.cumsum(lengths) - lengths
    row_index = np.repeat(np.arange(rows), lengths)
    col_index = np.arange(flat.size) - np.repeat(starts, lengths)
    col_index += np.repeat(np.broadcast_to(np.asarray(first_column, dtype=np.int64), (rows,)), lengths)
    out[torch.from_numpy(row_index), torch.from_numpy(col_index)] = torch.from_numpy(flat).to(out.dtype)


__all__ = [
    "GROUPS", "PER_TOKEN_COLUMNS", "OPTIONAL_COLUMNS", "FINISH_REASONS", "BatchError", "make_table", "validate",
    "write_group", "read_group", "join", "to_torch_padded", "list_column_values", "scatter_rows", "check_token_lengths",
    "table_from_parquet_bytes",
]
