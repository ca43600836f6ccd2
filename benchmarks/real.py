"""Item 2: the PPO and GRPO examples on CPU under `stream` and `sync`, same seeds.

Each (example, schedule) is a fresh run of N steps from the same warm-started model and seed;
the two schedules make the same op calls on the same rows, so their rewards agree step by step
and only the time differs. The reward target is relative (short runs): the first step at which
the 10-step moving average of the mean reward is `TARGET_GAIN` above the mean of the first 10
steps; time to target is the wall time of the steps up to it.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common

TARGET_GAIN = 0.05
WINDOW = 10


def run_example(name: str, schedule: str, steps: int, plane: Any) -> dict[str, Any]:
    from rlgraph.graph.loader import load_pipeline
    from rlgraph.graph.compile import compile_pipeline
    from rlgraph.runtime.runner import Runner, prepare

    pipeline, ref = load_pipeline(str(common.ROOT / "examples" / f"{name}.py"))
    plan = compile_pipeline(pipeline, ["trainer.seed=0", f"trainer.schedule={schedule}"], ref)
    prepare(plan)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        with Runner(plan, common.quiet_runner_options(Path(tmp), steps=steps, schedule=schedule), plane) as r:
            start_s = time.time() - t0
            records = r.run()
    return {"records": records, "start_s": start_s}


def time_to_target(records: list[dict[str, Any]], target: float) -> tuple[int | None, float | None]:
    scores = [r.get("score/mean", 0.0) for r in records]
    elapsed = 0.0
    for k, r in enumerate(records):
        elapsed += r["timing/step_s"]
        if k + 1 >= WINDOW and statistics.mean(scores[k + 1 - WINDOW:k + 1]) >= target:
            return k, elapsed
    return None, None


def run(quick: bool = False, steps: int | None = None, argv: list[str] | None = None, **_: Any) -> common.Section:
    steps = steps or (1 if quick else 40)
    plane = common.plane("transferqueue")
    t = common.Table(["example", "steps", "stream s/step", "sync s/step", "sync / stream", "same rewards",
                      "reward first 10", "reward last 10", "target", "step reached", "stream time to target s",
                      "sync time to target s"])
    for name in (("grpo",) if quick else ("grpo", "ppo")):
        runs = {s: run_example(name, s, steps, plane) for s in ("stream", "sync")}
        st, sy = runs["stream"]["records"], runs["sync"]["records"]
        skip = 1 if len(st) > 2 else 0  # the first step pays for connections and lazy imports
        per = {s: statistics.mean(r["timing/step_s"] for r in runs[s]["records"][skip:]) for s in runs}
        same = all(abs(a.get("score/mean", 0) - b.get("score/mean", 0)) < 1e-9 for a, b in zip(st, sy))
        first = statistics.mean(r.get("score/mean", 0.0) for r in st[:WINDOW])
        last = statistics.mean(r.get("score/mean", 0.0) for r in st[-WINDOW:])
        target = first + TARGET_GAIN
        k, t_st = time_to_target(st, target)
        _, t_sy = time_to_target(sy, target)
        t.add(name.upper(), len(st), per["stream"], per["sync"], per["sync"] / per["stream"], same, first, last,
              target, "not reached" if k is None else k, float("nan") if t_st is None else t_st,
              float("nan") if t_sy is None else t_sy)
        print(f"  {name}: stream {per['stream']:.2f}s/step sync {per['sync']:.2f}s/step", flush=True)
    t.print()
    intro = f"""
The bundled examples (`examples/grpo.py`: 16 prompts x 8 samples; `examples/ppo.py`: 32 x 4,
with a critic) trained on CPU by the real stack (tiny Qwen2-style model, HF generation, torch
updates, TransferQueue), {steps} steps per run, one run per schedule from the same warm start
and `trainer.seed=0`. Step times are means over the steps after the first. The target is
relative because the runs are short: the 10-step moving average of the mean reward reaching
the mean of the first 10 steps + {TARGET_GAIN}; time to target sums the step times up to it
(start-up excluded). "same rewards": the per-step mean rewards of the two runs are identical.

On this machine every op competes for the same 2 cores, so overlapping stages cannot make the
work itself faster: the gain of `stream` here is bounded by the idle time of `sync` (waits between
stages, data-plane round trips), not by pool parallelism; the simulated cluster above measures that.
"""
    return common.Section("real", "2. Real CPU runs: the examples", intro, [t], "",
                          common.command_line(argv if argv is not None else ["real"] + (["--quick"] if quick else [])))
