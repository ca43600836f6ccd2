"""Item 6: compile time and plan size for large graphs and dp; scheduler overhead per op call.

Synthetic pipelines of N ops (`OpSpec`s written out, never run): op i reads the outputs of
ops i-1 and i//2 (a deep chain with long skip edges), per sample with micro-batches of 16 rows, every
fifth op per group, the last op a barrier; ops spread over 8 worker groups. The dp sweep compiles a
10-op graph whose first group has dp workers.

Scheduler overhead: the driver's bookkeeping for one step with the runtime's `StepScheduler`,
replaying the runner's event loop without Ray (after each completion: `next_calls()`, then
`call_done` of the oldest running call), with the plan's workers (one call per rank at a time).
Per op call = loop time / calls; large plans stop after a time budget (the calls done so far are the
measured ones).
"""

from __future__ import annotations

import math
import time
from typing import Any

from benchmarks import common

GROUPS = 8
ROWS = 256  # samples per step: 64 prompts x n=4


def synthetic(num_ops: int, dp: int = 1) -> tuple[Any, list[str]]:
    from rlgraph import Batching, Cluster, DataSource, OpSpec, Param, Pipeline, T, WorkerGroup

    col = T.float32()
    ops = []
    read: set[str] = set()
    for i in range(num_ops):
        srcs = sorted({f"x{i}", f"x{i // 2}"}) if i else ["x0"]
        read.update(srcs)
        last = i == num_ops - 1
        if i == 0:  # the generator: per group, declares n
            gran, params = "group", {"micro_batch_size": Param(int, 4, "prompts per call"),
                                     "n": Param(int, 4, "samples per prompt")}
        elif last:
            gran, params = "batch", {}
        else:
            gran = "group" if i % 5 == 4 else "sample"
            params = {"micro_batch_size": Param(int, 16 if gran == "sample" else 4, "rows per call")}
        ops.append(OpSpec(
            name=f"op{i}", inputs={s: col for s in srcs}, outputs={f"x{i + 1}": col}, granularity=gran,
            group=f"g{i % GROUPS}", impl="benchmarks.scale:never_run", params=params,
            batching=Batching(micro_batch="micro_batch_size") if params else None,
            group_size_param="n" if i == 0 else None,
        ))
    outputs = [f"x{i + 1}" for i in range(num_ops) if f"x{i + 1}" not in read]
    groups = [WorkerGroup(f"g{k}", dp=dp if k == 0 else 1, num_cpus=1) for k in range(min(GROUPS, num_ops))]
    nodes = math.ceil((dp + GROUPS + 2) / 64)
    pipe = Pipeline(name=f"synthetic{num_ops}", source=DataSource(columns={"x0": T.float32()},
                                                                  impl="benchmarks.scale:NeverRun"),
                    ops=ops, groups=groups, outputs=outputs,
                    cluster=Cluster(num_nodes=nodes, cpus_per_node=64, gpus_per_node=0),
                    config={"data": {"batch_size": 64}})
    return pipe, []


def never_run(*args: Any, **kw: Any) -> None:  # pragma: no cover - the synthetic ops are never called
    raise RuntimeError("synthetic benchmark op")


def scheduler_overhead(plan: Any, budget_s: float) -> tuple[float, int, int, float]:
    """(seconds per op call, calls measured, calls in the step, scheduler construction seconds)."""
    from collections import deque

    from rlgraph.runtime.scheduler import StepScheduler

    b = plan.batch
    uids = [p for p in range(b.batch_size) for _ in range(b.n)] + list(range(b.batch_size, b.batch_size + b.pad_rows))
    padding = [False] * (b.batch_size * b.n) + [True] * b.pad_rows
    t0 = time.perf_counter()
    sched = StepScheduler(plan, uids, padding, step=0, schedule="stream")
    t_build = time.perf_counter() - t0
    total = sum(sched.chunk_counts().values())
    running: deque[Any] = deque()
    done = 0
    t0 = time.perf_counter()
    while not sched.finished:
        running.extend(sched.next_calls())
        if not running:
            raise RuntimeError("synthetic step cannot progress")
        sched.call_done(running.popleft())
        done += 1
        if time.perf_counter() - t0 > budget_s:
            break
    return (time.perf_counter() - t0) / max(done, 1), done, total, t_build


def _time_compile(pipe: Any, repeats: int) -> tuple[float, Any]:
    from rlgraph.graph.compile import compile_pipeline

    best, plan = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = compile_pipeline(pipe)
        best = min(best, time.perf_counter() - t0)
    return best, plan


def run(quick: bool = False, argv: list[str] | None = None, **_: Any) -> common.Section:
    sizes = [10, 30] if quick else [10, 30, 100, 300, 1000]
    dps = [1, 64] if quick else [1, 8, 64, 256, 1024]
    budget = 0.5 if quick else 5.0
    t1 = common.Table(["ops", "dp (first group)", "compile s", "plan JSON KB", "columns", "edges",
                       "op calls / step", "calls measured", "scheduler µs / op call", "scheduler build ms"])
    for n_ops in sizes:
        pipe, _ = synthetic(n_ops)
        secs, plan = _time_compile(pipe, 1 if n_ops >= 300 else 3)
        per, done, total, build = scheduler_overhead(plan, budget)
        t1.add(n_ops, 1, secs, len(plan.to_json()) / 1024, len(plan.columns), len(plan.edges), total, done,
               1e6 * per, 1000 * build)
        print(f"  {n_ops} ops: compile {secs:.2f}s, {1e6 * per:.0f} µs/call", flush=True)
    for dp in dps:
        pipe, _ = synthetic(10, dp)
        secs, plan = _time_compile(pipe, 3)
        per, done, total, build = scheduler_overhead(plan, budget)
        t1.add(10, dp, secs, len(plan.to_json()) / 1024, len(plan.columns), len(plan.edges), total, done,
               1e6 * per, 1000 * build)
        print(f"  dp {dp}: compile {secs:.2f}s, {1e6 * per:.0f} µs/call", flush=True)
    t1.print()
    intro = f"""
Compile time (best of up to 3; `rlgraph.compile`: build, check, prune, batch, schedule, place)
and the size of the plan's JSON, for synthetic pipelines of 10 to {sizes[-1]} ops on 8 worker
groups ({ROWS} samples per step, 16 rows per streaming call), and for a 10-op pipeline whose first
group has up to {dps[-1]} workers (the padded batch grows to a multiple of dp). Scheduler overhead:
the driver's per-step bookkeeping and dispatch (`rlgraph.runtime.scheduler.StepScheduler`) replayed as
the runner's event loop drives it, without Ray: time per op call (stopped after {budget:g} s for large
plans; the measured calls are the first ones, when the most chunks are pending).
"""
    return common.Section("scale", "6. Scale: compile time, plan size, scheduler overhead", intro, [t1], "",
                          common.command_line(argv if argv is not None else ["scale"] + (["--quick"] if quick else [])))
