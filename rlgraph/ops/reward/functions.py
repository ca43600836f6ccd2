"""Rule-based rewards with verl's signature, and the helpers the reward op uses to call them.

A reward function is ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``
returning a float, or a dict with a ``"score"`` key and any extra values to log (verl's
contract, so verl reward functions work unchanged). `compute_score` here scores the built-in
tasks of `rlgraph.ops.data.tasks`: 1.0 when the parsed answer equals the ground truth exactly, else
0.0 (no partial credit: a near miss such as "8" for "7" is as wrong as "x").

The answer is parsed from the decoded response by cutting it at the first special token that
was left in (``<eos>``, ``<pad>``, a role marker) and stripping whitespace, so "7", " 7\\n" and
"7<eos><pad>" all parse as "7", while "77" or "7 is it" do not.
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
from typing import Any, Callable, Sequence

from rlgraph.errors import RLGraphError
from rlgraph.ops.refs import RefError, import_ref

__all__ = [
    "RewardFnError",
    "UnknownDataSourceError",
    "parse_answer",
    "exact_match",
    "compute_score",
    "final_answer_match",
    "load_reward_fn",
    "score_batch",
    "normalise_score",
]

RewardFn = Callable[..., "float | dict[str, Any]"]

_SPECIAL = re.compile(r"<(?:pad|bos|eos|unk)>|<\|[a-z]+\|>")


class RewardFnError(RLGraphError):
    """A reward function could not be loaded, has the wrong signature, or returned a bad value."""


class UnknownDataSourceError(RewardFnError, ValueError):
    """`compute_score` got a ``data_source`` it has no scorer for."""


def parse_answer(solution_str: str) -> str:
    """The answer in a decoded response: the text before any special token, stripped."""
    return _SPECIAL.split(solution_str, maxsplit=1)[0].strip()


def exact_match(solution_str: str, ground_truth: str) -> float:
    """1.0 if the parsed answer equals the (stripped) ground truth, else 0.0."""
    return 1.0 if parse_answer(solution_str) == str(ground_truth).strip() else 0.0


_OBSERVATION_END = re.compile(r"(?:\)|\]|</tool_response>)")


def final_answer_match(solution_str: str, ground_truth: str) -> float:
    """`exact_match` of the text after the response's last tool result (a ``)``, ``]`` or
    ``</tool_response>``): the answer an agent gives once its tools have answered."""
    return exact_match(_OBSERVATION_END.split(solution_str)[-1], ground_truth)


# data_source -> scorer(solution_str, ground_truth); the names are the tasks in rlgraph.ops.data.tasks
_SCORERS: dict[str, Callable[[str, str], float]] = {
    "add": exact_match,
    "count": exact_match,
    "mul": final_answer_match,
    "guess": exact_match,
}


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """Score one response of a built-in task (verl's signature): 1.0 for an exact answer, else 0.0."""
    scorer = _SCORERS.get(data_source)
    if scorer is None:
        raise UnknownDataSourceError(
            f"compute_score has no scorer for data_source={data_source!r}; it knows {', '.join(sorted(_SCORERS))}. "
            f"Fix: set reward.fn='your_module:your_score' to a function with the signature "
            f"compute_score(data_source, solution_str, ground_truth, extra_info=None)")
    return scorer(solution_str, ground_truth)


def load_reward_fn(ref: str) -> RewardFn:
    """Import ``"module:function"`` (or ``"path/to/file.py:function"``) and check that it can be
    called as verl calls it: ``fn(data_source=, solution_str=, ground_truth=, extra_info=)``."""
    target, sep, name = ref.rpartition(":")
    if not sep or not target or not name:
        raise RewardFnError(f"reward function {ref!r} is not of the form 'module:function' "
                            f"(e.g. 'rlgraph.ops.reward.functions:compute_score' or 'my_rewards.py:score')")
    try:
        fn = import_ref(ref, "reward function")
    except RefError as e:
        raise RewardFnError(str(e)) from e
    if not callable(fn):
        raise RewardFnError(f"reward function {ref!r} is not callable ({type(fn).__name__} {fn!r}); name a function")
    _check_signature(fn, ref)
    return fn


def _check_signature(fn: Callable, ref: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: trust them
        return
    try:
        sig.bind(data_source="", solution_str="", ground_truth="", extra_info=None)
    except TypeError as e:
        raise RewardFnError(
            f"reward function {ref!r} has signature {_sig(fn, sig)}, which cannot be called as "
            f"fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...) ({e}). Fix: define it as "
            f"def {getattr(fn, '__name__', 'compute_score')}(data_source, solution_str, ground_truth, "
            f"extra_info=None)") from None


def _sig(fn: Callable, sig: inspect.Signature) -> str:
    return f"{getattr(fn, '__name__', 'fn')}{sig}"


def _as_float(value: Any, where: str) -> float:
    if type(value) in (float, int, bool) or isinstance(value, numbers.Real):  # the ABC check is slow: builtins first
        out = float(value)
    elif hasattr(value, "numel") and hasattr(value, "item") and value.numel() == 1:  # a one-element tensor
        out = float(value.item())
    else:
        raise RewardFnError(f"{where} returned {type(value).__name__} {value!r}; return a float, or a dict "
                            f"with a float 'score' and any extra values")
    if not math.isfinite(out):
        raise RewardFnError(f"{where} returned a non-finite score {out!r}; return a finite float")
    return out


def score_batch(fn: RewardFn, data_sources: Sequence[str], solution_strs: Sequence[str],
                ground_truths: Sequence[str], extra_infos: Sequence[dict | None] | None = None,
                ) -> tuple[list[float], list[dict[str, Any]]]:
    """Call `fn` once per sample; returns the scores and, per sample, the extra values of a dict
    return (everything but ``"score"``; ``{}`` for a float return)."""
    n = len(data_sources)
    if extra_infos is None:
        extra_infos = [None] * n
    sizes = {"data_sources": n, "solution_strs": len(solution_strs), "ground_truths": len(ground_truths),
             "extra_infos": len(extra_infos)}
    if len(set(sizes.values())) > 1:
        raise RewardFnError(f"score_batch got lists of different lengths: {sizes}")
    label = getattr(fn, "__qualname__", repr(fn))
    scores: list[float] = []
    extras: list[dict[str, Any]] = []
    for i in range(n):
        out = fn(data_source=data_sources[i], solution_str=solution_strs[i], ground_truth=ground_truths[i],
                 extra_info=extra_infos[i])
        score, extra = normalise_score(out, f"reward function {label!r} on sample {i} "
                                            f"(data_source={data_sources[i]!r})")
        scores.append(score)
        extras.append(extra)
    return scores, extras


def normalise_score(out: Any, where: str) -> tuple[float, dict[str, Any]]:
    """A reward function's return value as (score, extras): a float, or a dict with ``"score"``."""
    if isinstance(out, dict):
        if "score" not in out:
            raise RewardFnError(f"{where} returned a dict without 'score' (keys {sorted(out)}); add the "
                                f"scalar reward under 'score'")
        return _as_float(out["score"], where + " ['score']"), {k: v for k, v in out.items() if k != "score"}
    return _as_float(out, where), {}
