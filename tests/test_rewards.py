"""kfrl.rewards: veRL's GSM8K and MATH rules (including their observed outputs) and the data_source registry."""
from __future__ import annotations

import textwrap

import pytest

from kfrl import rewards
from kfrl.rewards import UnknownDataSourceError, compute_score, get_scorer, load_custom_reward, register
from kfrl.rewards import registry as registry_module
from kfrl.rewards.gsm8k import SOLUTION_CLIP_CHARS, extract_solution
from kfrl.rewards.gsm8k import compute_score as gsm8k_score
from kfrl.rewards.math import MathNormalizationError, is_equiv, last_boxed_only_string, remove_boxed, strip_string
from kfrl.rewards.math import compute_score as math_score


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch):
    """Registrations made by a test disappear after it."""
    monkeypatch.setattr(registry_module, "_SCORERS", dict(registry_module._SCORERS))


# ---------------------------------------------------------------------------------------------
# gsm8k: veRL's observed outputs (verl-semantics.md §2)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("response, strict, flexible", [
    ("#### 72", 1.0, 1.0),
    ("The answer is 72.", 0, 0.0),  # strict: no "####" -> 0 (int); flexible extracts "72."
    ("#### 72 then 73", 1.0, 0.0),  # flexible takes the last number, 73
    ("#### $72", 0, 1.0),  # the strict regex needs a digit right after "#### "
])
def test_observed_scores(response, strict, flexible):
    got_strict = gsm8k_score(response, "72")
    got_flexible = gsm8k_score(response, "72", method="flexible")
    assert got_strict == strict and type(got_strict) is type(strict)
    assert got_flexible == flexible and type(got_flexible) is type(flexible)


def test_observed_extractions():
    assert extract_solution("The answer is 72.", "flexible") == "72."
    assert extract_solution("The answer is 72.", "strict") is None
    assert extract_solution("#### 1,234") == "1234"
    assert gsm8k_score("#### 1,234", "72") == 0.0
    assert extract_solution("#### $72", "flexible") == "72"


def test_commas_and_dollars():
    assert gsm8k_score("#### 1,234", "1234") == 1.0
    assert extract_solution("costs $1,234 in total", "flexible") == "1,234"  # flexible keeps commas
    assert gsm8k_score("costs $1,234", "1234", method="flexible") == 0.0


def test_negatives_and_decimals():
    assert extract_solution("#### -5") == "-5"
    assert gsm8k_score("so #### -5", "-5") == 1.0
    assert extract_solution("the change is -5", "flexible") == "-5"
    assert extract_solution("#### 3.50") == "3.50"
    assert gsm8k_score("#### 3.50", "3.5") == 0.0  # exact string compare, no numeric equivalence
    assert gsm8k_score("#### 3.50", "3.50") == 1.0


def test_last_of_several_answers_counts():
    assert extract_solution("#### 1\nno wait\n#### 2") == "2"
    assert gsm8k_score("#### 72\n#### 73", "72") == 0.0


def test_only_the_last_300_characters_are_searched():
    assert SOLUTION_CLIP_CHARS == 300
    inside = "#### 72" + "a" * (300 - len("#### 72"))  # exactly 300 characters
    assert gsm8k_score(inside, "72") == 1.0
    assert gsm8k_score("x" * 1000 + inside, "72") == 1.0
    just_outside = "#### 72" + "a" * (301 - len("#### 72"))  # the first "#" falls off
    assert extract_solution(just_outside) is None
    assert gsm8k_score(just_outside, "72") == 0
    # flexible too: 72 is out of reach, only lone dots remain (veRL's "." quirk, see below)
    assert extract_solution("the answer is 72" + " ." * 200, "flexible") == "."


def test_flexible_quirks_kept_from_verl():
    # Every number-like match is ".": veRL's loop variable ends on the first match, ".".
    assert extract_solution("well . then .", "flexible") == "."
    assert extract_solution("no digits at all", "flexible") is None
    assert extract_solution("Hello, world", "flexible") == ","  # a lone comma counts as a match


