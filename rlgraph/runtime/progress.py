"""Progress on the console: rich bars on a terminal, plain log lines otherwise, or the fault
lines alone (`rlgraph.runtime.reporting.make_reporter` picks, from ``trainer.logger``)."""

from __future__ import annotations

import sys
from typing import Any, Mapping, Sequence

from rlgraph.runtime.reporter import Reporter

__all__ = ["LogReporter", "RichReporter", "FaultReporter"]

_ALWAYS = ("timing/step_s", "driver/payload_bytes")  # shown after the pipeline's headline metrics


def _headline(record: Mapping[str, Any], keys: Sequence[str]) -> str:
    parts = [f"{k}={record[k]:.4g}" for k in (*keys, *_ALWAYS) if isinstance(record.get(k), (int, float))]
    return " ".join(parts)


class LogReporter(Reporter):
    """One line per step (not a terminal: CI logs, files)."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.total = 0
        self.headline: Sequence[str] = ()

    def start(self, total_steps: int, first_step: int, headline: Sequence[str] = ()) -> None:
        self.total, self.headline = total_steps, headline
        print(f"rlgraph: running steps {first_step}..{total_steps - 1}", file=self.stream, flush=True)

    def step_done(self, record: Mapping[str, Any]) -> None:
        print(f"step {record['step']}/{self.total - 1} {_headline(record, self.headline)}", file=self.stream,
              flush=True)

    def fault(self, message: str) -> None:
        print(f"rlgraph: {message}", file=self.stream, flush=True)

    phase = fault  # a start-up phase is one line too


class RichReporter(Reporter):
    """A bar for the steps and one per op for the current step."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("{task.description:<16}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.fields[info]}"), transient=False)
        self.steps_task = None
        self.op_tasks: dict[str, Any] = {}
        self.headline: Sequence[str] = ()

    def start(self, total_steps: int, first_step: int, headline: Sequence[str] = ()) -> None:
        self.headline = headline
        self.progress.start()
        self.steps_task = self.progress.add_task("steps", total=total_steps, completed=first_step, info="")

    def step_started(self, step: int, chunks: Mapping[str, int]) -> None:
        for op, n in chunks.items():
            if op not in self.op_tasks:
                self.op_tasks[op] = self.progress.add_task(f"  {op}", total=n, info="")
            self.progress.reset(self.op_tasks[op], total=n)

    def chunk_done(self, step: int, op: str) -> None:
        if op in self.op_tasks:
            self.progress.advance(self.op_tasks[op])

    def step_done(self, record: Mapping[str, Any]) -> None:
        self.progress.update(self.steps_task, advance=1, info=_headline(record, self.headline))

    def fault(self, message: str) -> None:
        self.progress.console.print(f"rlgraph: {message}")

    phase = fault  # a start-up phase is one line too

    def close(self, error: BaseException | None = None) -> None:
        self.progress.stop()


class FaultReporter(Reporter):
    """Only the fault lines: what a run without ``console`` in trainer.logger prints."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stderr

    def fault(self, message: str) -> None:
        print(f"rlgraph: {message}", file=self.stream, flush=True)
