"""What the runner tells about a run as it goes: the `Reporter` interface.

The runner calls a reporter at step start, after every finished chunk and at step end; a
reporter never touches payload, only counts and the step's metrics record. The console display
(`rlgraph.runtime.progress`) and the experiment trackers (`rlgraph.runtime.loggers`) implement it;
`rlgraph.runtime.reporting` puts together the ones ``trainer.logger`` names.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

__all__ = ["Reporter"]


class Reporter:
    """Does nothing; subclasses show progress. `start` gets the pipeline's headline metric keys
    (its summaries' means) to show per step."""

    def start(self, total_steps: int, first_step: int, headline: Sequence[str] = ()) -> None: ...
    def step_started(self, step: int, chunks: Mapping[str, int]) -> None: ...
    def chunk_done(self, step: int, op: str) -> None: ...
    def step_done(self, record: Mapping[str, Any]) -> None: ...
    def checkpoint(self, step: int) -> None: ...  # a checkpoint after `step` is next: make what was logged durable
    def fault(self, message: str) -> None: ...  # one line per fault: what died, what was done about it
    def phase(self, message: str) -> None: ...  # one line per start-up phase: what is ready, in how long
    def close(self, error: BaseException | None = None) -> None:
        """The run ended: `error` is the exception it ends on (None: it finished)."""