def test_format_score_and_score():
    assert gsm8k_score("#### 5", "6", format_score=0.1) == 0.1
    assert gsm8k_score("#### 6", "6", score=2.0) == 2.0
    assert gsm8k_score("no answer", "6", format_score=0.1) == 0  # no answer: 0, not format_score


def test_unknown_method():
    with pytest.raises(ValueError, match="loose"):
        extract_solution("#### 1", method="loose")


def test_dollar_after_the_number_and_trailing_dot():
    # "$" after the digits is outside the match: both rules read 72.
    assert extract_solution("#### 72$") == "72"
    assert gsm8k_score("#### 72$", "72") == 1.0
    assert gsm8k_score("#### 72$", "72", method="flexible") == 1.0
    assert gsm8k_score("#### $1,234", "1234") == 0  # strict: nothing after "#### " starts with a digit
    # The strict match runs over dots too: a sentence-ending "." stays on the answer.
    assert extract_solution("#### 72.") == "72."
    assert gsm8k_score("The answer is #### 72.", "72") == 0.0
    assert gsm8k_score("The answer is #### 72.", "72", method="flexible") == 0.0


def test_flexible_commas_negatives_decimals():
    assert gsm8k_score("#### 1,234", "1234", method="flexible") == 0.0  # "1,234": commas are kept
    assert gsm8k_score("#### 1,234", "1,234", method="flexible") == 1.0
    assert gsm8k_score("it drops to -5", "-5", method="flexible") == 1.0
    assert gsm8k_score("#### -5", "5") == 0.0  # the sign is part of the answer
    assert gsm8k_score("#### 3.50", "3.5", method="flexible") == 0.0
    assert extract_solution("first 12, then 3.5 and finally 8", "flexible") == "8"
    assert extract_solution("#### 7 + 1 = 8.", "flexible") == "8."


def test_last_of_several_answers_counts_in_both_modes():
    response = "#### 10\nHmm, recheck.\n#### 12"
    assert gsm8k_score(response, "12") == 1.0
    assert gsm8k_score(response, "10") == 0.0
    assert gsm8k_score(response, "12", method="flexible") == 1.0


def test_clip_applies_before_extraction_in_both_modes():
    long_tail = "#### 72\n" + "words " * 60  # 360 characters after the answer: out of reach
    assert len(long_tail) > SOLUTION_CLIP_CHARS
    assert gsm8k_score(long_tail, "72") == 0
    assert gsm8k_score(long_tail, "72", method="flexible") == 0
    # a later number inside the window wins over the clipped one in flexible mode
    assert gsm8k_score("#### 72 " + "x" * 400 + " 73", "73", method="flexible") == 1.0


def test_format_and_score_args_in_flexible_mode():
    assert gsm8k_score("maybe 5", "6", method="flexible", format_score=0.1) == 0.1
    assert gsm8k_score("maybe 6", "6", method="flexible", score=3.0) == 3.0
    assert gsm8k_score("no digits", "6", method="flexible", format_score=0.1) == 0  # None -> 0
    assert gsm8k_score("#### 6", "6", format_score=0.5, score=0.5) == 0.5


# ---------------------------------------------------------------------------------------------
# MATH: veRL's math_reward (last box, Hendrycks string normalisation)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("response, boxed", [
    (r"so the answer is $\boxed{\frac{1}{2}}$.", r"\boxed{\frac{1}{2}}"),
    (r"\boxed{\sqrt{\frac{1}{\{2\}}}} done", r"\boxed{\sqrt{\frac{1}{\{2\}}}}"),  # nested braces
    (r"\boxed{1} no wait, \boxed{2}", r"\boxed{2}"),  # several boxes: the last
    (r"\fbox{3}", r"\fbox{3}"),
    (r"\fbox{3} then \boxed{4}", r"\boxed{4}"),
    (r"\boxed{4} then \fbox{3}", r"\boxed{4}"),  # any \boxed beats \fbox, even an earlier one
    (r"The answer is \boxed 5", r"\boxed 5"),
    (r"The answer is $\boxed 5$.", r"\boxed 5"),  # the space form ends at the next "$"
    (r"\boxed 1 no, \boxed{2}", r"\boxed 1 no, \boxed{2}"),  # the space form wins over braces
    (r"\boxed{5", None),  # never closed
    ("The answer is 5.", None),
    ("", None),
])
def test_last_boxed_only_string(response, boxed):
    assert last_boxed_only_string(response) == boxed


