"""Item 8: asynchronous training: the rollout runs up to k steps ahead of the update.

Three measurements, side by side in one run:

1. The simulated cluster (`benchmarks.sim`: GRPO-shaped, long-tailed response lengths, disjoint
   pools) under `sync`, `stream` (k=0), k=1 and k=2, replayed by the runtime's own scheduler and
   cross-step window (`sim.simulate_steps`: `StepScheduler` + `Window`, zero overhead) over the
   same draws: step throughput relative to `sync`, idle fraction per pool, staleness.
2. The same simulated cluster run by the real runtime (Ray actors that sleep for the modelled
   time, TransferQueue columns, weight syncs through Ray) at `sync` and k=1: does the replay's
   ratio hold with the runtime's overheads?
3. The real CPU example `examples/grpo_async.py` at k=0 and k=1 from the same warm start and seed:
   wall time, and reward reached per wall-clock second (faster steps that learn less are no gain).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import common, sim

MODES = (("sync", "sync", 0), ("stream", "stream", 0), ("k=1", "stream", 1), ("k=2", "stream", 2))


@dataclass(frozen=True)
class Config:
    label: str
    sigma: float = 0.75
    pools: int = 4
    streaming: bool = False

    def overrides(self, k: int, time_scale: float = 1.0) -> list[str]:
        return [f"generate.sigma={self.sigma}", "trainer.seed=1", f"trainer.max_staleness={k}",
                f"generate.time_scale={time_scale}"]


def configs(quick: bool) -> list[Config]:
    heavy = Config("σ=1.25 (heavy tail), per-group streaming", sigma=1.25, streaming=True)
    if quick:
        return [heavy]
    return [Config("base (B=16 n=4 σ=0.75)"), Config("σ=1.25 (heavy tail)", sigma=1.25), heavy,
            Config("σ=1.25, per-group streaming, 2 pools", sigma=1.25, pools=2, streaming=True)]


def _plan(cfg: Config, k: int, time_scale: float = 1.0) -> Any:
    import rlgraph

    return rlgraph.compile(sim.pipeline(pools=cfg.pools, streaming=cfg.streaming), cfg.overrides(k, time_scale))


def simulated(quick: bool, steps: int) -> common.Table:
    t = common.Table(["configuration", "mode", "s/step", "throughput / sync", "idle rollout", "idle train",
                      "staleness (steps: count)"])
    for cfg in configs(quick):
        base = None
        for label, schedule, k in MODES:
            r = sim.simulate_steps(_plan(cfg, k), steps, schedule)
            per = r["makespan"] / steps
            base = base or per
            counts = {s: r["staleness"].count(s) for s in sorted(set(r["staleness"]))}
            t.add(cfg.label, label, per, base / per, r["idle"]["rollout"], r["idle"]["train"],
                  ", ".join(f"{s}: {n}" for s, n in counts.items()))
    return t


def on_runtime(quick: bool, steps: int) -> common.Table:
    """The heavy-tail configuration on the real runtime (sleeping actors) at sync and k=1."""
    from rlgraph.runtime.runner import Runner

    cfg = configs(True)[0]
    scale = 0.1 if quick else 0.25
    plane = common.plane("transferqueue")
    t = common.Table(["configuration", "mode", "steps", "wall s/step", "replay s/step", "throughput / sync",
                      "replay throughput / sync"])
    base = base_replay = None
    for label, schedule, k in (MODES[0], MODES[2]):
        plan = _plan(cfg, k, scale)
        replay = sim.simulate_steps(plan, steps, schedule)["makespan"] / steps
        with tempfile.TemporaryDirectory() as tmp:
            with Runner(plan, common.quiet_runner_options(Path(tmp), steps=steps, schedule=schedule), plane) as r:
                r.step(0, partition="warmup")  # connections, imports: not measured
                t0 = time.time()
                r.run()
                wall = (time.time() - t0) / steps
        base, base_replay = base or wall, base_replay or replay
        t.add(cfg.label + f", time x{scale}", label, steps, wall, replay, base / wall, base_replay / replay)
        print(f"  runtime {label}: {wall:.3f} s/step (replay {replay:.3f})", flush=True)
    return t


def real_example(steps: int, plane: Any, k: int) -> dict[str, Any]:
    from rlgraph.graph.compile import compile_pipeline
    from rlgraph.graph.loader import load_pipeline
    from rlgraph.runtime.runner import Runner, prepare

    pipeline, ref = load_pipeline(str(common.ROOT / "examples" / "grpo_async.py"))
    plan = compile_pipeline(pipeline, ["trainer.seed=0", f"trainer.max_staleness={k}"], ref)
    prepare(plan)
    with tempfile.TemporaryDirectory() as tmp:
        with Runner(plan, common.quiet_runner_options(Path(tmp), steps=steps), plane) as r:
            t0 = time.time()
            records = r.run()
            wall = time.time() - t0
    return {"records": records, "wall": wall}


def real(quick: bool, steps: int) -> common.Table:
    plane = common.plane("transferqueue")
    window = min(10, max(1, steps // 3))
    t = common.Table(["example", "k", "steps", "wall s", "s/step", "k=0 wall / this", f"reward first {window}",
                      f"reward last {window}", "gain", "gain per minute", "staleness max"])
    base = None
    for k in (0, 1):
        run = real_example(steps, plane, k)
        scores = [r.get("score/mean", 0.0) for r in run["records"]]
        first, last = statistics.mean(scores[:window]), statistics.mean(scores[-window:])
        base = base or run["wall"]
        stale = max(r.get("update_actor/actor_metrics/staleness_max", 0.0) for r in run["records"])
        t.add("grpo_async", k, steps, run["wall"], run["wall"] / steps, base / run["wall"], first, last, last - first,
              (last - first) / (run["wall"] / 60), stale)
        print(f"  grpo_async k={k}: {run['wall']:.0f}s, reward {first:.3f} -> {last:.3f}", flush=True)
    return t


def run(quick: bool = False, steps: int | None = None, argv: list[str] | None = None, **_: Any) -> common.Section:
    sim_steps = 4 if quick else 24
    runtime_steps = 3 if quick else 12
    real_steps = steps or (2 if quick else 120)
    tables = [simulated(quick, sim_steps), on_runtime(quick, runtime_steps), real(quick, real_steps)]
    for t in tables:
        t.print()
    intro = f"""
