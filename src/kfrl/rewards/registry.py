"""Reward functions chosen by each row's `data_source`, like veRL's `default_compute_score`,
plus loading a user's reward function from a file (veRL's `custom_reward_function.path/name`).

A scorer is any callable returning a number or a dict with a "score" key. It is called as
  - `fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...)` when it has a
    `data_source` parameter (veRL's custom-reward signature, so such functions plug in as-is);
  - `fn(solution_str, ground_truth)` otherwise, plus `extra_info=...` when it accepts that keyword
    (the signature of veRL's per-dataset `compute_score` functions such as gsm8k's).
Results are normalised as veRL does: bool/int/float → float, a dict is returned as is (it must
hold "score"; its other keys become extra reward info), a tuple/list → float of its first item.
"""
from __future__ import annotations

import difflib
import functools
import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from kfrl.rewards import gsm8k
from kfrl.rewards import math as math_reward

ScoreResult = float | dict[str, Any]
Scorer = Callable[..., Any]


class UnknownDataSourceError(KeyError, ValueError):
    """No reward function is registered for a data_source (a KeyError and a ValueError)."""

    def __str__(self) -> str:  # KeyError would repr() the message, quotes and escapes included
        return str(self.args[0]) if self.args else ""


_SCORERS: dict[str, Scorer] = {}


def _accepts(fn: Scorer, parameter: str) -> bool:
    try:
        return _accepts_cached(fn, parameter)
    except TypeError:  # an unhashable callable object: inspect it every time
        return _inspect_accepts(fn, parameter)


@functools.lru_cache(maxsize=256)
def _accepts_cached(fn: Scorer, parameter: str) -> bool:
    # Scoring calls this for every response (two signature inspections each: ~0.1 ms).
    return _inspect_accepts(fn, parameter)


def _inspect_accepts(fn: Scorer, parameter: str) -> bool:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # some builtins have no signature; call them plainly
        return False
    return parameter in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def register(data_source_or_names: str | Iterable[str], fn: Scorer | None = None, *, overwrite: bool = False):
    """Register `fn` as the scorer of one data_source name or of several.

    Use as a call, `register("my/dataset", fn)`, or as a decorator, `@register("my/dataset")`.
    Re-registering a name with a different function raises unless `overwrite=True`.
    """
    names = [data_source_or_names] if isinstance(data_source_or_names, str) else list(data_source_or_names)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"register needs one or more non-empty data_source names, got {data_source_or_names!r}")

    def _register(scorer: Scorer) -> Scorer:
        if not callable(scorer):
            raise TypeError(f"the scorer for {names} must be callable, got {scorer!r}")
        for name in names:
            existing = _SCORERS.get(name)
            if existing is not None and existing is not scorer and not overwrite:
                raise ValueError(
                    f"data_source {name!r} already has a scorer ({getattr(existing, '__qualname__', existing)}); "
                    f"pass overwrite=True to replace it")
        for name in names:
            _SCORERS[name] = scorer
        return scorer

    return _register if fn is None else _register(fn)


def registered_data_sources() -> list[str]:
    return sorted(_SCORERS)


def normalize_score(result: Any) -> ScoreResult:
    """veRL's result normalisation: dict as is (must hold "score"), number/bool → float,
    tuple/list → float of the first element."""
    if isinstance(result, Mapping):
        if "score" not in result:
            raise ValueError(f"a reward function returned a dict without a 'score' key: keys {sorted(result)}")
        return dict(result)
    if isinstance(result, (list, tuple)):
        return float(result[0])
    return float(result)  # bool, int, float, numpy scalars, 0-d tensors