def test_remove_boxed():
    assert remove_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert remove_boxed(r"\boxed 5") == "5"
    assert remove_boxed(r"\boxed{}") == ""
    with pytest.raises(ValueError):
        remove_boxed(r"\fbox{3}")  # veRL only strips \boxed (it asserts)
    with pytest.raises(ValueError):
        remove_boxed("5")


@pytest.mark.parametrize("raw, normal", [
    (r"\dfrac12", r"\frac{1}{2}"),
    (r"\tfrac{1}{2}", r"\frac{1}{2}"),
    ("0.5", r"\frac{1}{2}"),
    (".5", r"\frac{1}{2}"),
    ("1/2", r"\frac{1}{2}"),
    ("-3/4", r"\frac{-3}{4}"),
    ("03/4", "03/4"),  # not canonical integers: left alone
    ("x/2", "x/2"),
    (r"\frac1{72}", r"\frac{1}{72}"),
    (r"\frac{72}1", r"\frac{72}1"),
    (r"\frac1", r"\frac1"),  # one character after \frac: whole string left alone
    ("10\\%", "10"),
    ("10\\\\%", "10"),
    ("10%", "10%"),  # a bare percent sign stays (veRL removes only \%)
    (r"5\text{ cm}", "5"),
    (r"5 \text{ cm}^2", "5"),
    (r"5\text{cm}", r"5\text{cm}"),  # units only with a space after the brace
    ("x=5", "5"),
    ("k = 5", "5"),
    ("xy = 5", "xy=5"),  # more than two characters before "="
    ("x=y=5", "x=y=5"),
    (r"\sqrt3", r"\sqrt{3}"),
    (r"2\sqrt{3}", r"2\sqrt{3}"),
    (r"\left( 1, 2 \right)", "(1,2)"),
    (r"90^\circ", "90"),
    (r"90^{\circ}", "90"),
    (r"\$5", "5"),
    ("$5", "$5"),
    ("1\\!000", "1000"),
    ("1\n2", "12"),
    ("a\\\\b", "a\\b"),
    ("{.5}", "{0.5}"),
    ("x .5", "x0.5"),
    ("", ""),
])
def test_strip_string(raw, normal):
    assert strip_string(raw) == normal


def test_strip_string_failures_and_raw_fallback():
    for unreadable in (r"2\sqrt", r"\frac", r"5\text{ cm}\text{ m}"):
        with pytest.raises(MathNormalizationError):
            strip_string(unreadable)
    assert is_equiv(r"2\sqrt", r"2\sqrt")  # compared raw
    assert not is_equiv(r"2\sqrt", r"2 \sqrt")  # raw strings differ, no space removal
    assert not is_equiv(r"\frac", r"\frac ")
    assert is_equiv(None, None) and not is_equiv("1", None) and not is_equiv(None, "1")


@pytest.mark.parametrize("answer, ground_truth, expected", [
    (r"\frac{1}{2}", r"\frac{1}{2}", 1.0),
    ("0.5", r"\frac{1}{2}", 1.0),
    (r"\dfrac12", r"\frac{1}{2}", 1.0),
    (r"\dfrac12", "0.5", 1.0),
    ("1/2", r"\frac{1}{2}", 1.0),
    (".5", "0.5", 1.0),
    ("0.50", "0.5", 0.0),  # no numeric equivalence
    ("2/4", "1/2", 0.0),
    ("10\\%", "10", 1.0),
    ("10", "10\\%", 1.0),
    ("10%", "10", 0.0),  # veRL quirk: a bare "%" is kept
    (r"5\text{ cm}", "5", 1.0),
    (r"5 \text{ cm}", r"5\text{ m}", 1.0),  # units are dropped on both sides
    (r"5\text{cm}", "5", 0.0),
    ("x=5", "5", 1.0),
    ("x = 5", "5", 1.0),
    (" ( 1 , 2 ) ", "(1,2)", 1.0),
    (r"\left( 1, 2 \right)", "(1, 2)", 1.0),
    ("3\\sqrt3", r"3\sqrt{3}", 1.0),
    (r"90^\circ", "90", 1.0),
    ("5", "6", 0.0),
])
def test_math_equivalences(answer, ground_truth, expected):
    got = math_score(f"Working... so the answer is $\\boxed{{{answer}}}$.", ground_truth)
    assert got == expected and type(got) is float
    assert is_equiv(answer, ground_truth) is (expected == 1.0)


