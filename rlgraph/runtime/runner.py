"""Run a plan: the step loop.

One step (docs/runtime.md):

1. create the step's partition; the source actor writes the padded batch's first columns and
   returns row metadata (group ids, padding tags);
2. an event loop: the scheduler (`rlgraph.runtime.scheduler`) hands out calls, the fleet
   (`rlgraph.runtime.fleet`) runs them on the workers, each result goes back to the scheduler
   and into the step's record; workers read and write columns themselves, the driver sees row
   ids and small results;
3. state columns (weights) produced in one group and read in another are synced through Ray;
4. metrics, trace and timeline are written, the partition is cleared; checkpoints
   (`rlgraph.runtime.checkpoint`) and validation run every k steps.

Every wait has a timeout naming what it waited for. Failures are repaired at most
``trainer.max_retries`` times per step, as `repair_for` decides: a call that changes no state
runs again; a dead group that keeps no state is restarted and its calls run again; otherwise
every worker and the source are restored from the latest checkpoint (or restarted from the
initial state when there is none), the steps since then are replayed, and the step runs again.
Ops are seeded per (step, op, chunk), so the result equals that of an undisturbed run.
"""

from __future__ import annotations

import json
import pickle
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlgraph.errors import RLGraphError, StepTimeout, WorkerDiedError
from rlgraph.graph.loader import resolve_impl
from rlgraph.graph.plan import Plan
from rlgraph.runtime.checkpoint import check_compatible, checkpoint_step, latest_checkpoint, read_checkpoint, \
    write_checkpoint
from rlgraph.runtime.fleet import SOURCE, Fleet
from rlgraph.runtime.metrics import MetricsWriter, step_metrics, write_curve_svg
from rlgraph.runtime.progress import Reporter
from rlgraph.runtime.scheduler import Call, Repair, StepScheduler, repair_for
from rlgraph.runtime.trace import Span, write_chrome_trace, write_timeline_svg
from rlgraph.runtime.worker import PartResult

__all__ = ["Fault", "RunOptions", "Runner", "StepTimeout", "WorkerDiedError", "run_plan", "prepare"]


@dataclass(frozen=True)
class Fault:
    """Fault injection (a test hook): break `op`'s call on chunk `chunk` of step `step` (on any rank,
    or on `rank`), `times` times. ``raise``: the call fails before the body runs; ``kill``: the
    worker's process exits before the body runs; ``kill_after``: it exits after writing the outputs."""

    op: str
    step: int
    chunk: int = 0
    kind: str = "raise"
    rank: int | None = None
    times: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("raise", "kill", "kill_after"):
            raise ValueError(f"Fault.kind={self.kind!r}; use raise, kill or kill_after")


@dataclass
class RunOptions:
    """How to run a plan (the CLI's flags)."""

    out_dir: Path = Path("runs/latest")
    steps: int | None = None  # default: the plan's trainer.steps
    schedule: str | None = None  # default: the plan's trainer.schedule
    address: str | None = None
    resume: bool = False
    timeout_s: float = 600.0  # longest wait for any single result
    dataplane: str | None = None  # default: the plan's dataplane.backend
    reporter: Any = None  # a rlgraph.runtime.progress.Reporter; default: none
    on_ray_started: Any = None  # called once Ray is up (the CLI re-installs its signal handlers:
    #                             ray.init replaces the driver's SIGTERM handler with its own)
    max_retries: int | None = None  # default: the plan's trainer.max_retries
    faults: list[Fault] = field(default_factory=list)  # fault injection (tests)


class _Restore(Exception):
    """Internal: the step cannot be repaired in place; restore from a checkpoint and replay."""

    def __init__(self, cause: BaseException, dead: set[str]) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.dead = dead  # groups (or SOURCE) whose actors died


@dataclass
class _Record:
    """What one step's calls returned: the raw material of its metrics."""

    spans: list[Span] = field(default_factory=list)
    summaries: dict[str, dict[int, float]] = field(default_factory=dict)  # column -> row -> value
    op_metrics: dict[str, list[Any]] = field(default_factory=dict)
    batch_values: dict[str, Any] = field(default_factory=dict)  # batch-level data columns, for later calls
    result_bytes: int = 0
    restarts: int = 0  # worker actors restarted


