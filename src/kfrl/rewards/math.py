r"""MATH boxed-answer reward, with veRL v0.7.1's rules (`verl/utils/reward_score/math_reward.py`,
itself the Hendrycks-MATH normalisation of lm-evaluation-harness).

`compute_score(solution_str, ground_truth)` is 1.0 when the answer in the response's last box,
box removed, equals the ground truth after both are normalised by `strip_string`; else 0.0.
Everything is string rewriting, no symbolic maths: "2/4" is not "1/2", "0.50" is not "0.5".

veRL's quirks, kept on purpose (each has a test):
- A `\boxed ` (with a space) anywhere in the response takes precedence over every `\boxed{...}`:
  the answer is the text after the *last* "\boxed " up to the next "$" (or the end).
- `\fbox{...}` is found when the response has no `\boxed` at all, but veRL's box removal
  only accepts `\boxed{`/`\boxed `, so an `\fbox` answer always scores 0.0.
- Only `\%` is removed, not a bare "%" ("10%" != "10"); only `\$`, not a bare "$"; only
  `\text{ ...}` with a space after the brace is treated as units.
- When normalisation fails on either string (e.g. a trailing `\sqrt` or `\frac`, two
  `\text{ ` units), the raw strings are compared instead.

Differences from veRL: none in the scores; the helpers raise `ValueError` where veRL's assert
raises `AssertionError`, and nothing is printed when a response cannot be scored.
"""
from __future__ import annotations

BOXED = "\\boxed"
BOXED_SPACE = "\\boxed "
BOXED_BRACE = "\\boxed{"
FBOX = "\\fbox"
TEXT_UNITS = "\\text{ "

# Plain substring rewrites applied first, in this order (the order matters: "\\" is folded
# before "\!"-style commands are looked at again, "dfrac" before fractions are fixed, ...).
_REWRITES_BEFORE_UNITS = (
    ("\n", ""),          # line breaks
    ("\\!", ""),         # negative thin spaces
    ("\\\\", "\\"),      # doubled backslashes
    ("tfrac", "frac"),
    ("dfrac", "frac"),
    ("\\left", ""),
    ("\\right", ""),
    ("^{\\circ}", ""),   # degrees
    ("^\\circ", ""),
    ("\\$", ""),         # escaped dollars only
)
_REWRITES_AFTER_UNITS = (
    ("\\\\%", ""),       # percent signs, escaped only (a bare "%" stays)
    ("\\%", ""),
    (" .", " 0."),       # ".5" -> "0.5" after a space or an opening brace
    ("{.", "{0."),
)


class MathNormalizationError(ValueError):
    """A string veRL's normaliser cannot rewrite; `is_equiv` then compares the raw strings."""


def last_boxed_only_string(string: str) -> str | None:
    r"""The last box of `string`, box command included (`\boxed{...}`, `\fbox{...}` or
    `\boxed ...`), or None when there is none or its braces never close."""
    if BOXED_SPACE in string:
        after = string.rsplit(BOXED_SPACE, 1)[1]
        return BOXED_SPACE + after.split("$", 1)[0]

    start = string.rfind(BOXED)
    if start < 0:
        start = string.rfind(FBOX)
        if start < 0:
            return None

    # From the command on, the first "}" that brings the brace depth back to zero closes it.
    depth = 0
    for position in range(start, len(string)):
        char = string[position]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return string[start:position + 1]
    return None


def remove_boxed(s: str) -> str:
    r"""The content of a box returned by `last_boxed_only_string`: `\boxed{x}` -> "x",
    `\boxed x` -> "x". Anything else (an `\fbox{...}` included, as in veRL) raises ValueError."""
    if BOXED_SPACE in s:
        if not s.startswith(BOXED_SPACE):
            raise ValueError(f"expected a string starting with {BOXED_SPACE!r}, got {s[:40]!r}")
        return s[len(BOXED_SPACE):]
    if not (s.startswith(BOXED_BRACE) and s.endswith("}")):
        raise ValueError(f"expected a string of the form '\\boxed{{...}}', got {s[:40]!r}")
    return s[len(BOXED_BRACE):-1]


