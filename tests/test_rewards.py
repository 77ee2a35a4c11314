"""kfrl.rewards: veRL's GSM8K rules (including its observed outputs) and the data_source registry."""
from __future__ import annotations

import textwrap

import pytest

from kfrl import rewards
from kfrl.rewards import UnknownDataSourceError, compute_score, get_scorer, load_custom_reward, register
from kfrl.rewards import registry as registry_module
from kfrl.rewards.gsm8k import SOLUTION_CLIP_CHARS, extract_solution
from kfrl.rewards.gsm8k import compute_score as gsm8k_score


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
