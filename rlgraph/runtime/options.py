"""How to run a plan: the options of `rlgraph run`, as the runner takes them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TYPE_CHECKING, Callable

from rlgraph.runtime.recovery import Fault

if TYPE_CHECKING:
    from rlgraph.runtime.reporter import Reporter

__all__ = ["RunOptions"]


@dataclass
class RunOptions:
    """How to run a plan (the CLI's flags)."""

    out_dir: Path = Path("runs/latest")
    steps: int | None = None  # default: the plan's trainer.steps
    schedule: str | None = None  # default: the plan's trainer.schedule
    address: str | None = None
    resume: bool = False  # continue from DIR's latest checkpoint (`check_run_dir`: one must exist)
    overwrite: bool = False  # replace an earlier run in DIR; without it (or resume) such a DIR is refused
    fallback: bool = False  # with resume: a checkpoint that fails its checksums gives way to the newest good one
    timeout_s: float = 600.0  # longest wait for any single result
    dataplane: str | None = None  # default: the plan's dataplane.backend
    reporter: Reporter | None = None  # default: none
    # called once Ray is up: ray.init replaces the driver's SIGTERM handler, the CLI puts its own back
    on_ray_started: Callable[[], None] | None = None
    max_retries: int | None = None  # default: the plan's trainer.max_retries
    faults: list[Fault] = field(default_factory=list)  # fault injection (tests)
    verbose: bool = False  # the actors' own output (Ray, engines) on this terminal; long waits logged
    trace_steps: int = 200  # trace.json and timeline.svg show the op calls of the last this many steps (0: all)
    # a Ray this run already started (`rlgraph run` starts it while the runtime's modules import); the
    # fleet uses it, and stops it at the end, instead of starting one
    ray: Any = None
    # called once the workers' actors are created, before the run waits for them to start: the CLI's
    # preflight of the data and tokenizer, run while their processes import; it raises to stop the run
    checks: Callable[[], None] | None = None
    keep_records: bool = True  # run() returns every step's record (metrics.jsonl has them all either way)
