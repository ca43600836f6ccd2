"""Item 3: controller traffic: column bytes through the driver vs all column bytes moved.

`Runner` (ours): workers get and put columns themselves; the driver sends row ids and receives
small results. Every process counts the column payload it puts and gets
(`payload_bytes_in_this_process`); summed over the workers and the source actor, that is all
column bytes moved. The driver's share is `driver/payload_bytes` + `driver/result_bytes`.

`ClassicRunner` (a benchmark-only subclass): a driver that holds every stage's outputs, as the
classic single-controller trainer does (verl's `DataProto` through `ray.get`): before each call
it fetches the call's input columns into the driver (what it would ship to the worker), after
each call it fetches the call's output columns (what the worker would return), and it runs the
`sync` schedule. Its workers still read the data plane themselves, so its step time includes
the driver's transfers on top of ours. Columns a worker keeps to itself (read only by its own
single-rank group, `rlgraph.runtime.dataplane.local`) are not in the plane, so the classic driver
here does not fetch them: its bytes are a lower bound of a classic driver's.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import common
from rlgraph.runtime.runner import Runner


def _sample_columns(plan: Any, cols: list[str]) -> list[str]:
    from rlgraph.runtime.worker import local_columns

    private = {c for g in plan.groups for c in local_columns(plan, g.name)[1]}
    return [c for c in cols if plan.columns[c].level == "sample" and plan.columns[c].kind == "data"
            and plan.columns[c].stored and c not in private]


class ClassicRunner(Runner):
    """The driver gathers every stage's outputs and ships every call's inputs."""

    def _submit(self, call: Any, lv: Any, inflight: Any) -> None:
        cols = _sample_columns(self.plan, self.plan.op(call.chunk.op).inputs)
        if cols and call.rows:
            self.fleet.plane.get(lv.partition, call.rows, cols)
        super()._submit(call, lv, inflight)

    def _finish(self, call: Any, result: Any, lv: Any) -> None:
        cols = _sample_columns(self.plan, self.plan.op(call.chunk.op).outputs)
        if cols and call.rows:
            self.fleet.plane.get(lv.partition, call.rows, cols)
        super()._finish(call, result, lv)


def worker_bytes(runner: Runner) -> int:
    """Column payload put or got so far by the run's workers and source actor."""
    import ray

    actors = [w for ws in runner.fleet.workers.values() for w in ws] + [runner.fleet.source_actor]
    fn = lambda self: __import__("rlgraph.runtime.dataplane", fromlist=["x"]).payload_bytes_in_this_process()  # noqa: E731
    return int(sum(ray.get([a.__ray_call__.remote(fn) for a in actors])))


def measure(plan: Any, cls: type, schedule: str, steps: int, plane: Any) -> dict[str, float]:
    from rlgraph.runtime.runner import prepare

    prepare(plan)
    with tempfile.TemporaryDirectory() as tmp:
        with cls(plan, common.quiet_runner_options(Path(tmp), schedule=schedule), plane) as r:
            r.schedule = schedule
            r.step(0, partition="warmup")
            before = worker_bytes(r)
            recs = [r.step(s) for s in range(1, steps + 1)]
            moved = (worker_bytes(r) - before) / steps
    payload = statistics.mean(x["driver/payload_bytes"] for x in recs)
    result = statistics.mean(x["driver/result_bytes"] for x in recs)
    return {"payload": payload, "result": result, "moved": moved, "step_s": statistics.mean(x["timing/step_s"] for x in recs)}


def run(quick: bool = False, argv: list[str] | None = None, **_: Any) -> common.Section:
    import rlgraph
    from rlgraph.graph.compile import compile_pipeline
    from rlgraph.graph.loader import load_pipeline

    from benchmarks import sim

    steps = 1 if quick else 2
    plane = common.plane("transferqueue")
    grpo, ref = load_pipeline(str(common.ROOT / "examples" / "grpo.py"))
    setups = [
        ("GRPO example (4-token answers)", compile_pipeline(grpo, ["trainer.seed=0"], ref)),
        ("simulated GRPO, B=16 n=4 (responses ~340 tokens)",
         rlgraph.compile(sim.pipeline(4, cpus_per_node=8), ["generate.time_scale=0.05", "trainer.seed=1"])),
    ]
    if quick:  # fewer simulated workers: a smoke test
        setups = [("simulated GRPO, B=8 n=2", rlgraph.compile(sim.pipeline(2, 2, 1, cpus_per_node=8), [
            "generate.time_scale=0.05", "trainer.seed=1", "data.batch_size=8", "generate.n=2"]))]
    t = common.Table(["pipeline", "driver", "column bytes moved / step", "driver payload bytes / step",
                      "driver result bytes / step", "driver share of bytes moved", "step s"])
    for label, plan in setups:
        for name, cls, schedule in (("ours (stream)", Runner, "stream"), ("classic (gathers all, sync)", ClassicRunner, "sync")):
            m = measure(plan, cls, schedule, steps, plane)
            share = (m["payload"] + m["result"]) / m["moved"] if m["moved"] else float("nan")
            t.add(label, name, m["moved"], m["payload"], m["result"], f"{100 * share:.2f}%", m["step_s"])
            print(f"  {label} / {name}: moved {m['moved']:.0f} B, driver {m['payload']:.0f}+{m['result']:.0f} B",
                  flush=True)
    t.print()
    intro = """
Per step: column payload bytes put and got by all workers and the source actor (counted in each
process by the data-plane client), against the bytes that went through the driver: column
payload (`driver/payload_bytes`) and the small call results it receives (`driver/result_bytes`:
timing spans, metric records, one float per real row). The classic driver is a benchmark-only
`Runner` subclass (`benchmarks/traffic.py: ClassicRunner`) that fetches every call's input
columns before dispatching it and every call's output columns when it returns, as a trainer
passing `DataProto`s through `ray.get` does. The share is (payload + results) / bytes moved; the classic driver's payload is
about what the workers move, since it reads each column once from its producer and once per consumer.
"""
    return common.Section("traffic", "3. Controller traffic", intro, [t], "",
                          common.command_line(argv if argv is not None else ["traffic"] + (["--quick"] if quick else [])))
