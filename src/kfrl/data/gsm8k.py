"""GSM8K in veRL's RL-dataset schema, from local copies of the data.

veRL trains on GSM8K through Parquet files written by its ``examples/data_preprocess/gsm8k.py``
(v0.7.1). This module writes the same rows, column for column and value for value, so a veRL
config (``data.train_files=.../train.parquet``) and kfrl's own loader read identical data, and
rewards keyed by ``data_source == "openai/gsm8k"`` apply unchanged (see verl-semantics.md §3).

It reads only local files (no dataset hub): the HF ``openai/gsm8k`` repo layout
(``main/train-00000-of-00001.parquet``), a directory of ``train``/``test`` Parquet files, the
original ``train.jsonl``/``test.jsonl`` of the GSM8K release, or one such file for one split.

Columns of the input other than ``question`` and ``answer`` are dropped (GSM8K has no others).
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "openai/gsm8k"
ABILITY = "math"
CONFIG = "main"
SPLITS = ("train", "test")

# Appended to each question (after one space), word for word as veRL does: the reward rule reads
# the number after the last "####", so the prompt has to ask for that format.
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

# veRL's pattern: the first "#### " followed by an optional minus and digits, dots and commas.
_FINAL_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")

ACCEPTED_LAYOUTS = (
    "a directory in the HF openai/gsm8k layout (<dir>/main/train-*.parquet, <dir>/main/test-*.parquet, "
    "or that 'main' directory itself); a directory with train.parquet/test.parquet; a directory with the "
    "original GSM8K train.jsonl/test.jsonl; or one .parquet/.jsonl file holding one split "
    "(named by the split argument or by 'train'/'test' in its file name)"
)

# The written schema, spelled out so that an empty split or a pyarrow upgrade cannot change
# types or field order (veRL's files: plain strings, int64 index, struct fields in this order).
_MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(_MESSAGE)),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([
        ("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()), ("question", pa.string()),
    ])),
])

# The multi-turn variant (veRL's examples/data_preprocess/gsm8k_multiturn_w_tool.py layout): a system turn
# asking for the answer checker, the checker's per-sample state in extra_info.tools_kwargs, veRL's tool agent.
TOOL_NAME = "calc_gsm8k_reward"
TOOL_SYSTEM_PROMPT = ("Solve the math problem step by step. Before your final answer, submit it at least once "
                      f"with the `{TOOL_NAME}` tool, and revise it if the tool says it is wrong. End with the "
                      "final answer as `#### <answer>`.")
_TOOLS_KWARGS = pa.struct([(TOOL_NAME, pa.struct([("create_kwargs", pa.struct([("ground_truth", pa.string())]))]))])
TOOL_SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("agent_name", pa.string()),
    ("prompt", pa.list_(_MESSAGE)),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([
        ("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()), ("question", pa.string()),
        ("need_tools_kwargs", pa.bool_()), ("tools_kwargs", _TOOLS_KWARGS),
    ])),
])


class GSM8KError(ValueError):
    """Input a user can fix: the message names the file (and row) and what was expected."""


@dataclass(frozen=True)
class PrepResult:
    """Where one split was written and how many rows it has."""

    path: Path
    rows: int


@dataclass(frozen=True)
class _Example:
    """One input row, with where it came from so errors can point at it."""

    question: str
    answer: str
    file: Path
    row: int  # 0-based row index within ``file``


# ---------------------------------------------------------------------------------------------
# pure helpers: one row


def extract_ground_truth(answer: str) -> str | None:
    """The final answer of a GSM8K solution, commas removed ("#### 1,080" -> "1080").

    Matches veRL's rule exactly: the *first* "#### <number>" wins, and a trailing dot is kept
    (it is part of the character class). None when there is no such line; veRL asserts there.
    """
    match = _FINAL_ANSWER.search(answer)
    return None if match is None else match.group(1).replace(",", "")


def make_row(question: str, answer: str, split: str, index: int) -> dict:
    """One output row in veRL's schema; raises GSM8KError if ``answer`` has no "#### <number>"."""
    ground_truth = extract_ground_truth(answer)
    if ground_truth is None:
        raise GSM8KError(f"answer has no final '#### <number>' line: {answer[-80:]!r}")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


# ---------------------------------------------------------------------------------------------
# finding the input files


def _split_files_in(directory: Path, split: str) -> list[Path]:
    """The files of ``split`` in ``directory``, for whichever single layout is present there.

    Two layouts for one split (say both train.parquet and train.jsonl) is an error rather than a
    silent pick, since they could hold different data.
    """
    candidates = [
        sorted((directory / CONFIG).glob(f"{split}-*.parquet")),
        sorted(directory.glob(f"{split}-*.parquet")),
        [p for p in (directory / f"{split}.parquet",) if p.is_file()],
        [p for p in (directory / f"{split}.jsonl",) if p.is_file()],
    ]
    found = [files for files in candidates if files]
    if not found:
        raise GSM8KError(f"no '{split}' split in {directory}: expected {ACCEPTED_LAYOUTS}")
    if len(found) > 1:
        names = ", ".join(str(files[0]) for files in found)
        raise GSM8KError(f"{directory} holds the '{split}' split in more than one layout ({names}); "
                         "pass the one to use as a file (with its split)")
    return found[0]


def _split_of_file(path: Path, split: str | None) -> str:
    """The split a single input file holds: the explicit argument, else its file name."""
    if split is not None:
        return split
    named = [s for s in SPLITS if s in path.name.lower()]
    if len(named) != 1:
        raise GSM8KError(f"cannot tell the split of {path} from its name; pass split='train' or split='test'")
    return named[0]


