"""The reporters a run's ``trainer.logger`` names, put together: the console display
(`rlgraph.runtime.progress`) and the experiment trackers (`rlgraph.runtime.loggers`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlgraph.errors import ConfigError
from rlgraph.runtime.progress import FaultReporter, LogReporter, RichReporter
from rlgraph.runtime.reporter import Reporter

if TYPE_CHECKING:
    from rlgraph.graph.plan import Plan

__all__ = ["make_reporter"]


class _Many(Reporter):
    """Calls every reporter. A tracker that fails after it started (a lost connection to a tracking
    server, a full disk) is reported once and left out from then on: the training run goes on, and
    the other reporters still get every call and are all closed. A failure in `start` is raised
    (the logger the user asked for cannot run); the runner's `close` then closes every reporter."""

    def __init__(self, reporters: list[Reporter]) -> None:
        self.reporters = reporters

    def __getattribute__(self, name: str):
        if name in ("start", "step_started", "chunk_done", "step_done", "checkpoint", "fault", "phase", "close"):
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
    from rlgraph.graph.dsl import parse_loggers
    from rlgraph.graph.settings import TrainerSettings
    from rlgraph.runtime.loggers import MLflowLogger, TensorBoardLogger, WandbLogger

    config = plan.config if plan is not None else {}
    trainer = TrainerSettings.of(config)  # without a plan: the defaults
    try:
        names = parse_loggers(trainer.logger)
    except ValueError as e:
        raise ConfigError(f"trainer.logger={trainer.logger}: {e}") from None
    out_dir = Path(out_dir)
    run_name = trainer.run_name or out_dir.resolve().name or (plan.pipeline if plan else "rlgraph")
    project, pipeline = trainer.project, plan.pipeline if plan is not None else ""
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
