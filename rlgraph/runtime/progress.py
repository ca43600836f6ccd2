"""Progress reporting: rich bars on a terminal, plain log lines otherwise, and the experiment
trackers that ``trainer.logger`` names (`rlgraph.runtime.loggers`).

The runner calls a `Reporter` at step start, after every finished chunk and at step end; the
reporter never touches payload, only counts and the step's metrics record.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from rlgraph.errors import ConfigError

if TYPE_CHECKING:
    from rlgraph.graph.plan import Plan

__all__ = ["Reporter", "LogReporter", "RichReporter", "FaultReporter", "make_reporter"]

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
    def close(self, error: BaseException | None = None) -> None:
        """The run ended: `error` is the exception it ends on (None: it finished)."""


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


class _Many(Reporter):
    """Calls every reporter. A tracker that fails after it started (a lost connection to a tracking
    server, a full disk) is reported once and left out from then on: the training run goes on, and
    the other reporters still get every call and are all closed. A failure in `start` is raised
    (the logger the user asked for cannot run), after closing the reporters started before it."""

    def __init__(self, reporters: list[Reporter]) -> None:
        self.reporters = reporters

    def __getattribute__(self, name: str):
        if name in ("start", "step_started", "chunk_done", "step_done", "fault", "phase", "close"):
            def fan_out(*a: Any, **k: Any) -> None:
                reporters = object.__getattribute__(self, "reporters")
                for r in list(reporters):
                    try:
                        getattr(r, name)(*a, **k)
                    except Exception as e:
                        if name == "start":
                            raise
                        reporters.remove(r)
                        print(f"rlgraph: the {type(r).__name__} failed in {name} ({type(e).__name__}: {e}); "
                              f"it logs nothing more in this run", file=sys.stderr, flush=True)

            return fan_out
        return object.__getattribute__(self, name)


def make_reporter(out_dir: Path, plan: Plan | None = None, tty: bool | None = None) -> Reporter:
    """The reporters the plan's ``trainer.logger`` names (without a plan, its default): ``console``
    is the progress display (rich bars on a terminal, log lines otherwise; without it only faults
    are printed), ``tensorboard``, ``wandb`` and ``mlflow`` the trackers, writing under `out_dir`.
    ``jsonl`` needs nothing here: the runner always writes metrics.jsonl.

    Raises `ConfigError` for an unknown logger or one whose package is missing, before anything starts.
    """
    from rlgraph.graph.dsl import TRAINER_PARAMS, parse_loggers
    from rlgraph.runtime.loggers import MLflowLogger, TensorBoardLogger, WandbLogger

    config = plan.config if plan is not None else {}
    trainer = config.get("trainer", {})
    text = trainer.get("logger", TRAINER_PARAMS["logger"].default)
    try:
        names = parse_loggers(text)
    except ValueError as e:
        raise ConfigError(f"trainer.logger={text}: {e}") from None
    out_dir = Path(out_dir)
    run_name = trainer.get("run_name") or out_dir.resolve().name or (plan.pipeline if plan else "rlgraph")
    project, pipeline = trainer.get("project"), plan.pipeline if plan is not None else ""
    tty = sys.stderr.isatty() if tty is None else tty
    reporters: list[Reporter] = [(RichReporter() if tty else LogReporter()) if "console" in names else FaultReporter()]
    for name in names:  # each checks its package here, so a missing one fails before Ray starts
        if name == "tensorboard":
            reporters.append(TensorBoardLogger(out_dir / "tensorboard", config))
        elif name == "wandb":
            reporters.append(WandbLogger(out_dir, config, project, run_name))
        elif name == "mlflow":
            reporters.append(MLflowLogger(out_dir, config, project, run_name, pipeline))
    return _Many(reporters)