`trainer.max_staleness = k` keeps k+1 steps in flight: step t+1's prompts are generated while
step t is scored and trained, by a policy at most k updates older than the trained one
(docs/runtime.md). First table: the simulated cluster of section 1 ({sim_steps} steps, the same
response-length draws in every mode), replayed by the runtime's own scheduler and cross-step
window with zero overhead; "idle" is the share of the pool's slot-time with no call; staleness
counts steps by how many updates their rollout policy was behind (step 0 always reads the
initial weights). Second table: the heavy-tail configuration on the real runtime (Ray actors
sleeping for the modelled time, TransferQueue, weight syncs) at `sync` and k=1, {runtime_steps}
steps after one warm-up step, next to the replay of the same steps. Third table: the real CPU
example `examples/grpo_async.py` ({real_steps} steps, same warm start and seed) at k=0 and k=1;
"gain" is the mean reward of the last steps minus that of the first ones, per minute of wall
time (start-up excluded).
"""
    outro = """
Reading: on the simulated cluster, running one step ahead hides the update (and the scoring)
behind the next step's generation; k=2 adds little once generation is the busiest pool. On this
2-core machine the real example's rollout and update compete for the same cores, so the wall-clock
gain there is bounded by the idle time of k=0, not by pool parallelism, and the k=1 policy trains
on samples one update old (decoupled PPO corrects the ratio).
"""
    return common.Section("staleness", "8. Asynchronous training: rollout ahead of the update", intro, tables, outro,
                          common.command_line(argv if argv is not None else ["staleness"]
                                              + (["--quick"] if quick else [])))
