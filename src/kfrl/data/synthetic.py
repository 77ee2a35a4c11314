"""A synthetic arithmetic task in veRL's RL-dataset row schema.

The task ("What is 37 + 58?" -> "... #### 95") is small enough that a tiny
random-init model learns part of it in a short CPU warm start, which leaves
room for RL to raise the reward. Rows follow veRL's
``examples/data_preprocess/gsm8k.py`` layout, so the same reward rule
(the last ``#### <number>`` must equal ``reward_model.ground_truth``) applies.
"""
from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

DATA_SOURCE = "kfrl/arith"
ABILITY = "math"
SPLITS = ("train", "test")

# Operands are drawn from 0..99: a mix of 1- and 2-digit numbers. That keeps
# responses short (<= 16 tokens) yet hard enough that a few seconds of SFT
# do not saturate accuracy.
MAX_OPERAND = 99

# One in TEST_FRACTION_DENOMINATOR operand pairs belongs to the test split.
# The split is a fixed function of the pair (not of the seed), so train and
# test questions never overlap, whatever seeds the two splits are drawn with.
TEST_FRACTION_DENOMINATOR = 10


@dataclass(frozen=True)
class ArithProblem:
    """One addition problem; everything else (text, answer) derives from it."""

    a: int
    b: int
    op: str = "+"

    @property
    def result(self) -> int:
        if self.op == "+":
            return self.a + self.b
        raise ValueError(f"unsupported operator {self.op!r}")

    @property
    def question(self) -> str:
        return f"What is {self.a} {self.op} {self.b}?"


def split_of_pair(a: int, b: int) -> str:
    """Which split the operand pair (a, b) belongs to: a fixed hash, no RNG."""
    # Multiplicative mixing so that the test pairs are spread over the grid
    # rather than forming a band of neighbouring operands.
    mixed = (a * 7919 + b * 104729 + a * b * 31) % 1009
    return "test" if mixed % TEST_FRACTION_DENOMINATOR == 0 else "train"


def _pairs_of_split(split: str) -> list[tuple[int, int]]:
    return [
        (a, b)
        for a in range(MAX_OPERAND + 1)
        for b in range(MAX_OPERAND + 1)
        if split_of_pair(a, b) == split
    ]


def sample_problems(n: int, seed: int, split: str) -> list[ArithProblem]:
    """n problems of `split`, drawn with replacement, deterministic in seed."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    # Mix the split into the seed so train and test draws with the same seed
    # are not correlated.
    rng = random.Random(f"{seed}:{split}")
    pairs = _pairs_of_split(split)
    return [ArithProblem(*rng.choice(pairs)) for _ in range(n)]


def _as_problem(question_fields: ArithProblem | Mapping) -> ArithProblem:
    if isinstance(question_fields, ArithProblem):
        return question_fields
    return ArithProblem(
        int(question_fields["a"]), int(question_fields["b"]), question_fields.get("op", "+")
    )


def reference_solution(question_fields: ArithProblem | Mapping) -> str:
    """The worked answer used as the SFT target, e.g. '37+58=95\\n#### 95'.

    Restating the sum gives the model a few tokens to "look at" the operands
    next to each other before committing to the final line; the final line is
    what veRL's gsm8k strict rule reads. No spaces in the restatement: that
    keeps the longest response (99+99) at 16 tokens with the eos.
    """
    problem = _as_problem(question_fields)
    return f"{problem.a}{problem.op}{problem.b}={problem.result}\n#### {problem.result}"


def problem_to_row(problem: ArithProblem, split: str, index: int) -> dict:
    """One row in veRL's RL-dataset schema (see verl-semantics.md §3)."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem.question}],
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": str(problem.result)},
        "extra_info": {
            "split": split,
            "index": index,
            "answer": reference_solution(problem),
            "question": problem.question,
        },
    }


def make_arith_rows(n: int, seed: int, split: str) -> list[dict]:
    """n rows of the arithmetic task for `split`, deterministic given seed."""
    return [
        problem_to_row(problem, split, index)
        for index, problem in enumerate(sample_problems(n, seed, split))
    ]


# --- the tool task: 3-digit sums, which a tiny model cannot do in its head but a calculator can ------

TOOL_OPERANDS = (100, 999)


def sample_tool_problems(n: int, seed: int, split: str) -> list[ArithProblem]:
    """n 3-digit addition problems of `split` (the same fixed pair hash decides the split)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    rng = random.Random(f"tools:{seed}:{split}")
    problems: list[ArithProblem] = []
    while len(problems) < n:
        a, b = rng.randint(*TOOL_OPERANDS), rng.randint(*TOOL_OPERANDS)
        if split_of_pair(a, b) == split:
            problems.append(ArithProblem(a, b))
    return problems


def make_tool_rows(n: int, seed: int, split: str) -> list[dict]:
    """Rows of the tool task in veRL's multi-turn schema: ``agent_name`` picks veRL's tool agent; the
    calculator is stateless, so no ``extra_info.tools_kwargs`` are needed."""
    rows = []
    for index, problem in enumerate(sample_tool_problems(n, seed, split)):
        row = problem_to_row(problem, split, index)
        row["agent_name"] = "tool_agent"
        rows.append(row)
    return rows
