"""Progress reporting: rich bars on a terminal, plain log lines otherwise, TensorBoard if installed.

The runner calls a `Reporter` at step start, after every finished chunk and at step end; the
reporter never touches payload, only counts and the step's metrics record.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["Reporter", "LogReporter", "RichReporter", "TensorBoardReporter", "make_reporter"]

log = logging.getLogger("rlgraph")

_ALWAYS = ("timing/step_s", "driver/payload_bytes")  # shown after the pipeline's headline metrics


def _headline(record: Mapping[str, Any], keys: Sequence[str]) -> str:
    parts = [f"{k}={record[k]:.4g}" for k in (*keys, *_ALWAYS) if isinstance(record.get(k), (int, float))]
    return " ".join(parts)


class Reporter:
    """Does nothing; subclasses show progress. `start` gets the pipeline's headline metric keys
    (its summaries' means) to show per step."""

    def start(self, total_steps: int, first_step: int, headline: Sequence[str] = ()) -> None: ...
    def step_started(self, step: int, chunks: Mapping[str, int]) -> None: ...
    def chunk_done(self, step: int, op: str) -> None: ...
    def step_done(self, record: Mapping[str, Any]) -> None: ...
    def fault(self, message: str) -> None: ...  # one line per fault: what died, what was done about it
    def phase(self, message: str) -> None: ...  # one line per start-up phase: what is ready, in how long
    def close(self) -> None: ...


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

    def close(self) -> None:
        self.progress.stop()


class TensorBoardReporter(Reporter):
    """Scalars of every step record, under the run directory's ``tensorboard/``."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(str(log_dir))

    def step_done(self, record: Mapping[str, Any]) -> None:
        for k, v in record.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                self.writer.add_scalar(k, v, record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Many(Reporter):
    def __init__(self, reporters: list[Reporter]) -> None:
        self.reporters = reporters

    def __getattribute__(self, name: str):
        if name in ("start", "step_started", "chunk_done", "step_done", "fault", "phase", "close"):
            def fan_out(*a: Any, **k: Any) -> None:
                for r in object.__getattribute__(self, "reporters"):
                    getattr(r, name)(*a, **k)

            return fan_out
        return object.__getattribute__(self, name)


def make_reporter(out_dir: Path, tty: bool | None = None) -> Reporter:
    """Rich on a terminal, log lines otherwise; plus TensorBoard when it is installed."""
    tty = sys.stderr.isatty() if tty is None else tty
    reporters: list[Reporter] = [RichReporter() if tty else LogReporter()]
    try:
        reporters.append(TensorBoardReporter(out_dir / "tensorboard"))
    except ImportError:
        log.debug("tensorboard is not installed; no TensorBoard logs (pip install tensorboard)")
    return _Many(reporters)
