"""Run a plan: the step loop.

One step (docs/runtime.md):

1. create the step's partition; the source actor writes the padded batch's first columns and
   returns row metadata (group ids, padding tags);
2. an event loop: the scheduler (`rlgraph.runtime.scheduler`) hands out calls, the fleet
   (`rlgraph.runtime.fleet`) runs them on the workers, each result goes back to the scheduler
   and into the step's record; workers read and write columns themselves, the driver sees row
   ids and small results;
3. state columns (weights) written in one group are moved through Ray to the groups that read
   them, each read seeing the version `rlgraph.runtime.window` assigns it;
4. metrics, trace and timeline are written, the partition is cleared; checkpoints
   (`rlgraph.runtime.checkpoint`) and validation run every k steps.

With ``trainer.max_staleness = k`` the same event loop keeps up to k+1 steps in flight: step
t+1's prompts are generated while step t is scored and trained. `rlgraph.runtime.window` orders
the steps so that every read of a state column sees a version fixed by the plan, never by timing;
validation and checkpoint steps drain the window (nothing of a later step runs before they end).

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
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlgraph.errors import InvariantError, RefillExhausted, RLGraphError, StepTimeout, WorkerDiedError
from rlgraph.graph.loader import resolve_impl
from rlgraph.graph.plan import Plan
from rlgraph.runtime.checkpoint import check_compatible, checkpoint_step, has_state, latest_checkpoint, \
    read_checkpoint, write_checkpoint
from rlgraph.runtime.dataplane.base import DataPlaneDied
from rlgraph.runtime.fleet import PLANE, SOURCE, Fleet
from rlgraph.runtime.metrics import MetricsWriter, step_metrics
from rlgraph.runtime.plots import write_reward_curve, write_timeline
from rlgraph.runtime.progress import Reporter
from rlgraph.runtime.scheduler import Call, Repair, Slots, StepScheduler, repair_for, row_homes
from rlgraph.runtime.trace import Span, write_chrome_trace
from rlgraph.runtime.window import Window
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
    verbose: bool = False  # the actors' own output (Ray, engines) on this terminal; long waits logged
    trace_steps: int = 200  # trace.json and timeline.svg show the op calls of the last this many steps (0: all)
    keep_records: bool = True  # run() returns every step's record (False: none, for long runs;
    #                            metrics.jsonl has them all either way)


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
    sync_s: float = 0.0  # waiting for state columns (weights) to reach the groups that read them


@dataclass
class _Live:
    """A step in flight: its partition, scheduler and record."""

    key: float  # its key in the window: the step, or step + 0.5 for the validation after it
    step: int
    partition: str
    sched: StepScheduler
    is_padding: list[bool]
    t0: float
    bytes0: int
    rec: _Record = field(default_factory=_Record)
    salt: int = 0  # a refill round: enters its calls' seeds
    keep: bool = False  # keep the partition once done (a refill round: its kept rows are copied later)
    quiet: frozenset[str] = frozenset()  # ops whose op metrics are not recorded (the rounds' ops on padding)
    refill: dict[str, Any] = field(default_factory=dict)  # the rounds' accounting: real, dropped, metrics

    @property
    def training(self) -> bool:
        return self.key == self.step


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
        self.depth = int(trainer.get("max_staleness", 0)) + 1  # steps in flight
        self.max_retries = int(options.max_retries if options.max_retries is not None
                               else trainer.get("max_retries", 2))
        self.reporter: Reporter = options.reporter or Reporter()
        self.fleet = Fleet(plan, options.timeout_s, options.dataplane, options.address, plane, options.on_ray_started,
                           options.verbose, on_phase=lambda message: self.reporter.phase(message))
        # op-call spans of the latest steps, one list per step (bounded: a long run's driver stays flat)
        self._spans: deque[list[Span]] = deque(maxlen=options.trace_steps or None)
        self.written = 0  # steps whose records this run wrote
        self.headline = [f"{name}/mean" for name in plan.summaries.values()]
        self._faults = {f: f.times for f in options.faults}
        self._attempts: dict[int, int] = {}  # step -> failures so far
        self._heads: dict[int, dict[str, Any]] = {}  # step -> its headline metrics, to check a replay against
        self._run_start = 0
        self._next = 0  # the first step whose record has not been written (earlier ones are replays)
        self.window: Window | None = None  # made once the fleet knows which groups keep state
        self._slots = Slots(plan)
        self._kept: dict[tuple[str, int], Any] = {}  # (state column, producer step) -> its value in Ray
        self._syncing: dict[tuple[str, str], list[Any]] = {}  # (column, group) -> [version, calls left, t0]
        self._last_end: dict[str, float] = {}  # group -> end of its latest call in the steps done

    def __enter__(self) -> Runner:
        self.fleet.__enter__()
        self.window = Window(self.plan, self.fleet.stateful)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self.fleet.start()
        self.window = Window(self.plan, self.fleet.stateful)

    def close(self) -> None:
        self.fleet.close()

    # ------------------------------------------------------------------ the run
    def run(self) -> list[dict[str, Any]]:
        """Run steps (after the latest checkpoint with ``resume``); returns their metrics records."""
        import ray

        out = Path(self.opts.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "placement.json").write_text(json.dumps(self.fleet.placement(), indent=1) + "\n")
        start_step = 0
        if self.opts.resume:
            ckpt = latest_checkpoint(out)
            if ckpt is not None:
                check_compatible(ckpt, self.plan)
                start_step = self._restore(ckpt) + 1
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
                        first = self._recover(self._next, out, pending)
                        pending = None
                    self._drive(first, self.steps, lambda lv, m: self._step_done(lv, m, out, writer, records))
                except _Restore as r:  # counted where it was raised
                    pending = r
                except DataPlaneDied as e:  # seen by a wait's watch, or by a call of the driver's own
                    self._abandon()
                    self._count_failure(self._next, e)
                    pending = _Restore(e, {PLANE})
                except ray.exceptions.RayActorError as e:  # an actor died outside an op call
                    self._abandon()
                    self._count_failure(self._next, e)
                    self.reporter.fault(f"an actor died at step {self._next} outside an op call ({_first_line(e)}); "
                                        f"restoring every worker and replaying")
                    pending = _Restore(e, set())
        except BaseException as e:
            error = e
            raise
        finally:
            self.reporter.close(error)
            self._write_outputs(out)
        return records

    def _step_done(self, lv: _Live, record: dict[str, Any], out: Path, writer: MetricsWriter,
                   records: list[dict[str, Any]]) -> None:
        """A training step finished (steps finish in order): write it, or check a replayed one."""
        step = lv.step
        if step < self._next:  # replayed after a restore: same seeds, same data, same state
            before = self._heads.get(step, {})
            changed = [k for k in self.headline if k in before and record.get(k) != before[k]]
            if changed:
                warnings.warn(f"replayed step {step} gave {changed[0]}={record.get(changed[0])}, the first run "
                              f"{before[changed[0]]}: the ops are not deterministic", stacklevel=2)
            return
        self._spans.append(list(lv.rec.spans))
        record["faults/retries"] = self._attempts.get(step, 0)
        if self.val_every and (step + 1) % self.val_every == 0:
            record.update(self.validate(step))
        writer.write(record)
        self.written += 1
        if self.opts.keep_records:
            records.append(record)
        self._heads[step] = {k: record[k] for k in self.headline if k in record}
        # written: a failure from here on (the checkpoint gathers every actor's state) replays this
        # step without writing it again
        self._next = step + 1
        self.reporter.step_done(record)
        if self.save_every and (step + 1) % self.save_every == 0:
            write_checkpoint(out, step, self._checkpoint_states(), self.plan)
            for done in [k for k in self._heads if k <= step]:  # a restore replays only steps after it
                del self._heads[done]

    @property
    def all_spans(self) -> list[Span]:
        """The op-call spans kept for the trace: those of the last `trace_steps` steps."""
        return [span for step in self._spans for span in step]

    def _drains(self, step: int) -> bool:
        """Whether nothing of a later step may start before `step` ends (validation, checkpoint)."""
        if step < self._next:
            return False
        return bool((self.val_every and (step + 1) % self.val_every == 0)
                    or (self.save_every and (step + 1) % self.save_every == 0))

    def _write_outputs(self, out: Path) -> None:
        """reward_curve.svg/.png, trace.json and timeline.svg/.png; the timeline's whole-run summary
        reads every step's op timings from metrics.jsonl (the spans cover the latest steps only).
        It runs as the run ends, also on an error: a chart that cannot be drawn is a warning, never
        an exception that would hide the run's own."""
        try:
            self._draw(out)
        except Exception as e:
            warnings.warn(f"could not write the run's charts to {out} ({type(e).__name__}: {e}); metrics.jsonl "
                          f"has every step", RuntimeWarning, stacklevel=2)

    def _draw(self, out: Path) -> None:
        path = out / "metrics.jsonl"
        all_records = []
        for ln in (path.read_text().splitlines() if path.is_file() else []):
            try:
                all_records.append(json.loads(ln))
            except ValueError:  # a line cut short by a kill
                continue
        if self.headline:
            write_reward_curve(out / "reward_curve.svg", all_records, key=self.headline[0],
                               title=f"{self.plan.pipeline}: {self.headline[0]} per step")
        spans = self.all_spans
        if spans:
            ahead = f", up to {self.depth} steps in flight" if self.depth > 1 else ""
            write_chrome_trace(spans, out / "trace.json")
            write_timeline(out / "timeline.svg", spans, title=f"{self.plan.pipeline}: {self.schedule} "
                           f"schedule{ahead}", records=all_records)

    def validate(self, step: int) -> dict[str, Any]:
        """Run the ops that produce the validation columns on the validation split, with the weights
        written at `step`; ``val/...`` metrics."""
        if not self.plan.validation.ops:
            return {}
        lv = self._admit(step, key=step + 0.5, partition=f"val_{step}", ops=set(self.plan.validation.ops))
        m = self._alone(lv)
        if self._spans:  # validation calls show in the trace and timeline too, with their step's
            self._spans[-1].extend(lv.rec.spans)
        else:
            self._spans.append(list(lv.rec.spans))
        names = set(self.plan.summaries.values())
        return {f"val/{k}": v for k, v in m.items() if k.split("/")[0] in names}

    def step(self, step: int, partition: str | None = None, ops: set[str] | None = None) -> dict[str, Any]:
        """Run one step (all ops, or only `ops`) on its own partition, alone; returns its metrics."""
        self.window.first = step
        return self._alone(self._admit(step, partition=partition, ops=ops))

    def _alone(self, lv: _Live) -> dict[str, Any]:
        """Run admitted step `lv` with nothing else in flight; returns its metrics."""
        results: list[dict[str, Any]] = []
        self._events({lv.key: lv}, lambda live: None, lambda done, m: results.append(m))
        return results[0]

    # ------------------------------------------------------------------ steps in flight
    def _drive(self, first: int, stop: int, on_done: Any) -> None:
        """Run steps `first` .. `stop`-1, up to `depth` in flight; `on_done(live, metrics)` in step order."""
        self.window.first = first
        state = {"next": first}

        def admit_more(live: dict[float, _Live]) -> None:
            while (state["next"] < stop and len(live) < self.depth
                   and not any(self._drains(lv.step) for lv in live.values())):
                lv = self._admit(state["next"])
                live[lv.key] = lv
                state["next"] += 1

        self._events({}, admit_more, on_done)

    def _admit(self, step: int, key: float | None = None, partition: str | None = None,
               ops: set[str] | None = None, uid_start: int | None = None, reads: int | None = None) -> _Live:
        """Create step `step`'s partition, have the source fill it, and put its scheduler in the window."""
        from rlgraph.runtime.dataplane import payload_bytes_in_this_process

        key = step if key is None else key
        # a retried step gets a fresh partition: calls abandoned by the failed attempt may still write
        partition = partition or f"train_{step}" + (f"_retry{self._attempts[step]}" if self._attempts.get(step) else "")
        if key == step and ops is None and self.plan.refill is not None:
            return self._admit_refilled(step, partition)
        b = self.plan.batch
        rows = b.padded_batch_warmup if step < b.critic_warmup else b.padded_batch
        t0, bytes0 = time.time(), payload_bytes_in_this_process()
        homes = self._row_homes(rows)
        self.fleet.plane.create_partition(partition, rows, homes)
        try:
            uids, is_padding = self.fleet.produce(partition, rows, step * rows if uid_start is None else uid_start,
                                                  partition.startswith("val"))
        except BaseException:
            self.fleet.plane.clear(partition)
            raise
        training = key == step
        units = self.fleet.plane.storage_nodes()
        sched = StepScheduler(self.plan, uids, is_padding, step, self.schedule, ops, slots=self._slots,
                              gated=self.window.gated_ops(reads_fixed=not training),
                              row_nodes=None if homes is None else [units[h] for h in homes],
                              rank_nodes=self.fleet.node_of)
        self.window.admit(key, sched, reads=None if training else step if reads is None else reads)
        if training:
            self.reporter.step_started(step, sched.chunk_counts())
        return _Live(key, step, partition, sched, list(is_padding), t0, bytes0)

    # ------------------------------------------------------------------ dynamic sampling
    def _admit_refilled(self, step: int, partition: str) -> _Live:
        """Step `step` with dynamic sampling (`Plan.refill`): rounds of the ops up to the filter, each
        on fresh prompts in a partition of its own, until the groups the filter kept fill the batch
        or the rounds run out; then the first ``data.batch_size`` kept groups, padded to the plan's
        multiple, are copied (by the source actor) into the step's partition, where every op runs
        on the padding rows and the ops after the filter on all of them. Returns that step."""
        from rlgraph.runtime.dataplane import payload_bytes_in_this_process

        rf, b = self.plan.refill, self.plan.batch
        warm = step < b.critic_warmup
        rows = b.padded_batch_warmup if warm else b.padded_batch
        multiple = b.multiple_warmup if warm else b.multiple
        span = rf.max_rounds + 2  # uid blocks of `rows` per step: one per round, one for the padding
        t0, bytes0 = time.time(), payload_bytes_in_this_process()
        rec = _Record()
        kept: list[tuple[str, list[int], list[int]]] = []  # (round partition, rows, uids) of each kept group
        reasons: dict[str, int] = {}
        real = rounds = generated = 0
        made: list[str] = []
        plane_lost = False
        try:
            for k in range(rf.max_rounds):
                if len(kept) >= b.batch_size:
                    break
                part = f"{partition}_round{k}"
                lv = self._admit(step, key=step - 1 + (k + 1) / (rf.max_rounds + 1), partition=part,
                                 ops=set(rf.round_ops), uid_start=(step * span + k) * rows, reads=step - 1)
                lv.salt, lv.keep = k, True
                made.append(part)
                self._events({lv.key: lv}, lambda live: None, lambda done, m: None)
                rounds += 1
                sched = lv.sched
                groups: dict[int, list[int]] = {}
                for r in range(sched.num_rows):
                    if not sched.is_padding[r]:
                        real += 1
                        if r not in sched.dropped:
                            groups.setdefault(sched.uids[r], []).append(r)
                generated += len({sched.uids[r] for r in range(sched.num_rows) if not sched.is_padding[r]})
                for reason, _ in sched.dropped.values():
                    reasons[reason] = reasons.get(reason, 0) + 1
                kept += [(part, rs, [sched.uids[r] for r in rs]) for rs in groups.values()]
                rec.spans += lv.rec.spans
                rec.result_bytes += lv.rec.result_bytes
                rec.restarts += lv.rec.restarts
                rec.sync_s += lv.rec.sync_s
                rec.batch_values.update(lv.rec.batch_values)
                for op, records in lv.rec.op_metrics.items():
                    rec.op_metrics.setdefault(op, []).extend(records)
                for col, vals in lv.rec.summaries.items():  # re-keyed below, to the rows of the batch
                    rec.summaries.setdefault(col, {}).update({(part, r): v for r, v in vals.items()})
            exhausted = len(kept) < b.batch_size
            if exhausted:
                self._exhausted(step, rounds, len(kept), generated, reasons)
            surplus = kept[b.batch_size:]
            kept = kept[:b.batch_size]
            if surplus:
                reasons["surplus"] = sum(len(rs) for _, rs, _ in surplus)
            n_kept = sum(len(rs) for _, rs, _ in kept)
            padded = max(multiple, -(-n_kept // multiple) * multiple)
            pad_start = (step * span + rf.max_rounds + 1) * rows
            uids = [u for _, _, us in kept for u in us] + [pad_start + i for i in range(padded - n_kept)]
            is_padding = [False] * n_kept + [True] * (padded - n_kept)
            picks: list[tuple[str, list[int]]] = []
            for part, rs, _ in kept:
                if picks and picks[-1][0] == part:
                    picks[-1][1].extend(rs)
                else:
                    picks.append((part, list(rs)))
            homes = self._row_homes(padded)
            self.fleet.plane.create_partition(partition, padded, homes)
            try:
                self.fleet.assemble(partition, picks, list(rf.carried), padded - n_kept, pad_start)
            except BaseException:
                self.fleet.plane.clear(partition)
                raise
        except BaseException as e:  # a dead plane has nothing to clear, and answers nothing
            plane_lost = isinstance(e, DataPlaneDied) or (isinstance(e, _Restore) and PLANE in e.dead)
            raise
        finally:
            if not plane_lost:
                for part in made:
                    self.fleet.plane.clear(part)
        # the summaries of every generated sample, where they are written before the filter (the
        # trained ones are the filter's choice: their score says little about the policy's accuracy)
        gen_means = {f"generated/{name}/mean": sum(vals.values()) / len(vals)
                     for col, name in self.plan.summaries.items()
                     if (vals := rec.summaries.get(col)) and col in self.plan.columns
                     and self.plan.columns[col].producer in rf.round_ops and self.plan.columns[col].producer != rf.op}
        at = {(part, r): i for i, (part, r) in enumerate((part, r) for part, rs, _ in kept for r in rs)}
        rec.summaries = {col: {at[key]: v for key, v in vals.items() if key in at}
                         for col, vals in rec.summaries.items()}
        units = self.fleet.plane.storage_nodes()
        try:
            sched = StepScheduler(self.plan, uids, is_padding, step, self.schedule, None, slots=self._slots,
                                  gated=self.window.gated_ops(), row_nodes=None if homes is None else
                                  [units[h] for h in homes], rank_nodes=self.fleet.node_of,
                                  carried=(rf.carried, range(n_kept), rf.round_ops))
        except BaseException:
            self.fleet.plane.clear(partition)
            raise
        self.window.admit(step, sched)
        self.reporter.step_started(step, sched.chunk_counts())
        lv = _Live(step, step, partition, sched, is_padding, t0, bytes0, rec=rec, quiet=frozenset(rf.round_ops))
        lv.refill = {"real": real, "dropped": reasons, "metrics": {
            "refill/rounds": rounds, "refill/generated_groups": generated, "refill/kept_groups": len(kept),
            "refill/exhausted": float(exhausted), **gen_means}}
        return lv

    def _exhausted(self, step: int, rounds: int, kept: int, generated: int, reasons: dict[str, int]) -> None:
        """The rounds ran out before the kept groups filled the batch: fail, or say so once and train."""
        rf, want = self.plan.refill, self.plan.batch.batch_size
        what = (f"step {step}: dynamic sampling kept {kept} of the {want} groups a batch needs after {rounds} "
                f"round(s) ({generated} groups generated; {reasons.get('zero_variance', 0)} samples dropped for "
                f"zero variance)")
        if rf.on_exhaust == "fail":
            raise RefillExhausted(f"{what}. Fix: raise {rf.op}.max_rounds, lower {rf.op}.min_std, use prompts of a "
                                  f"difficulty the policy sometimes solves, or set {rf.op}.on_exhaust=train to train "
                                  f"on the groups kept")
        if not getattr(self, "_said_exhausted", False):
            self._said_exhausted = True
            warnings.warn(f"{what}; training on the groups kept ({rf.op}.on_exhaust=train; raise {rf.op}.max_rounds "
                          f"to fill the batch). Later steps that run out are counted in refill/exhausted", stacklevel=2)

    def _row_homes(self, rows: int) -> list[int] | None:
        """Each row's storage unit (`rlgraph.runtime.scheduler.row_homes`), or None: TransferQueue's
        own rule (``dataplane.locality=hash``, or a plane that places rows by writer)."""
        if self.plan.config.get("dataplane", {}).get("locality", "node") != "node":
            return None
        return row_homes(self.plan, rows, self.fleet.node_of, self.fleet.plane.storage_nodes())

    def _events(self, live: dict[float, _Live], admit_more: Any, on_done: Any) -> None:
        """The event loop: admit steps, open the cross-step gates, hand out calls, take results in,
        and finish steps in order. A failure that needs a restore abandons every step in flight."""
        import ray

        inflight: dict[Any, Any] = {}  # waitable -> (step key, Call), or ("sync", column, group)
        try:
            while True:
                admit_more(live)
                self._open_gates(live, inflight)
                for key in sorted(live):  # the oldest step first
                    for call in live[key].sched.next_calls():
                        self._submit(call, live[key], inflight)
                finished = list(self.window.pop_done())
                for key in finished:
                    lv = live.pop(key)
                    if lv.training:  # weight versions no step from here on reads
                        for kept in self.window.prunable(lv.step + 1):
                            self._kept.pop(kept, None)
                    on_done(lv, self._metrics(lv))
                if finished:
                    continue
                if not live:
                    return
                if not inflight:
                    raise StepTimeout(f"steps {sorted(lv.step for lv in live.values())} cannot make progress: "
                                      f"nothing is running and nothing is ready; pending: "
                                      f"{ {lv.step: lv.sched.unfinished() for lv in live.values()} }")
                done = self.fleet.wait(list(inflight), what=lambda: ", ".join(_running(inflight)))
                if not done:
                    raise StepTimeout(f"no op call finished within {self.opts.timeout_s:g}s; running: "
                                      f"{_running(inflight)}; "
                                      f"pending: { {lv.step: lv.sched.unfinished() for lv in live.values()} }")
                for waitable in done:
                    what = inflight.pop(waitable)
                    if what[0] == "sync":
                        self._synced(waitable, what[1], what[2], live)
                        continue
                    lv, call = live[what[0]], what[1]
                    try:
                        result = self.fleet.result(waitable, f"{call.chunk.op} on {call.group}[{call.rank}]")
                    except (RLGraphError, ray.exceptions.RayError) as e:
                        if isinstance(e, StepTimeout):
                            raise
                        self._repair(lv, e, call, inflight, live)
                        continue
                    if isinstance(result, PartResult):  # a streaming call's part: its rows are ready now
                        lv.rec.result_bytes += len(pickle.dumps(result))
                        self._take_summaries(result.summaries, lv.rec)
                        lv.sched.rows_done(call.chunk.op, result.rows)
                        inflight[waitable] = what
                        continue
                    self._finish(call, result, lv)
        except BaseException as e:
            plane_lost = isinstance(e, DataPlaneDied) or (isinstance(e, _Restore) and PLANE in e.dead)
            if not plane_lost:  # a dead plane has nothing to clear, and answers nothing
                for lv in live.values():
                    self.fleet.plane.clear(lv.partition)
            self._abandon()
            raise

    def _abandon(self) -> None:
        """Forget every step in flight (their calls may still run; their partitions are gone)."""
        self.window.clear()
        self._slots = Slots(self.plan)
        self._syncing.clear()

    def _metrics(self, lv: _Live) -> dict[str, Any]:
        """A finished step's metrics record; clears its partition."""
        from rlgraph.runtime.dataplane import payload_bytes_in_this_process

        if not lv.keep:
            self.fleet.plane.clear(lv.partition)
        sched, rec, is_padding = lv.sched, lv.rec, lv.is_padding
        real = sum(1 for p in is_padding if not p)
        summaries = {c: [v for r, v in sorted(vals.items()) if r not in sched.dropped]
                     for c, vals in rec.summaries.items()}
        pad = len(is_padding) - real
        reasons: dict[str, int] = dict(lv.refill.get("dropped", {}))  # a refilled step: the rounds' drops
        if lv.refill:
            real = lv.refill["real"]
        for reason, _ in sched.dropped.values():
            reasons[reason] = reasons.get(reason, 0) + 1
        m = step_metrics(lv.step, summaries=summaries, names=self.plan.summaries, op_metrics=rec.op_metrics,
                         spans=rec.spans, wall_s=time.time() - lv.t0, real_rows=real, pad_rows=pad,
                         dropped=reasons, driver_payload_bytes=payload_bytes_in_this_process() - lv.bytes0,
                         driver_result_bytes=rec.result_bytes, schedule=self.schedule)
        m["faults/restarts"] = rec.restarts
        m.update(lv.refill.get("metrics", {}))
        local, remote = sum(s.local_bytes for s in rec.spans), sum(s.cross_node_bytes for s in rec.spans)
        if local or remote:  # the plane knows where each row is stored (TransferQueue)
            m["dataplane/local_bytes"] = local
            m["dataplane/cross_node_bytes"] = remote
            m["dataplane/cross_node_frac"] = remote / (local + remote)
        m["timing/state_sync_s"] = rec.sync_s  # waiting for weights to reach the groups that read them
        if lv.training:
            # how long each group sat idle before this step's first call on it (waiting for its inputs,
            # for weights or for the previous step): the rollout's idle time is what running ahead removes
            for group in sorted({s.group for s in rec.spans}):
                mine = [s for s in rec.spans if s.group == group]
                if group in self._last_end:
                    m[f"timing/idle/{group}_s"] = max(0.0, min(s.start for s in mine) - self._last_end[group])
                self._last_end[group] = max([self._last_end.get(group, 0.0), *(s.end for s in mine)])
        return m

    # ------------------------------------------------------------------ calls
    def _submit(self, call: Call, lv: _Live, inflight: dict[Any, Any]) -> None:
        op = self.plan.op(call.chunk.op)
        batch_inputs = {c: lv.rec.batch_values[c] for c in op.inputs if c in lv.rec.batch_values}
        fault = self._take_fault(call.chunk.op, lv.step, call.chunk.index, call.rank) if lv.training else None
        ref = self.fleet.submit(call, lv.step, lv.partition, lv.sched.uids, lv.sched.tags(op.name, call.rows),
                                batch_inputs, fault, lv.salt)
        inflight[ref] = (lv.key, call)

    def _finish(self, call: Call, result: Any, lv: _Live) -> None:
        """Take in a call's small result: span, per-row summaries, drops, metrics, batch values."""
        rec, sched = lv.rec, lv.sched
        rec.result_bytes += len(pickle.dumps(result))
        rec.spans.append(result.span)
        self._take_summaries(result.summaries, rec)
        for row, (reason, whole_group) in result.dropped.items():
            sched.drop(row, reason, call.chunk.op, whole_group)
        if result.metrics and call.chunk.op not in lv.quiet:
            rec.op_metrics.setdefault(call.chunk.op, []).append(result.metrics)
        rec.batch_values.update(result.batch_values)
        if sched.call_done(call) and lv.training:
            self.reporter.chunk_done(lv.step, call.chunk.op)
            if sched.op_finished(call.chunk.op):
                self._produced(call.chunk.op, lv.step)

    @staticmethod
    def _take_summaries(summaries: dict[str, dict[int, float]], rec: _Record) -> None:
        for col, vals in summaries.items():
            rec.summaries.setdefault(col, {}).update(vals)

    # ------------------------------------------------------------------ state columns across steps
    def _produced(self, op: str, step: int) -> None:
        """`op` finished `step`: keep (a reference to) each state column it wrote that another group
        reads, for the steps that will read it (a group reading its own columns needs no copy)."""
        group = self.plan.op(op).group
        for col in self.window.produced(op, step):
            if col in self.window.crossing:
                self._kept[(col, step)] = self.fleet.export_state(group, col)

    def _open_gates(self, live: dict[float, _Live], inflight: dict[Any, Any]) -> None:
        """Open the ops whose cross-step conditions hold; start the weight syncs they wait for, and
        the pushes of new weights to the groups that take them mid-call (partial rollout)."""
        for col, group, version in self.window.pushes(busy=set(self._syncing)):
            self._start_sync(col, group, version, None, inflight)
        again = True
        while again:
            again = False
            for gate in self.window.gates():
                if gate.sync is None:
                    live[gate.step].sched.open(gate.op)
                    continue
                col, group, version = gate.sync
                if (col, group) in self._syncing:
                    continue
                if version is None:  # back to the initial weights (after a restore): a fresh group has them
                    live[gate.step].rec.restarts += self.fleet.restart([group])
                    self.window.holds_initial(group)
                    again = True  # its gates may open now
                    continue
                self._start_sync(col, group, version, gate.step, inflight)

    def _start_sync(self, col: str, group: str, version: int, step: float | None, inflight: dict[Any, Any]) -> None:
        """Move the value `col` had after producer step `version` into `group` (for step `step`'s
        gate; None: a push). Into a group that takes weights mid-call, at once (the control thread)."""
        calls = self.fleet.import_state(group, col, self._kept[(col, version)], now=(col, group) in self.window.pushed)
        self._syncing[(col, group)] = [version, len(calls), time.time(), step]
        for ref in calls:
            inflight[ref] = ("sync", col, group)

    def _synced(self, waitable: Any, col: str, group: str, live: dict[float, _Live]) -> None:
        self.fleet.get([waitable], f"the weight sync of {col!r} to worker group {group!r}")
        entry = self._syncing[(col, group)]
        entry[1] -= 1
        if entry[1] == 0:
            del self._syncing[(col, group)]
            self.window.holds(col, group, entry[0])
            if entry[3] is not None and entry[3] in live:
                live[entry[3]].rec.sync_s += time.time() - entry[2]

    def _checkpoint_states(self) -> dict[str, Any]:
        """Every actor's state, plus the state-column values steps after this one will still read."""
        states = self.fleet.states()
        kept = {c: steps for c, steps in self.window.kept.items() if steps and c in self.window.crossing}
        latest = {c: steps[-1] for c, steps in kept.items()}
        older = {c: dict(zip(map(str, steps[:-1]), self.fleet.get([self._kept[(c, s)] for s in steps[:-1]],
                                                                   f"older versions of {c!r} for the checkpoint")))
                 for c, steps in kept.items() if len(steps) > 1}
        states[_VERSIONS] = {"latest": latest, "older": older}
        return states

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

    def _repair(self, lv: _Live, e: BaseException, call: Call, inflight: dict[Any, Any],
                live: dict[float, _Live]) -> None:
        """A call failed: mend it as `repair_for` says, or abort the steps in flight for a restore."""
        import ray

        step = lv.step
        if isinstance(e, InvariantError):  # a bug, not a transient failure: retrying cannot help
            raise e
        lost = self.fleet.plane_dead()
        if lost:  # the call failed because the data plane did: nothing runs until it is replaced
            e = DataPlaneDied(lost, f"running op {call.chunk.op!r} at step {step}")
            self._count_failure(step, e)
            raise _Restore(e, {PLANE})
        died = isinstance(e, ray.exceptions.RayActorError)
        if died:
            e = WorkerDiedError(f"worker {call.group}[{call.rank}] died while running op {call.chunk.op!r} at step "
                                f"{step} (chunk {call.chunk.index}, {len(call.rows)} rows): {_first_line(e)} "
                                f"(its log is under /tmp/ray/session_latest/logs)")
        self._count_failure(step, e)
        action = repair_for(self.plan, call.chunk.op, died, self.fleet.stateful[call.group])
        what = (f"worker {call.group}[{call.rank}] died" if died else
                f"op {call.chunk.op!r} failed on {call.group}[{call.rank}] ({_first_line(e)})")
        if action is Repair.RESTORE:
            self.reporter.fault(f"{what} at step {step}; restoring every worker and replaying")
            raise _Restore(e, {call.group} if died else set())
        lost = [(lv, call)]
        if action is Repair.RESTART_GROUP:  # then run again what the group had in flight, of every step
            for ref in [r for r, w in inflight.items() if w[0] != "sync" and w[1].group == call.group]:
                key, c = inflight.pop(ref)
                lost.append((live[key], c))
            lv.rec.restarts += self.fleet.restart([call.group])
        self.reporter.fault(f"{what} at step {step}; " + ("restarted group " + repr(call.group) + ", " if
                                                         action is Repair.RESTART_GROUP else "")
                            + f"running {len(lost)} call(s) again")
        for owner, c in lost:
            self._submit(c, owner, inflight)

    def _recover(self, step: int, out: Path, r: _Restore) -> int:
        """Restore every worker and the source to the latest checkpoint (or the initial state);
        returns the first step to run again (the steps before `step` are replayed, not written)."""
        ckpt = latest_checkpoint(out)
        if ckpt is not None and checkpoint_step(ckpt) >= step:  # written by a later attempt: not ours
            ckpt = None
        where = f"the checkpoint of step {checkpoint_step(ckpt)}" if ckpt is not None else "the start"
        lost = sorted(r.cause.dead) if isinstance(r.cause, DataPlaneDied) else self.fleet.plane_dead()
        if PLANE in r.dead or lost:
            t0 = time.time()
            self.fleet.restart_plane()  # a new plane; every group and the source restarted on it
            self.reporter.fault(f"the data plane's {', '.join(lost) or 'actor'} died at step {step}; started a new "
                                f"data plane and every worker in {time.time() - t0:.1f}s, replaying from {where}")
        else:
            dead = self.fleet.dead() | r.dead
            # nothing saved: back to the state the run started from, every group
            self.fleet.restart(list(self.fleet.workers) if ckpt is None
                               else [g for g in dead if g in self.fleet.workers])
            if SOURCE in dead:
                self.fleet.restart_source()
        self._last_end.clear()
        if ckpt is not None:
            return self._restore(ckpt) + 1
        if self._run_start != 0:
            raise RLGraphError(f"step {step} failed ({r.cause}) and there is no checkpoint to restore "
                               f"from in {out}; set trainer.save_every to make runs recoverable")
        self.fleet.rewind_source()
        self._kept.clear()
        self.window.forget_kept()
        self.window.reset_held(initial=True)
        return 0

    def _restore(self, ckpt: Path) -> int:
        """Load checkpoint `ckpt` into the actors and the kept state-column values; returns its step."""
        import ray

        names = self.fleet.state_names()
        step, states = read_checkpoint(ckpt, names + ([_VERSIONS] if has_state(ckpt, _VERSIONS) else []))
        self.fleet.load_states({k: v for k, v in states.items() if k != _VERSIONS}, f"restoring checkpoint {ckpt}")
        versions = states.get(_VERSIONS, {"latest": {}, "older": {}})
        self._kept.clear()
        self.window.forget_kept()
        for c, steps in self.window.kept.items():
            if c not in self.window.crossing:
                continue
            for s, value in sorted(versions["older"].get(c, {}).items(), key=lambda kv: int(kv[0])):
                steps.append(int(s))
                self._kept[(c, int(s))] = ray.put(value)
            if c in versions["latest"]:  # the producer's own copy, in its group's rank 0 state
                s = int(versions["latest"][c])
                steps.append(s)
                producer = self.plan.op(self.plan.columns[c].producer).group
                self._kept[(c, s)] = ray.put(states[f"{producer}_0"]["columns"][c])
        self.window.reset_held(initial=False)  # the groups hold what the checkpoint had: sync before reading
        return step


_VERSIONS = "state_versions"  # the checkpoint entry holding the kept state-column values


def _first_line(e: BaseException) -> str:
    """An error's type and the first line of its message, for a one-line fault report."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:160]}" if text else type(e).__name__


def _running(inflight: dict[Any, Any]) -> list[str]:
    """What the event loop waits for, for people: each call in flight, each weight sync."""
    return sorted({f"step {k[0]}: {k[1].chunk.op}[{k[1].chunk.index}] on {k[1].group}[{k[1].rank}]"
                   if k[0] != "sync" else f"weight sync of {k[1]!r} to {k[2]!r}" for k in inflight.values()})


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
