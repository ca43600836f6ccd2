"""Environments: what answers an agent's model turn by turn (``agent.env``).

    class GuessNumber(Environment):
        def reset(self, row):                 # the data row of this trajectory
            self.target = int(row["ground_truth"])
            return ""                         # text appended after the prompt ("" for none)

        def step(self, action):               # the model turn's text
            ...
            return observation, reward, done, info

One instance per trajectory (the class is called with no arguments). ``reset`` and ``step`` may
be ``async def``. Rewards of all steps are summed into the trajectory's ``env_rewards``. A step
that raises or overruns ``agent.env_timeout_s`` ends its trajectory (reward so far, an
``agent/env_errors`` count); it never stops the run.

`ToolEnvironment` is the environment of tool use: a turn with tool calls gets their results;
a turn without one is the model's answer and ends the trajectory (its reward comes from the
pipeline's reward op, or from ``answer_reward``).
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field
from typing import Any, Mapping

from rlgraph.ops.agents.formats import ToolFormat
from rlgraph.ops.agents.tools import ToolBox

__all__ = ["Environment", "StepResult", "ToolEnvironment", "as_step_result", "call_maybe_async"]


@dataclass(frozen=True)
class StepResult:
    observation: str
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, Any] = field(default_factory=dict)
    tool_calls: int = 0
    tool_results: tuple[str, ...] = ()
    """the raw results of the turn's tool calls (a chat template wraps these itself)"""


def as_step_result(value: Any) -> StepResult:
    """A step's return value (a `StepResult`, or ``(observation, reward, done, info)`` / its first 3)."""
    if isinstance(value, StepResult):
        return value
    if isinstance(value, tuple) and 3 <= len(value) <= 4:
        obs, reward, done = value[:3]
        info = value[3] if len(value) == 4 and isinstance(value[3], Mapping) else {}
        return StepResult("" if obs is None else str(obs), float(reward), bool(done), info)
    raise TypeError(f"an environment's step returned {type(value).__name__}; return (observation, reward, done, "
                    f"info) or a StepResult")


def call_maybe_async(fn: Any, *args: Any) -> Any:
    """`fn(*args)`, run to completion when it is a coroutine function (on a loop of this thread)."""
    out = fn(*args)
    if inspect.isawaitable(out):
        return asyncio.run(_await(out))
    return out


async def _await(aw: Any) -> Any:
    return await aw


class Environment:
    """Base class of environments (see the module doc). Override ``reset`` and ``step``."""

    def reset(self, row: Mapping[str, Any]) -> str:
        return ""

    def step(self, action: str) -> Any:
        raise TypeError(f"{type(self).__name__} must define step(action) -> (observation, reward, done, info)")

    def close(self) -> None:
        """Called when the trajectory ends."""


class ToolEnvironment(Environment):
    """Tool use: calls in a turn are run by the shared `ToolBox` and their results returned in the
    format's observation; a turn without calls is the answer (done). `answer_reward`, when given,
    scores the answer: ``answer_reward(answer_text, row) -> float``."""

    def __init__(self, fmt: ToolFormat, toolbox: ToolBox, answer_reward: Any = None) -> None:
        self.fmt = fmt
        self.toolbox = toolbox
        self.answer_reward = answer_reward
        self.row: Mapping[str, Any] = {}

    def reset(self, row: Mapping[str, Any]) -> str:
        self.row = row
        return ""

    def step(self, action: str) -> StepResult:
        calls = self.fmt.parse(action)
        if not calls:
            reward = float(self.answer_reward(action, self.row)) if self.answer_reward is not None else 0.0
            return StepResult("", reward, True)
        results = [self.toolbox.run(c).text for c in calls]
        return StepResult(self.fmt.render(results), 0.0, False, tool_calls=len(calls), tool_results=tuple(results))