def scorer_name(data_source: str) -> str:
    """The function registered for ``data_source``, as ``module.name`` (for error messages)."""
    fn = _SCORERS.get(data_source)
    if fn is None:
        return f"the reward registry (nothing registered for data_source {data_source!r})"
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def get_scorer(data_source: str) -> Callable[..., ScoreResult]:
    """The scorer of `data_source`, as `scorer(solution_str, ground_truth, extra_info=None)`
    returning a normalised result (float, or dict with "score")."""
    fn = _SCORERS.get(data_source)
    if fn is None:
        known = registered_data_sources()
        close = difflib.get_close_matches(str(data_source), known, n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownDataSourceError(
            f"No reward function registered for data_source {data_source!r}.{hint} "
            f"Registered: {', '.join(known) or '(none)'}. Register one with kfrl.rewards.register(name, fn) "
            f"or load a custom one with kfrl.rewards.load_custom_reward(path, name).")
    wants_data_source = _accepts(fn, "data_source")
    wants_extra_info = _accepts(fn, "extra_info")

    @functools.wraps(fn)
    def scorer(solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> ScoreResult:
        if wants_data_source:
            result = fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                        extra_info=extra_info)
        elif wants_extra_info:
            result = fn(solution_str, ground_truth, extra_info=extra_info)
        else:
            result = fn(solution_str, ground_truth)
        return normalize_score(result)

    return scorer


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None
) -> ScoreResult:
    """Score one response with the reward function registered for its data_source."""
    return get_scorer(data_source)(solution_str, ground_truth, extra_info)


def load_custom_reward(path: str | Path, name: str = "compute_score",
                       reward_kwargs: Mapping[str, Any] | None = None) -> Scorer:
    """Import function `name` from the Python file at `path` (veRL's
    `custom_reward_function.path` / `.name`); `reward_kwargs` are bound to it as keywords.

    A `path` that is not a file and does not end in ".py" is tried as a dotted module name
    (e.g. "my_pkg.rewards"), for reward plug-ins installed as packages.
    """
    file_path = Path(path).expanduser()
    if file_path.is_file():
        # A unique module name per file, so two custom reward files never shadow each other.
        digest = hashlib.sha1(str(file_path.resolve()).encode()).hexdigest()[:12]
        module_name = f"kfrl_custom_reward_{file_path.stem}_{digest}"
        spec = importlib.util.spec_from_file_location(module_name, file_path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import reward file {str(file_path)!r} (not a Python source file?)")
        module = importlib.util.module_from_spec(spec)
        # Registered before exec so that dataclasses/pickle inside the file can find the module.
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(module_name, None)
            raise
        where = f"file {str(file_path)!r}"
    elif str(path).endswith(".py") or "/" in str(path) or "\\" in str(path):
        raise FileNotFoundError(f"custom reward file {str(path)!r} not found")
    else:
        try:
            module = importlib.import_module(str(path))
        except ModuleNotFoundError as error:
            raise FileNotFoundError(
                f"custom reward {str(path)!r} is neither an existing file nor an importable module ({error})"
            ) from error
        where = f"module {str(path)!r}"

    fn = getattr(module, name, None)
    if fn is None:
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(f"reward function {name!r} not found in {where}; callables defined there: {public}")
    if not callable(fn):
        raise TypeError(f"{name!r} in {where} is not callable (it is {type(fn).__name__})")
    if reward_kwargs:
        fn = functools.partial(fn, **dict(reward_kwargs))
    return fn


# ---------------------------------------------------------------------------------------------
# Built-in scorers.
# ---------------------------------------------------------------------------------------------

# GSM8K with veRL's defaults: strict "#### <answer>", 1.0 if right, 0.0 otherwise.
register("openai/gsm8k", gsm8k.compute_score)
# kfrl's synthetic arithmetic task ends its answers with "#### <integer>" (kfrl.data.synthetic),
# so the same strict rule applies.
register("kfrl/arith", gsm8k.compute_score)
# MATH (Hendrycks): the answer in the last \boxed{...}, compared after veRL's string normalisation;
# the data sources veRL's default_compute_score sends to math_reward.
MATH_DATA_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
register(MATH_DATA_SOURCES, math_reward.compute_score)