def test_math_compute_score_edge_cases():
    assert math_score("The answer is 5.", "5") == 0.0  # no box
    assert type(math_score("The answer is 5.", "5")) is float
    assert math_score(r"\boxed{4} no wait \boxed{5}", "5") == 1.0
    assert math_score(r"\boxed{5} no wait \boxed{4}", "5") == 0.0
    assert math_score(r"The answer is \boxed 5", "5") == 1.0
    assert math_score(r"The answer is $\boxed 5$.", "5") == 1.0
    assert math_score(r"The answer is \boxed 5.", "5") == 0.0  # "5." up to the end, no "$"
    assert math_score(r"\boxed 1 no, \boxed{2}", "2") == 0.0  # the space form takes precedence
    assert math_score(r"\fbox{5}", "5") == 0.0  # found, but veRL's remove_boxed rejects \fbox
    assert math_score(r"\boxed{5", "5") == 0.0  # unclosed
    assert math_score(r"\boxed{2\sqrt}", r"2\sqrt") == 1.0  # unnormalisable: raw compare
    assert math_score(None, "5") == 0.0  # unreadable input scores 0, never raises
    assert math_score(r"\boxed{5}", 5) == 0.0  # non-string ground truth: raw compare "5" != 5


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------


def test_builtin_data_sources():
    assert compute_score("openai/gsm8k", "so #### 72", "72") == 1.0
    result = compute_score("openai/gsm8k", "no answer", "72")
    assert result == 0.0 and type(result) is float  # veRL normalises the int 0 to float
    arith_answer = "37 + 58 = 95\n#### 95"  # the format of kfrl.data.synthetic
    assert compute_score("kfrl/arith", arith_answer, "95") == 1.0
    assert compute_score("kfrl/arith", arith_answer, "96") == 0.0
    assert {"openai/gsm8k", "kfrl/arith"} <= set(rewards.registered_data_sources())


@pytest.mark.parametrize("data_source", [
    "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"])
def test_math_data_sources(data_source):
    assert data_source in rewards.registered_data_sources()
    assert get_scorer(data_source).__wrapped__ is rewards.math.compute_score
    result = compute_score(data_source, r"so $\boxed{\dfrac12}$", r"\frac{1}{2}")
    assert result == 1.0 and type(result) is float
    assert compute_score(data_source, r"so $\boxed{\dfrac13}$", r"\frac{1}{2}") == 0.0
    assert compute_score(data_source, "no box: 1/2", r"\frac{1}{2}", extra_info={"index": 3}) == 0.0


def test_unknown_data_source():
    with pytest.raises(UnknownDataSourceError) as info:
        compute_score("openai/gsm8kk", "#### 1", "1")
    message = str(info.value)
    assert "'openai/gsm8kk'" in message
    assert "Did you mean 'openai/gsm8k'" in message
    assert "kfrl/arith" in message and "openai/gsm8k" in message
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    with pytest.raises(KeyError):
        get_scorer("nope")

    with pytest.raises(UnknownDataSourceError) as info:
        compute_score("HuggingFaceH4/MATH-50", r"\boxed{1}", "1")
    message = str(info.value)
    assert "'HuggingFaceH4/MATH-50'" in message and "Did you mean 'HuggingFaceH4/MATH-500'" in message
    for known in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500",
                  "openai/gsm8k", "kfrl/arith"):
        assert known in message
    with pytest.raises(UnknownDataSourceError, match="Registered: ") as info:
        get_scorer("math_dapo")  # veRL routes this to math_dapo, which kfrl does not have
    assert "'math_dapo'" in str(info.value)


