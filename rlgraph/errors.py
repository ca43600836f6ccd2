"""Typed errors. Every user-facing error names the culprit (op, column, key, file) and the fix.

`PipelineError` collects every problem found by the checker and raises once with all of them,
so a user fixes a pipeline in one round instead of one error at a time.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

__all__ = [
    "RLGraphError",
    "Problem",
    "PipelineError",
    "DeclarationError",
    "ConfigError",
    "PlanError",
    "PipelineLoadError",
    "OpError",
    "StepTimeout",
    "RefillExhausted",
    "WorkerDiedError",
]


class RLGraphError(Exception):
    """Base of every error rlgraph raises on bad user input. The CLI prints these without a traceback."""

    def with_message(self, message: str) -> RLGraphError:
        """The same error, its type and attributes kept, saying `message` instead: context is added
        (a retry count) without calling a subclass's constructor, whose arguments differ."""
        new = copy.copy(self)
        new.args = (message,)
        return new


@dataclass(frozen=True)
class Problem:
    """One problem found in a pipeline: a stable `code`, what is wrong, and how to fix it."""

    code: str
    message: str
    fix: str
    op: str | None = None
    column: str | None = None

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}\n      fix: {self.fix}"


class PipelineError(RLGraphError):
    """A pipeline failed its checks. `problems` holds every problem found, not just the first."""

    def __init__(self, problems: list[Problem], pipeline: str = "pipeline") -> None:
        self.problems = list(problems)
        self.pipeline = pipeline
        n = len(self.problems)
        lines = [f"{pipeline!r} has {n} problem{'s' if n != 1 else ''}:"]
        lines += [f"  {i}. {p}" for i, p in enumerate(self.problems, 1)]
        super().__init__("\n".join(lines))

    @property
    def codes(self) -> list[str]:
        return [p.code for p in self.problems]


class DeclarationError(RLGraphError, TypeError):
    """An operator, column or worker group was declared wrongly (caught where it is declared)."""


class ConfigError(RLGraphError, ValueError):
    """A config override is malformed, names an unknown key, or has a value of the wrong type."""


class PlanError(RLGraphError, ValueError):
    """A plan file is malformed, from another plan-format version, or not a plan at all."""


class PipelineLoadError(RLGraphError):
    """A PIPELINE argument (file or module:attr) could not be loaded or is not a Pipeline."""


class OpError(RLGraphError):
    """An op body could not be loaded or bound, failed, or returned something that does not match
    its declaration. The message names the op, the worker, the step and the rows."""


class InvariantError(RLGraphError):
    """A broken invariant of the run, a bug rather than a transient failure (e.g. the update given
    samples older than trainer.max_staleness): the run fails at once, retrying cannot help."""


class CallOrderError(RLGraphError):
    """A call queued behind the step before's call on its worker found that call not ended well just
    before it (it failed, or did not run first): not run. The runner mends it like a failed call."""


class RefillExhausted(RLGraphError):
    """Dynamic sampling ran its ``max_rounds`` generation rounds without keeping enough groups to
    fill the batch, and the filter's ``on_exhaust`` is ``fail``; the message has the counts and fixes."""


class StepTimeout(RLGraphError):
    """A wait inside a run exceeded its limit; the message says what was pending."""


class WorkerDiedError(RLGraphError):
    """A worker actor's process ended while it ran an op call (crash, OOM kill, node loss)."""
