"""Run a plan: the step loop, and only the order of things (docs/runtime.md).

A training step: create its partition and have the source fill it (`admit`; with dynamic
sampling, `rlgraph.runtime.refill` first runs its generation rounds); then one event loop
(`_events`) hands the scheduler's calls to the fleet's workers, takes their small results back,
and moves weights between groups as the window asks (`rlgraph.runtime.weights`); a finished
step's record is built by `rlgraph.runtime.metrics`, validation and checkpoints run every k
steps, and a failure goes to `rlgraph.runtime.recovery` (repair in place, or restore and replay).

With ``trainer.max_staleness = k`` the same loop keeps up to k+1 steps in flight (and one more
admitted ahead); `rlgraph.runtime.window` fixes which weights every read sees, so results never
depend on timing. Validation and checkpoints drain the window. Every wait has a timeout.
"""

from __future__ import annotations

import json
import time
import warnings
from collections import deque
from pathlib import Path
from typing import Any, Callable

from rlgraph.errors import RLGraphError, StepTimeout, WorkerDiedError
from rlgraph.graph.loader import resolve_impl
from rlgraph.graph.plan import Plan
from rlgraph.graph.settings import TrainerSettings
from rlgraph.runtime import admission
from rlgraph.runtime.checkpoint import check_compatible, resume_checkpoint, write_checkpoint
from rlgraph.runtime.dataplane.errors import DataPlaneDied
from rlgraph.runtime.fleet import PLANE, Fleet
from rlgraph.runtime.metrics import IdleClock, MetricsWriter, step_record
from rlgraph.runtime.options import RunOptions
from rlgraph.runtime.plots import write_run_charts
from rlgraph.runtime.recovery import Fault, Recovery, Restore, plane_lost
from rlgraph.runtime.refill import Refiller
from rlgraph.runtime.reporter import Reporter
from rlgraph.runtime.rundir import check_run_dir
from rlgraph.runtime.scheduler import Call, Slots
from rlgraph.runtime.step import VALIDATE, LiveStep, StepKey, describe_inflight
from rlgraph.runtime.trace import Span
from rlgraph.runtime.weights import VERSIONS, WeightMover
from rlgraph.runtime.window import Window
from rlgraph.runtime.actor import PartResult

__all__ = ["Fault", "RunOptions", "Runner", "StepTimeout", "WorkerDiedError", "run_plan", "prepare"]