def resolve_input(input_path: str | os.PathLike, splits: Sequence[str] = SPLITS,
                  split: str | None = None) -> dict[str, list[Path]]:
    """Input files by split: each split in ``splits`` (or just ``split``) for a directory; one
    split for a file, named by ``split`` or by the file name."""
    path = Path(input_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"GSM8K input not found: {path}; expected {ACCEPTED_LAYOUTS}")
    if path.is_file():
        if path.suffix not in (".parquet", ".jsonl"):
            raise GSM8KError(f"{path}: unsupported file type {path.suffix!r}; expected {ACCEPTED_LAYOUTS}")
        return {_split_of_file(path, split): [path]}
    return {s: _split_files_in(path, s) for s in ((split,) if split else splits)}


# ---------------------------------------------------------------------------------------------
# reading rows


def _checked_text(value, field: str, file: Path, row: int) -> str:
    """A question/answer cell as a string; nulls and non-strings name their file and row."""
    if not isinstance(value, str):
        raise GSM8KError(f"{file}: row {row}: '{field}' must be a string, got {type(value).__name__}")
    return value


def _read_jsonl(file: Path) -> Iterator[_Example]:
    """Rows of a JSON-lines file (blank lines skipped; the row index counts only rows)."""
    row = 0
    with open(file, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise GSM8KError(f"{file}: line {line_no} is not valid JSON ({err})") from err
            if not isinstance(record, dict) or not {"question", "answer"} <= record.keys():
                raise GSM8KError(f"{file}: line {line_no} (row {row}) needs an object with "
                                 "'question' and 'answer'")
            yield _Example(_checked_text(record["question"], "question", file, row),
                           _checked_text(record["answer"], "answer", file, row), file, row)
            row += 1


def _read_parquet(file: Path) -> Iterator[_Example]:
    """Rows of a Parquet file with ``question`` and ``answer`` columns."""
    try:
        columns = pq.read_schema(file).names
    except (pa.ArrowException, OSError) as err:
        raise GSM8KError(f"{file}: not a readable Parquet file ({err})") from err
    missing = [c for c in ("question", "answer") if c not in columns]
    if missing:
        raise GSM8KError(f"{file}: missing column(s) {missing}; found {columns} "
                         "(expected the raw GSM8K columns 'question' and 'answer')")
    table = pq.read_table(file, columns=["question", "answer"])
    questions, answers = table.column("question").to_pylist(), table.column("answer").to_pylist()
    for row, (question, answer) in enumerate(zip(questions, answers)):
        yield _Example(_checked_text(question, "question", file, row),
                       _checked_text(answer, "answer", file, row), file, row)


def read_examples(files: Iterable[Path]) -> Iterator[_Example]:
    """Rows of a split's files, in file order then row order (shards are pre-sorted by name)."""
    for file in files:
        yield from (_read_jsonl(file) if file.suffix == ".jsonl" else _read_parquet(file))


def make_tool_row(question: str, answer: str, split: str, index: int) -> dict:
    """One row of the multi-turn tool task: ``make_row``'s, plus a system turn, veRL's ``agent_name``
    and the answer checker's ``create_kwargs`` (the ground truth it scores submissions against)."""
    row = make_row(question, answer, split, index)
    ground_truth = row["reward_model"]["ground_truth"]
    return {**row, "agent_name": "tool_agent",
            "prompt": [{"role": "system", "content": TOOL_SYSTEM_PROMPT}, *row["prompt"]],
            "extra_info": {**row["extra_info"], "need_tools_kwargs": True,
                           "tools_kwargs": {TOOL_NAME: {"create_kwargs": {"ground_truth": ground_truth}}}}}


def build_rows(examples: Iterable[_Example], split: str, *, tools: bool = False) -> list[dict]:
    """Output rows in input order; ``index`` counts rows across all files of the split."""
    rows = []
    for index, example in enumerate(examples):
        try:
            rows.append((make_tool_row if tools else make_row)(example.question, example.answer, split, index))
        except GSM8KError as err:
            raise GSM8KError(f"{example.file}: row {example.row}: {err}") from None
    return rows


# ---------------------------------------------------------------------------------------------
# writing


def _write_parquet_atomic(table: pa.Table, path: Path) -> None:
    """Write next to ``path`` then rename, so a reader or a crash never sees a partial file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def prepare_gsm8k(input_path: str | os.PathLike, output_dir: str | os.PathLike, *,
                  splits: Sequence[str] = SPLITS, split: str | None = None, tools: bool = False) -> dict[str, PrepResult]:
    """Write ``<output_dir>/<split>.parquet`` for each split, exactly as veRL's gsm8k.py would (with
    ``tools``: the multi-turn rows of veRL's gsm8k_multiturn_w_tool.py, for configs/tools/gsm8k_tool_config.yaml).

    A directory input must hold every split in ``splits`` (``split``, when given, narrows that to
    one); a single-file input yields one split, named by ``split`` or by the file name. All splits are read and checked before any file is
    written, so a bad row leaves the output directory as it was. Re-running rewrites the same bytes.
    """
    files_by_split = resolve_input(input_path, splits, split)
    tables = {name: pa.Table.from_pylist(build_rows(read_examples(files), name, tools=tools),
                                         schema=TOOL_SCHEMA if tools else SCHEMA)
              for name, files in files_by_split.items()}
    out = Path(output_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, table in tables.items():
        path = out / f"{name}.parquet"
        _write_parquet_atomic(table, path)
        results[name] = PrepResult(path=path, rows=table.num_rows)
    return results