def test_register_and_normalise_results():
    register("bool/ds", lambda solution_str, ground_truth: solution_str == ground_truth)
    assert compute_score("bool/ds", "a", "a") == 1.0
    assert type(compute_score("bool/ds", "a", "b")) is float

    register(["dict/a", "dict/b"], lambda s, gt: {"score": 0.5, "acc": True})
    assert compute_score("dict/a", "x", "y") == {"score": 0.5, "acc": True}
    assert compute_score("dict/b", "x", "y")["score"] == 0.5

    register("tuple/ds", lambda s, gt: (0.25, {"why": "first item"}))
    assert compute_score("tuple/ds", "x", "y") == 0.25

    register("bad/ds", lambda s, gt: {"acc": 1})
    with pytest.raises(ValueError, match="'score'"):
        compute_score("bad/ds", "x", "y")


def test_register_decorator_signatures_and_overwrite():
    seen = {}

    @register("verl/custom")
    def verl_style(data_source, solution_str, ground_truth, extra_info=None):
        seen.update(data_source=data_source, extra_info=extra_info)
        return 1

    assert compute_score("verl/custom", "s", "g", extra_info={"split": "test"}) == 1.0
    assert seen == {"data_source": "verl/custom", "extra_info": {"split": "test"}}

    register("extra/ds", lambda solution_str, ground_truth, extra_info=None: extra_info["w"])
    assert compute_score("extra/ds", "s", "g", {"w": 3}) == 3.0

    with pytest.raises(ValueError, match="already has a scorer"):
        register("openai/gsm8k", lambda s, g: 0.0)
    register("openai/gsm8k", lambda s, g: 0.75, overwrite=True)
    assert compute_score("openai/gsm8k", "#### 1", "1") == 0.75
    with pytest.raises(TypeError):
        register("x/y", 42)
    with pytest.raises(ValueError):
        register([], lambda s, g: 0)


def test_get_scorer_returns_uniform_callable():
    scorer = get_scorer("openai/gsm8k")
    assert scorer("#### 3", "3") == 1.0
    assert scorer("#### 3", "3", {"index": 0}) == 1.0


# ---------------------------------------------------------------------------------------------
# Custom reward functions from files
# ---------------------------------------------------------------------------------------------

CUSTOM_FILE = textwrap.dedent("""
    import dataclasses

    @dataclasses.dataclass
    class _Verdict:  # dataclasses need the module registered in sys.modules
        ok: bool

    NOT_A_FUNCTION = 3

    def my_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
        return float(_Verdict(solution_str.strip() == ground_truth).ok) + bonus
""")


def test_load_custom_reward_from_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM_FILE)
    fn = load_custom_reward(str(path), "my_score")
    assert fn("ds", " 7 ", "7") == 1.0
    with_bonus = load_custom_reward(path, "my_score", reward_kwargs={"bonus": 0.5})
    assert with_bonus("ds", "7", "7") == 1.5
    register("custom/ds", with_bonus)
    assert compute_score("custom/ds", "8", "7") == 0.5


def test_load_custom_reward_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.py"):
        load_custom_reward(tmp_path / "missing.py", "compute_score")
    path = tmp_path / "rewards_mod.py"
    path.write_text(CUSTOM_FILE)
    with pytest.raises(AttributeError, match="'compute_score'") as info:
        load_custom_reward(path, "compute_score")
    assert "my_score" in str(info.value)  # lists what the file does define
    with pytest.raises(TypeError, match="not callable"):
        load_custom_reward(path, "NOT_A_FUNCTION")


def test_load_custom_reward_from_dotted_module():
    fn = load_custom_reward("kfrl.rewards.gsm8k", "compute_score")
    assert fn("#### 4", "4") == 1.0
    with pytest.raises(FileNotFoundError, match="neither an existing file nor an importable module"):
        load_custom_reward("no_such_package_xyz.rewards", "compute_score")