class Runner:
    """Runs a plan's steps on a `Fleet`; use as a context manager (or call `start` and `close`)."""

    def __init__(self, plan: Plan, options: RunOptions, plane: Any = None) -> None:
        """`plane`: an already started data plane to use (and leave running), e.g. a test session's."""
        self.plan = plan
        self.opts = options
        trainer = plan.config.get("trainer", {})
        self.steps = int(options.steps if options.steps is not None else trainer.get("steps", 1))
        self.schedule = options.schedule or trainer.get("schedule", "stream")
        self.val_every = int(trainer.get("val_every", 0))
        self.save_every = int(trainer.get("save_every", 0))
        self.max_retries = int(options.max_retries if options.max_retries is not None
                               else trainer.get("max_retries", 2))
        self.fleet = Fleet(plan, options.timeout_s, options.dataplane, options.address, plane, options.on_ray_started)
        self.reporter: Reporter = options.reporter or Reporter()
        self.all_spans: list[Span] = []
        self.headline = [f"{name}/mean" for name in plan.summaries.values()]
        self._faults = {f: f.times for f in options.faults}
        self._attempts: dict[int, int] = {}  # step -> failures so far
        self._records: dict[int, dict[str, Any]] = {}
        self._run_start = 0

    def __enter__(self) -> Runner:
        self.fleet.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self.fleet.start()

    def close(self) -> None:
        self.fleet.close()

    # ------------------------------------------------------------------ the run
    def run(self) -> list[dict[str, Any]]:
        """Run steps (after the latest checkpoint with ``resume``); returns their metrics records."""
        import ray

        out = Path(self.opts.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        start_step = 0
        if self.opts.resume:
            ckpt = latest_checkpoint(out)
            if ckpt is not None:
                check_compatible(ckpt, self.plan)
                start_step = self._restore(ckpt) + 1
        writer = MetricsWriter(out / "metrics.jsonl", resume_after=start_step - 1 if self.opts.resume else None)
        records = []
        self.reporter.start(self.steps, start_step, self.headline)
        self._run_start = start_step
        try:
            step, pending = start_step, None
            while step < self.steps:
                try:
                    if pending is not None:
                        self._recover(step, out, pending)
                        pending = None
                    record = self.step(step)
                except _Restore as r:  # counted where it was raised
                    pending = r
                    continue
                except ray.exceptions.RayActorError as e:  # an actor died outside an op call
                    self._count_failure(step, e)
                    pending = _Restore(e, set())
                    continue
                record["faults/retries"] = self._attempts.get(step, 0)
                if self.val_every and (step + 1) % self.val_every == 0:
                    record.update(self.validate(step))
                writer.write(record)
                records.append(record)
                self._records[step] = record
                self.reporter.step_done(record)
                if self.save_every and (step + 1) % self.save_every == 0:
                    write_checkpoint(out, step, self.fleet.states(), self.plan)
                step += 1
        finally:
            self.reporter.close()
            self._write_outputs(out)
        return records

    def _write_outputs(self, out: Path) -> None:
        if self.headline:
            all_records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
            write_curve_svg(out / "reward_curve.svg", all_records, key=self.headline[0],
                            title=f"{self.plan.pipeline}: {self.headline[0]} per step")
        if self.all_spans:
            write_chrome_trace(self.all_spans, out / "trace.json")
            write_timeline_svg(self.all_spans, out / "timeline.svg", title=f"{self.plan.pipeline}: {self.schedule} "
                               f"schedule")

    def validate(self, step: int) -> dict[str, Any]:
        """Run the ops that produce the validation columns on the validation split; ``val/...`` metrics."""
        if not self.plan.validation.ops:
            return {}
        m = self.step(step, partition=f"val_{step}", ops=set(self.plan.validation.ops))
        names = set(self.plan.summaries.values())
        return {f"val/{k}": v for k, v in m.items() if k.split("/")[0] in names}

    # ------------------------------------------------------------------ one step
    def step(self, step: int, partition: str | None = None, ops: set[str] | None = None) -> dict[str, Any]:
        """Run one step (all ops, or only `ops`) on its own partition; returns its metrics."""
        from rlgraph.runtime.dataplane import payload_bytes_in_this_process

        # a retried step gets a fresh partition: calls abandoned by the failed attempt may still write
        partition = partition or f"train_{step}" + (f"_retry{self._attempts[step]}" if self._attempts.get(step) else "")
        b = self.plan.batch
        rows = b.padded_batch_warmup if step < b.critic_warmup else b.padded_batch
        t0 = time.time()
        bytes0 = payload_bytes_in_this_process()
        self.fleet.plane.create_partition(partition, rows)
        try:
            uids, is_padding = self.fleet.produce(partition, rows, step * rows, partition.startswith("val"))
            sched = StepScheduler(self.plan, uids, is_padding, step, self.schedule, ops)
            self.reporter.step_started(step, sched.chunk_counts())
            rec = self._run_calls(sched, step, partition)
            t_sync = time.time()
            if ops is None:
                self.fleet.sync_state({name for name, st in sched.ops.items() if not st.skipped})
            t_sync = time.time() - t_sync
        finally:
            self.fleet.plane.clear(partition)
        self.all_spans += rec.spans
        real = sum(1 for p in is_padding if not p)
        summaries = {c: [v for r, v in sorted(vals.items()) if r not in sched.dropped]
                     for c, vals in rec.summaries.items()}
        reasons: dict[str, int] = {}
        for reason, _ in sched.dropped.values():
            reasons[reason] = reasons.get(reason, 0) + 1
        m = step_metrics(step, summaries=summaries, names=self.plan.summaries, op_metrics=rec.op_metrics,
                         spans=rec.spans, wall_s=time.time() - t0, real_rows=real, pad_rows=len(is_padding) - real,
                         dropped=reasons, driver_payload_bytes=payload_bytes_in_this_process() - bytes0,
                         driver_result_bytes=rec.result_bytes, schedule=self.schedule)
        m["faults/restarts"] = rec.restarts
        m["timing/state_sync_s"] = t_sync  # state columns (weights) moved between groups after the step
        return m

    def _run_calls(self, sched: StepScheduler, step: int, partition: str) -> _Record:
        """The event loop of one step: calls out as the scheduler releases them, completions in."""
        import ray

        rec = _Record()
        inflight: dict[Any, Call] = {}
        submit = lambda call: self._submit(call, sched, step, partition, rec, inflight)  # noqa: E731
        while not sched.finished:
            for call in sched.next_calls():
                submit(call)
            if sched.finished:
                break
            if not inflight:
                raise StepTimeout(f"step {step} cannot make progress: nothing is running and nothing is ready; "
                                  f"pending: {sched.unfinished()}")
            done = self.fleet.wait(list(inflight))
            if not done:
                running = sorted({f"{c.chunk.op}[{c.chunk.index}] on {c.group}[{c.rank}]" for c in inflight.values()})
                raise StepTimeout(f"step {step}: no op call finished within {self.opts.timeout_s:g}s; running: "
                                  f"{running}; pending: {sched.unfinished()}")
            for waitable in done:
                call = inflight.pop(waitable)
                try:
                    result = self.fleet.result(waitable, f"{call.chunk.op} on {call.group}[{call.rank}]")
                except (RLGraphError, ray.exceptions.RayError) as e:
                    if isinstance(e, StepTimeout):
                        raise
                    self._repair(step, e, call, inflight, submit, rec)
                    continue
                if isinstance(result, PartResult):  # a streaming call's part: its rows are ready now
                    rec.result_bytes += len(pickle.dumps(result))
                    self._take_summaries(result.summaries, rec)
                    sched.rows_done(call.chunk.op, result.rows)
                    inflight[waitable] = call
                    continue
                self._finish(call, result, sched, rec)
                if sched.call_done(call):
                    self.reporter.chunk_done(step, call.chunk.op)
        return rec

    def _submit(self, call: Call, sched: StepScheduler, step: int, partition: str, rec: _Record,
                inflight: dict[Any, Call]) -> None:
        op = self.plan.op(call.chunk.op)
        batch_inputs = {c: rec.batch_values[c] for c in op.inputs if c in rec.batch_values}
        fault = self._take_fault(call.chunk.op, step, call.chunk.index, call.rank)
        ref = self.fleet.submit(call, step, partition, sched.uids, sched.tags(op.name, call.rows), batch_inputs, fault)
        inflight[ref] = call

    def _finish(self, call: Call, result: Any, sched: StepScheduler, rec: _Record) -> None:
        """Take in a call's small result: span, per-row summaries, drops, metrics, batch values."""
        rec.result_bytes += len(pickle.dumps(result))
        rec.spans.append(result.span)
        self._take_summaries(result.summaries, rec)
        for row, (reason, whole_group) in result.dropped.items():
            sched.drop(row, reason, call.chunk.op, whole_group)
        if result.metrics:
            rec.op_metrics.setdefault(call.chunk.op, []).append(result.metrics)
        rec.batch_values.update(result.batch_values)

    @staticmethod
    def _take_summaries(summaries: dict[str, dict[int, float]], rec: _Record) -> None:
        for col, vals in summaries.items():
            rec.summaries.setdefault(col, {}).update(vals)

    # ------------------------------------------------------------------ failures
    def _take_fault(self, op: str, step: int, chunk: int, rank: int) -> str | None:
        for f, left in self._faults.items():
            if left > 0 and (f.op, f.step, f.chunk) == (op, step, chunk) and f.rank in (None, rank):
                self._faults[f] = left - 1
                return f.kind
        return None

    def _count_failure(self, step: int, e: BaseException) -> None:
        """Record a failure of `step`; past trainer.max_retries, raise it (as what it is) for good."""
        n = self._attempts[step] = self._attempts.get(step, 0) + 1
        if n > self.max_retries:
            msg = (f"{e}\n(step {step} failed {n} times; gave up after trainer.max_retries={self.max_retries} "
                   f"retries. Fix the cause above, or raise trainer.max_retries if the failures are transient)")
            if isinstance(e, RLGraphError):
                raise type(e)(msg) from None
            raise RLGraphError(f"{type(e).__name__}: {msg}") from None

    def _repair(self, step: int, e: BaseException, call: Call, inflight: dict[Any, Call], submit: Any,
                rec: _Record) -> None:
        """A call failed: mend it as `repair_for` says, or abort the step for a restore."""
        import ray

        died = isinstance(e, ray.exceptions.RayActorError)
        if died:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            e = WorkerDiedError(f"worker {call.group}[{call.rank}] died while running op {call.chunk.op!r} at step "
                                f"{step} (chunk {call.chunk.index}, {len(call.rows)} rows): {type(e).__name__}: "
                                f"{first} (its log is under /tmp/ray/session_latest/logs)")
        self._count_failure(step, e)
        action = repair_for(self.plan, call.chunk.op, died, self.fleet.stateful[call.group])
        if action is Repair.RESTORE:
            raise _Restore(e, {call.group} if died else set())
        lost = [call]
        if action is Repair.RESTART_GROUP:  # then run again what the group had in flight
            lost += [inflight.pop(ref) for ref in [r for r, c in inflight.items() if c.group == call.group]]
            rec.restarts += self.fleet.restart([call.group])
        for c in lost:
            submit(c)

    def _recover(self, step: int, out: Path, r: _Restore) -> None:
        """Restore every worker and the source to the latest checkpoint (or the initial state) and
        replay the steps since then, so that `step` can run again as if nothing had happened."""
        dead = self.fleet.dead() | r.dead
        ckpt = latest_checkpoint(out)
        if ckpt is not None and checkpoint_step(ckpt) >= step:  # written by a later attempt: not ours
            ckpt = None
        # nothing saved: back to the state the run started from, every group
        self.fleet.restart(list(self.fleet.workers) if ckpt is None else [g for g in dead if g in self.fleet.workers])
        if SOURCE in dead:
            self.fleet.restart_source()
        if ckpt is not None:
            replay_from = self._restore(ckpt) + 1
        else:
            if self._run_start != 0:
                raise RLGraphError(f"step {step} failed ({r.cause}) and there is no checkpoint to restore "
                                   f"from in {out}; set trainer.save_every to make runs recoverable")
            self.fleet.rewind_source()
            replay_from = 0
        spans = len(self.all_spans)
        for s in range(replay_from, step):  # same seeds, same data: the same state as before the failure
            again, before = self.step(s), self._records.get(s, {})
            changed = [k for k in self.headline if k in before and again.get(k) != before[k]]
            if changed:
                warnings.warn(f"replayed step {s} gave {changed[0]}={again.get(changed[0])}, the first run "
                              f"{before[changed[0]]}: the ops are not deterministic", stacklevel=2)
        del self.all_spans[spans:]

    def _restore(self, ckpt: Path) -> int:
        step, states = read_checkpoint(ckpt, self.fleet.state_names())
        self.fleet.load_states(states, f"restoring checkpoint {ckpt}")
        return step


def prepare(plan: Plan) -> None:
    """Call the pipeline's prepare hook (local assets such as data sets and tiny models)."""
    if plan.prepare:
        fn, _ = resolve_impl(plan.prepare, plan.prepare_file)
        fn(plan.config)


def run_plan(plan: Plan, options: RunOptions, plane: Any = None) -> list[dict[str, Any]]:
    """Prepare, start everything, run the steps, stop everything. Returns the per-step metrics."""
    prepare(plan)
    with Runner(plan, options, plane) as runner:  # stops everything it started, also on Ctrl-C
        return runner.run()