class Runner:
    """Runs a plan's steps on a `Fleet`; use as a context manager (or call `start` and `close`)."""

    def __init__(self, plan: Plan, options: RunOptions, plane: Any = None) -> None:
        """`plane`: an already started data plane to use (and leave running), e.g. a test session's."""
        self.plan, self.opts = plan, options
        trainer = TrainerSettings.of(plan)
        self.steps = options.steps if options.steps is not None else trainer.steps
        self.schedule = options.schedule or trainer.schedule
        self.val_every, self.save_every, self.keep = trainer.val_every, trainer.save_every, trainer.keep_checkpoints
        # in flight: k+1 steps, and one admitted ahead (held by the window's gates) unless admitting runs rounds
        self.depth = trainer.max_staleness + (1 if plan.refill is not None else 2)
        self.max_retries = options.max_retries if options.max_retries is not None else trainer.max_retries
        self.reporter: Reporter = options.reporter or Reporter()
        self.fleet = Fleet(plan, options.timeout_s, options.dataplane, options.address, plane, options.on_ray_started,
                           options.verbose, on_phase=lambda message: self.reporter.phase(message),
                           inject_faults=bool(options.faults), ray_handle=options.ray, checks=options.checks)
        self._spans: deque[list[Span]] = deque(maxlen=options.trace_steps or None)  # per step, the latest
        self.written = 0  # steps whose records this run wrote
        self.headline = [f"{name}/mean" for name in plan.summaries.values()]
        self._heads: dict[int, dict[str, Any]] = {}  # step -> its headline metrics, to check a replay against
        self._run_start = self._next = 0  # _next: the first step not written yet (earlier ones are replays)
        self._last_end = 0.0  # when the latest training step ended
        self.slots = Slots(plan)
        self.idle = IdleClock()
        self.refiller = Refiller(self) if plan.refill is not None else None
        self.window: Window | None = None  # these three: made once the fleet knows which groups keep state
        self.weights: WeightMover | None = None
        self.recovery: Recovery | None = None

    def __enter__(self) -> Runner:
        self.fleet.__enter__()
        self._started()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.fleet.close(graceful=exc_type is None)  # a failed or interrupted run's calls may still be running

    def start(self) -> None:
        self.fleet.start()
        self._started()

    def _started(self) -> None:
        self.window = Window(self.plan, self.fleet.stateful)
        self.weights = WeightMover(self.plan, self.fleet, self.window)
        self.recovery = Recovery(self.plan, self.fleet, self.weights, self.reporter, self.max_retries, self.opts.faults)

    def close(self) -> None:
        self.fleet.close()
    # ------------------------------------------------------------------ the run
    def run(self) -> list[dict[str, Any]]:
        """Run steps (after the latest checkpoint with ``resume``); returns their metrics records."""
        import ray

        check_run_dir(out := Path(self.opts.out_dir), resume=self.opts.resume, overwrite=self.opts.overwrite)
        (out / "placement.json").write_text(json.dumps(self.fleet.placement(), indent=1) + "\n")
        start_step = 0
        if self.opts.resume and (ckpt := resume_checkpoint(out, self.opts.fallback)) is not None:
            check_compatible(ckpt, self.plan)
            start_step = self.recovery.restore(ckpt) + 1
        writer = MetricsWriter(out / "metrics.jsonl", resume_after=start_step - 1 if self.opts.resume else None)
        records: list[dict[str, Any]] = []
        self._run_start = self._next = start_step
        error: BaseException | None = None  # what the run ends on, for the trackers' run status
        try:
            self.reporter.start(self.steps, start_step, self.headline)
            first, pending = start_step, None
            while self._next < self.steps:
                try:
                    if pending is not None:
                        first = self.recovery.recover(self._next, out, pending, self._run_start)
                        self.idle.clear()
                        pending = None
                    self._drive(first, lambda lv: self._step_done(lv, out, writer, records))
                except Restore as r:  # counted where it was raised
                    pending = r
                except DataPlaneDied as e:  # seen by a wait's watch, or by a call of the driver's own
                    self._abandon()
                    self.recovery.count(self._next, e)
                    pending = Restore(e, {PLANE})
                except ray.exceptions.RayActorError as e:  # an actor died outside an op call
                    self._abandon()
                    pending = self.recovery.actor_died_outside(self._next, e)
        except BaseException as e:
            error = e
            raise
        finally:
            writer.sync()
            self.reporter.close(error)
            ahead = f", up to {self.depth - 1} steps in flight" if self.depth > 2 else ""
            write_run_charts(out, self.plan.pipeline, self.headline, self.all_spans, f"{self.schedule} schedule{ahead}")
        return records

    def _step_done(self, lv: LiveStep, out: Path, writer: MetricsWriter, records: list[dict[str, Any]]) -> None:
        """A training step finished (steps finish in order): write it, or check a replayed one."""
        step = lv.step
        if step < self._next:  # replayed after a restore: same seeds, same data, same state
            record, before = step_record(lv, self.plan, self.schedule, self.idle), self._heads.get(step, {})
            changed = [k for k in self.headline if k in before and record.get(k) != before[k]]
            if changed:
                warnings.warn(f"replayed step {step} gave {changed[0]}={record.get(changed[0])}, the first run "
                              f"{before[changed[0]]}: the ops are not deterministic", stacklevel=2)
            return
        self._spans.append(list(lv.rec.spans))
        val = self.validate(step) if self.val_every and (step + 1) % self.val_every == 0 else None
        record = step_record(lv, self.plan, self.schedule, self.idle, retries=self.recovery.attempts.get(step, 0),
                             restarts=self.recovery.take_restarts(), validation=val)
        writer.write(record)
        self.written += 1
        if self.opts.keep_records:
            records.append(record)
        self._heads[step] = {k: record[k] for k in self.headline if k in record}
        # written: a failure from here on (the checkpoint gathers every actor's state) replays it unwritten
        self._next = step + 1
        self.reporter.step_done(record)
        if self.save_every and (step + 1) % self.save_every == 0:
            self.reporter.checkpoint(step)  # a resume starts after it: the trackers must have it all
            writer.sync()  # and metrics.jsonl's lines up to it are on disk before it is
            states = self.fleet.states()
            states[VERSIONS] = self.weights.checkpoint_entry()  # versions later steps still read
            write_checkpoint(out, step, states, self.plan, keep=self.keep)
            for done in [k for k in self._heads if k <= step]:  # a restore replays only steps after it
                del self._heads[done]

    @property
    def all_spans(self) -> list[Span]:
        """The op-call spans kept for the trace: those of the last `trace_steps` steps."""
        return [span for step in self._spans for span in step]

    def _drains(self, step: int) -> bool:
        """Whether nothing of a later step may start before `step` ends (validation, checkpoint)."""
        return step >= self._next and bool((self.val_every and (step + 1) % self.val_every == 0)
                                           or (self.save_every and (step + 1) % self.save_every == 0))

    def validate(self, step: int) -> dict[str, Any] | None:
        """Run the validation ops on the validation split with `step`'s weights; its record (None: none)."""
        if not self.plan.validation.ops:
            return None
        lv = self.admit(StepKey(step, VALIDATE), partition=f"val_{step}", ops=set(self.plan.validation.ops),
                        reads=step)
        self.run_alone(lv)
        if self._spans:  # validation calls show in the trace and timeline too, with their step's
            self._spans[-1].extend(lv.rec.spans)
        else:
            self._spans.append(list(lv.rec.spans))
        return step_record(lv, self.plan, self.schedule)

    def step(self, step: int, partition: str | None = None, ops: set[str] | None = None) -> dict[str, Any]:
        """Run one step (all ops, or only `ops`) on its own partition, alone; returns its record."""
        self.window.first = step
        lv = self.admit(StepKey(step), partition=partition, ops=ops)
        self.run_alone(lv)
        return step_record(lv, self.plan, self.schedule, self.idle)

    def run_alone(self, lv: LiveStep) -> None:
        """Run admitted step `lv` with nothing else in flight."""
        self._events({lv.key: lv}, lambda live, inflight: None, lambda done: None)

    # ------------------------------------------------------------------ steps in flight
    def _drive(self, first: int, on_done: Callable[[LiveStep], None]) -> None:
        """Run steps `first` .. the last, up to `depth` in flight; `on_done(step)` in step order."""
        self.window.first = first
        upcoming = iter(range(first, self.steps))
        nxt = next(upcoming, None)

        def admit_more(live: dict[StepKey, LiveStep], inflight: dict[Any, Any]) -> None:
            # one admission at a time (steps enter the window in order); the source's call runs while
            # the loop goes on: on 64 rows it is 2.4 ms the driver no longer waits, on 4,096 rows 16
            nonlocal nxt
            while nxt is not None and len(live) < self.depth and not any(self._drains(lv.step) for lv in live.values()) \
                    and not admission.pending(inflight):
                begun = admission.begin(self, StepKey(nxt))
                if isinstance(begun, LiveStep):  # dynamic sampling: its rounds ran
                    live[begun.key] = begun
                else:
                    inflight[begun.ref] = ("admit", begun)
                nxt = next(upcoming, None)

        self._events({}, admit_more, on_done)

    def admit(self, key: StepKey, partition: str | None = None, ops: set[str] | None = None,
              uid_start: int | None = None, reads: int | None = None) -> LiveStep:
        """Create the partition of the step at `key`, have the source fill it, and put its scheduler
        in the window. `ops`: only these (validation, refill rounds); `reads`: the producer step every
        state read sees, instead of the per-op rule."""
        begun = admission.begin(self, key, partition, ops, uid_start, reads)
        return begun if isinstance(begun, LiveStep) else admission.admitted(self, begun)

    def _events(self, live: dict[StepKey, LiveStep], admit_more: Callable[[dict[StepKey, LiveStep], dict], None],
                on_done: Callable[[LiveStep], None]) -> None:
        """The event loop: admit steps, open the cross-step gates, hand out calls, take results in,
        and finish steps in order. A failure that needs a restore abandons every step in flight."""
        import ray

        inflight: dict[Any, Any] = {}  # waitable -> (step key, Call), ("sync", column, group) or ("admit", Admission)
        # an ended step's partition is cleared once the calls after the next wait are out (performance.md, 12)
        ended: list[str] = []  # since the last wait
        clear_now: list[str] = []
        try:
            while True:
                admit_more(live, inflight)
                sent = True  # the oldest step first; a call just sent may let a later step's queue behind it
                while sent:
                    self.weights.open_gates(live, inflight)
                    sent = [self._submit(c, live[k], inflight) for k in sorted(live) for c in live[k].sched.next_calls()]
                self.fleet.clear_all(clear_now)
                finished = list(self.window.pop_done())
                for key in finished:
                    lv = live.pop(key)
                    if not lv.keep:
                        ended.append(lv.partition)
                    on_done(self._finished(lv))
                if finished:
                    continue
                if not live and not admission.pending(inflight):
                    self.fleet.clear_all(ended)
                    return
                pending = lambda: {str(lv.key): lv.sched.unfinished() for lv in live.values()}  # noqa: E731
                if not inflight:
                    raise StepTimeout(f"steps {sorted(lv.step for lv in live.values())} cannot make progress: "
                                      f"nothing is running and nothing is ready; pending: {pending()}")
                clear_now, ended = ended, []
                done = self.fleet.wait(list(inflight), what=lambda: ", ".join(describe_inflight(inflight)))
                if not done:
                    raise StepTimeout(f"no op call finished within {self.opts.timeout_s:g}s; running: "
                                      f"{describe_inflight(inflight)}; pending: {pending()}")
                for waitable in done:
                    what = inflight.pop(waitable)
                    if what[0] == "sync":
                        self.weights.synced(waitable, what[1], what[2], live)
                        continue
                    if what[0] == "admit":
                        lv = admission.admitted(self, what[1])
                        live[lv.key] = lv
                        continue
                    lv, call = live[what[0]], what[1]
                    try:
                        result = self.fleet.result(waitable, f"{call.chunk.op} on {call.group}[{call.rank}]")
                    except StepTimeout:
                        raise
                    except (RLGraphError, ray.exceptions.RayError) as e:
                        self.recovery.repair(lv, e, call, inflight, live, lambda c, owner: self._submit(c, owner,
                                                                                                       inflight))
                        continue
                    if isinstance(result, PartResult):  # a streaming call's part: its rows are ready now
                        lv.take_part(call, result)
                        inflight[waitable] = what
                    elif lv.take(call, result) and lv.training:
                        for op, n in ((call.chunk.op, 1), *((name, len(chs)) for name, chs in call.fused)):
                            for _ in range(n):  # a follower's bar counts its chunks
                                self.reporter.chunk_done(lv.step, op)
                            if lv.sched.op_finished(op):
                                self.weights.produced(op, lv.step)
        except BaseException as e:
            if not plane_lost(e):  # a dead plane has nothing to clear, and answers nothing
                self.fleet.clear_failed(clear_now + ended + [lv.partition for lv in live.values()]
                                        + [a.partition for a in admission.pending(inflight)], e)
            self._abandon()
            raise

    def _finished(self, lv: LiveStep) -> LiveStep:
        """Step `lv` ended (the event loop clears its partition): stamp it, forget weights no later step reads."""
        from rlgraph.runtime.dataplane import payload_bytes_in_this_process

        lv.t1, lv.bytes1 = time.time(), payload_bytes_in_this_process()
        if lv.training:  # its time: from the later of its admission and the end of the step before it
            lv.t0, self._last_end = max(lv.t0, self._last_end), lv.t1
            self.weights.prune(lv.step + 1)
        return lv

    def _abandon(self) -> None:
        """Forget every step in flight (their calls may still run; their partitions are gone)."""
        self.window.clear()
        self.slots = Slots(self.plan)
        self.weights.abandon()

    # ------------------------------------------------------------------ calls
    def _submit(self, call: Call, lv: LiveStep, inflight: dict[Any, Any]) -> None:
        op = self.plan.op(call.chunk.op)
        batch_inputs = {c: lv.rec.batch_values[c] for c in op.inputs if c in lv.rec.batch_values}
        fault = self.recovery.fault_for(call, lv.step) if lv.training and self.opts.faults else None
        ref = self.fleet.submit(call, lv.step, lv.partition, lv.sched.uids, lv.sched.tags(op.name, call.rows),
                                batch_inputs, fault, lv.salt)
        inflight[ref] = (lv.key, call)


def prepare(plan: Plan, check: bool = True) -> None:
    """The pipeline's prepare hook (local assets: data, tiny models), then, with `check`, the
    source's `preflight` (`rlgraph run` runs it beside the workers' start: `RunOptions.checks`)."""
    if plan.prepare:
        resolve_impl(plan.prepare, plan.prepare_file)[0](plan.config)
    if check:
        from rlgraph.runtime.source import preflight  # imports torch: not before the workers' start (actor)

        preflight(plan)


def run_plan(plan: Plan, options: RunOptions, plane: Any = None) -> list[dict[str, Any]]:
    """Prepare, start everything, run the steps, stop everything. Returns the per-step metrics."""
    prepare(plan)
    with Runner(plan, options, plane) as runner:  # stops everything it started, also on Ctrl-C
        return runner.run()
