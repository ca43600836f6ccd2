"""Issue 14, item 6: does a long run leak? Memory and disk over a long run of the GRPO example.

One run of `examples/grpo.py` (its tiny model, TransferQueue, ``trainer.save_every=50`` so that
checkpoints are part of the run) for `steps` steps. Every `every` steps the driver samples:

- its own resident memory, and the summed resident memory of the run's actors (every worker rank
  and the source actor, each asked for its pid once);
- the object store's used bytes on the node (Ray's memory summary);
- the size of the Ray session directory (logs, spilled objects, runtime files).

A leak shows as growth that goes on after warm-up: the table gives each quantity at the first
sample after warm-up and at the end, and the growth per 100 steps between them.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import common
from rlgraph.runtime.reporter import Reporter

MB = 1024 * 1024


def _rss(pids: list[int]) -> int:
    import psutil

    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def _object_store_bytes() -> int:
    """Bytes in the node's object store (plasma), from Ray's memory summary."""
    from ray._private.internal_api import memory_summary

    text = memory_summary(stats_only=True)
    m = re.search(r"Plasma memory usage (\d+) MiB", text)
    return int(m.group(1)) * MB if m else 0


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


class _Sampler(Reporter):
    """A reporter that samples every `every` steps (it runs in the driver, between steps)."""

    def __init__(self, runner: Any, every: int) -> None:
        self.runner, self.every = runner, every
        self.rows: list[dict[str, float]] = []
        self.pids: list[int] | None = None

    def step_done(self, record: dict[str, Any]) -> None:
        import ray

        step = int(record["step"])
        if (step + 1) % self.every:
            return
        fleet = self.runner.fleet
        if self.pids is None:
            actors = [w for ws in fleet.workers.values() for w in ws] + [fleet.source_actor]
            self.pids = ray.get([a.__ray_call__.remote(lambda self: os.getpid()) for a in actors])
        session = Path(ray._private.worker._global_node.get_session_dir_path())
        self.rows.append({"step": step + 1, "driver": _rss([os.getpid()]), "actors": _rss(self.pids),
                          "store": _object_store_bytes(), "session": _dir_bytes(session)})
        print(f"  step {step + 1}: driver {self.rows[-1]['driver'] / MB:.0f} MiB, actors "
              f"{self.rows[-1]['actors'] / MB:.0f} MiB, object store {self.rows[-1]['store'] / MB:.0f} MiB, "
              f"session dir {self.rows[-1]['session'] / MB:.1f} MiB", flush=True)


def measure(steps: int, every: int, plane: Any) -> list[dict[str, float]]:
    from rlgraph.graph.compile import compile_pipeline
    from rlgraph.graph.loader import load_pipeline
    from rlgraph.runtime.runner import Runner, prepare

    pipeline, ref = load_pipeline(str(common.ROOT / "examples" / "grpo.py"))
    plan = compile_pipeline(pipeline, ["trainer.seed=0", f"trainer.save_every={max(every, 1)}"], ref)
    prepare(plan)
    with tempfile.TemporaryDirectory() as tmp:
        options = common.quiet_runner_options(Path(tmp), steps=steps)
        options.keep_records = False  # as `rlgraph run` does: metrics.jsonl has the records
        runner = Runner(plan, options, plane)
        sampler = _Sampler(runner, every)
        runner.reporter = sampler
        with runner:
            runner.run()
    return sampler.rows


def run(quick: bool = False, argv: list[str] | None = None, steps: int | None = None, **_: Any) -> common.Section:
    steps = steps or (6 if quick else 500)
    every = 2 if quick else 50
    rows = measure(steps, every, common.plane("transferqueue"))
    t = common.Table(["quantity", f"after step {rows[0]['step']:.0f} (warm)", f"after step {rows[-1]['step']:.0f}",
                      "growth per 100 steps"])
    span = max(rows[-1]["step"] - rows[0]["step"], 1)
    for key, label in (("driver", "driver resident memory (MiB)"), ("actors", "actors' resident memory, summed (MiB)"),
                       ("store", "object store used (MiB)"), ("session", "Ray session directory (MiB)")):
        first, last = rows[0][key] / MB, rows[-1][key] / MB
        t.add(label, first, last, (last - first) * 100 / span)
    t.print()
    samples = common.Table(["step", "driver MiB", "actors MiB", "object store MiB", "session dir MiB"])
    for r in rows:
        samples.add(r["step"], r["driver"] / MB, r["actors"] / MB, r["store"] / MB, r["session"] / MB)
    intro = f"""
{steps} steps of `examples/grpo.py` (tiny model, TransferQueue, a checkpoint every {every} steps)
in one run, sampled every {every} steps by the driver: its resident memory, the summed resident
memory of every worker and the source actor, the node's object-store usage (Ray's memory
summary) and the size of the Ray session directory. Flat lines after the first sample mean no
leak; the growth column is per 100 steps between the first and the last sample.
"""
    return common.Section("leaks", "9. Long runs: memory and disk", intro, [t, samples], "",
                          common.command_line(argv if argv is not None else ["leaks"] + (["--quick"] if quick else [])))
