"""GSM8K rule reward, with veRL v0.7.1's exact rules (`verl/utils/reward_score/gsm8k.py`).

The answer is read from the last 300 characters of the response only (so a long response that
states its answer early scores 0), then compared with the ground truth as a *string*.

- strict: the last "#### <number>" (GSM8K's own answer format); "," and "$" are removed from it.
- flexible: the last number-like run of digits, dots and commas anywhere (commas kept, a trailing
  "." kept: "72." != "72").
"""
from __future__ import annotations

import re

# Only the tail of the response is searched: answers come last, and a bounded search keeps
# regex cost independent of the response length.
SOLUTION_CLIP_CHARS = 300

# "#### " then an optional minus and a run of digits, dots and commas. A "$" right after "#### "
# therefore does not match at all ("#### $72" has no strict answer).
_STRICT_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER_LIKE = re.compile(r"(\-?[0-9\.\,]+)")
# Matches the flexible rule must skip; the regex cannot produce "" but veRL lists it.
_NOT_A_NUMBER = ("", ".")

METHODS = ("strict", "flexible")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The answer string found in the response, or None when there is none."""
    if method not in METHODS:
        raise ValueError(f"Unknown gsm8k extraction method {method!r}; valid: {', '.join(METHODS)}")
    tail = solution_str[-SOLUTION_CLIP_CHARS:]

    if method == "strict":
        answers = _STRICT_ANSWER.findall(tail)
        if not answers:
            return None
        return answers[-1].replace(",", "").replace("$", "")

    candidates = _NUMBER_LIKE.findall(tail)
    if not candidates:
        return None
    for candidate in reversed(candidates):
        if candidate not in _NOT_A_NUMBER:
            return candidate
    # veRL's loop leaves its variable at the first match when every match is "."; so do we.
    return candidates[0]


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float | int:
    """`score` if the extracted answer equals `ground_truth` (exact string compare), `format_score`
    if an answer was found but differs, and 0 (the int, as veRL returns) if none was found."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0
    return score if answer == ground_truth else format_score