def _remove_right_units(string: str) -> str:
    r"""Drop a trailing `\text{ unit}` (everything from it on); two of them cannot be handled."""
    if TEXT_UNITS not in string:
        return string
    parts = string.split(TEXT_UNITS)
    if len(parts) != 2:
        raise MathNormalizationError(f"more than one {TEXT_UNITS!r} in {string!r}")
    return parts[0]


def _brace_arguments(string: str, macro: str, brace_piece) -> str:
    """Rewrites what follows each unbraced ``macro``: ``brace_piece(piece)`` gives the braced text
    (None: leave the whole string unchanged); an empty piece is an error, a braced one is kept."""
    head, *pieces = string.split(macro)
    out = [head]
    for piece in pieces:
        if not piece:
            raise MathNormalizationError(f"'{macro}' without an argument in {string!r}")
        fixed = piece if piece.startswith("{") else brace_piece(piece)
        if fixed is None:
            return string
        out.append(macro + fixed)
    return "".join(out)


def _fix_sqrt(string: str) -> str:
    r"""`\sqrt3` -> `\sqrt{3}` (one character becomes the argument)."""
    return _brace_arguments(string, "\\sqrt", lambda piece: "{" + piece[0] + "}" + piece[1:])


def _braced_fraction(piece: str) -> str | None:
    if len(piece) < 2:
        return None
    if piece[1] == "{":  # \frac1{72}: only the numerator needs braces
        return "{" + piece[0] + "}" + piece[1:]
    return "{" + piece[0] + "}{" + piece[1] + "}" + piece[2:]


def _fix_fracs(string: str) -> str:
    r"""`\frac12` -> `\frac{1}{2}`, `\frac1{72}` -> `\frac{1}{72}`: the first one or two
    characters after an unbraced `\frac` become its braced arguments. A `\frac` followed by a
    single character leaves the whole string unchanged."""
    return _brace_arguments(string, "\\frac", _braced_fraction)


def _fix_a_slash_b(string: str) -> str:
    r"""`3/4` -> `\frac{3}{4}` when the string is exactly two integers in canonical form
    (no sign other than a leading "-", no leading zeros) around one "/"."""
    parts = string.split("/")
    if len(parts) != 2:
        return string
    try:
        numerator, denominator = int(parts[0]), int(parts[1])
    except ValueError:
        return string
    if string != f"{numerator}/{denominator}":
        return string
    return "\\frac{" + str(numerator) + "}{" + str(denominator) + "}"


def strip_string(string: str) -> str:
    """veRL's (Hendrycks') normal form of a MATH answer. Raises `MathNormalizationError` (or,
    for a non-string, AttributeError) where veRL's normaliser fails."""
    for old, new in _REWRITES_BEFORE_UNITS:
        string = string.replace(old, new)
    string = _remove_right_units(string)
    for old, new in _REWRITES_AFTER_UNITS:
        string = string.replace(old, new)
    if not string:
        return string
    if string.startswith("."):
        string = "0" + string

    # "k = 5" / "x=5" -> "5": a single '=' with at most two characters (spaces count) before it.
    sides = string.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        string = sides[1]

    if "\\sqrt" in string:
        string = _fix_sqrt(string)
    string = string.replace(" ", "")
    string = _fix_fracs(string)
    if string == "0.5":
        string = "\\frac{1}{2}"
    return _fix_a_slash_b(string)


def is_equiv(str1: str | None, str2: str | None) -> bool:
    """Equal after `strip_string`; the raw strings are compared when either cannot be
    normalised. Two Nones are equivalent, one None is not."""
    if str1 is None or str2 is None:
        return str1 is None and str2 is None
    try:
        return strip_string(str1) == strip_string(str2)
    except Exception:  # noqa: BLE001 - veRL falls back on any failure of the normaliser
        return str1 == str2


def compute_score(solution_str: str, ground_truth: str) -> float:
    r"""1.0 if the response's last box (see `last_boxed_only_string`) holds an answer
    equivalent to `ground_truth`, else 0.0 (also when there is no box or it cannot be read)."""
    try:
        boxed = last_boxed_only_string(solution_str)
        if boxed is None:
            return 0.0
        return 1.0 if is_equiv(remove_boxed(boxed), ground_truth) else 0.0
    except Exception:  # noqa: BLE001 - veRL scores any unreadable response 0.0
        return 0.0
