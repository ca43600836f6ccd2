"""Run a plan: start Ray and the data plane, start the workers, loop over steps.

One step (docs/runtime.md):

1. create the step's partition; the source actor writes the padded batch's first columns and
   returns row metadata (group ids, padding tags);
2. the dispatcher hands each op's ready chunks (`StepBook`) to idle ranks of its group; a
   barrier chunk goes to all ranks at once, split into contiguous shards; workers read and
   write columns themselves, the driver sees row ids and small results;
3. state columns (weights) produced in one group and read in another are synced through Ray;
4. metrics, trace and timeline are written, the partition is cleared; checkpoints and
   validation run every k steps.

Every wait has a timeout naming what it waited for. Failures are retried, at most
``trainer.max_retries`` times per step (docs/runtime.md, "Failures"):

- an op that raised, if it does not change worker state (not an update), is called again on
  the same rows: its inputs are still in the data plane;
- a dead worker's group is restarted (every rank: they share a process group); a group that
  keeps no state (reward, advantage) then re-runs its unfinished calls;
- otherwise (a stateful group died, an update raised) every worker and the data source are
  restored from the latest checkpoint (or restarted from the initial state when there is
  none), the steps since then are replayed, and the step runs again. Ops are seeded per
  (step, op, chunk), so the result equals that of an undisturbed run.

Past the bound the run fails with the last error and says so; the run then shuts down what it
started.
"""

from __future__ import annotations

import json
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlgraph.errors import RLGraphError
from rlgraph.graph.plan import Plan
from rlgraph.runtime.book import Chunk, StepBook
from rlgraph.runtime.checkpoint import CHECKPOINT_FORMAT, latest_checkpoint, load_state, read_meta, save_state
from rlgraph.runtime.cluster import RayHandle, check_cluster, start_ray
from rlgraph.runtime.metrics import MetricsWriter, step_metrics, write_curve_svg
from rlgraph.runtime.progress import Reporter
from rlgraph.runtime.trace import Span, write_chrome_trace, write_timeline_svg

__all__ = ["Fault", "RunOptions", "Runner", "StepTimeout", "WorkerDiedError", "run_plan"]


class StepTimeout(RLGraphError):
    """A wait inside a step exceeded its limit; the message says what was pending."""


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


class WorkerDiedError(RLGraphError):
    """A worker actor's process ended while it ran an op call (crash, OOM kill, node loss)."""


class _Restore(Exception):
    """Internal: the step cannot be repaired in place; restore from a checkpoint and replay."""

    def __init__(self, cause: BaseException, dead: set[str]) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.dead = dead  # groups (or "source") whose actors died


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


@dataclass
class _Inflight:
    chunk: Chunk
    group: str
    rank: int
    part: tuple[int, ...]
    batch_inputs: dict[str, Any] = field(default_factory=dict)


@dataclass
class _StepState:
    spans: list[Span] = field(default_factory=list)
    summaries: dict[str, dict[int, float]] = field(default_factory=dict)  # column -> row -> value
    dropped: dict[int, tuple[str, str]] = field(default_factory=dict)  # row -> (reason, op that dropped it)
    op_metrics: dict[str, list[Any]] = field(default_factory=dict)
    batch_values: dict[str, Any] = field(default_factory=dict)
    result_bytes: int = 0
    restarts: int = 0  # worker actors restarted


class Runner:
    """Owns everything a run starts; use as a context manager (or call `close`)."""

    def __init__(self, plan: Plan, options: RunOptions, plane: Any = None) -> None:
        """`plane`: an already started data plane to use (and leave running), e.g. a test session's."""
        self.plan = plan
        self._own_plane = plane is None
        self.opts = options
        trainer = plan.config.get("trainer", {})
        self.steps = int(options.steps if options.steps is not None else trainer.get("steps", 1))
        self.schedule = options.schedule or trainer.get("schedule", "stream")
        self.seed = int(trainer.get("seed", 0))
        self.val_every = int(trainer.get("val_every", 0))
        self.save_every = int(trainer.get("save_every", 0))
        self.ray: RayHandle | None = None
        self.plane: Any = plane
        self.workers: dict[str, list[Any]] = {}
        self.source: Any = None
        self.pgs: list[Any] = []
        self.all_spans: list[Span] = []
        self._plan_json = plan.model_dump_json()
        self._downstream = _downstream_ops(plan)
        self.max_retries = int(options.max_retries if options.max_retries is not None
                               else trainer.get("max_retries", 2))
        self._faults = {f: f.times for f in options.faults}
        self._attempts: dict[int, int] = {}  # step -> failures so far
        self._stateful: dict[str, bool] = {}  # group -> keeps state (must be restored, not just restarted)
        self._pg_of_pool: dict[str, Any] = {}
        self._initial_source_state: Any = None
        self._records: dict[int, dict[str, Any]] = {}
        self.reporter: Reporter = options.reporter or Reporter()

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Runner:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self.ray = start_ray(self.plan, self.opts.address)
        if self.opts.on_ray_started:
            self.opts.on_ray_started()
        check_cluster(self.plan)  # before any actor: fail with a list, never hang
        if self.plane is None:
            self.plane = self._start_dataplane()
        timeout = self.opts.timeout_s
        pg_of_pool = {}
        for pool in self.plan.pools:
            bundles = [{"CPU": max(b.num_cpus, 0.01), **({"GPU": b.num_gpus} if b.num_gpus else {})}
                       for b in pool.bundles]
            # the compiler put the pool on one node (packed) or over several (spread, or too big for one)
            strategy = "SPREAD" if len({b.node for b in pool.bundles}) > 1 else "PACK"
            pg = placement_group(bundles, strategy=strategy, name=f"rlgraph-{pool.name}")
            self.pgs.append(pg)
            pg_of_pool[pool.name] = pg
        for pool, pg in pg_of_pool.items():
            try:
                ray.get(pg.ready(), timeout=timeout)
            except ray.exceptions.GetTimeoutError:
                raise StepTimeout(f"placement group for pool {pool!r} was not ready after {timeout:g}s; "
                                  f"`ray status` shows what is pending") from None
        self._pg_of_pool = pg_of_pool
        for g in self.plan.groups:
            self._create_group(g.name)
        self._create_source()
        names = list(self.workers)
        self._setup_groups(names)
        self._initial_source_state = self._get([self.source.state_dict.remote()], "the data source to start")[0]
        has_state = self._get([self.workers[g][0].has_instance_state.remote() for g in names],
                              "worker state inventory")
        state_ops = {op.name for op in self.plan.ops
                     if any(self.plan.columns[c].kind == "state" for c in [*op.inputs, *op.outputs])}
        for g, inst in zip(names, has_state):
            self._stateful[g] = bool(inst) or any(o in state_ops for o in self.plan.group(g).ops)

    def _create_group(self, name: str) -> None:
        """Start the actors of worker group `name` (not yet set up) on its pool's bundles."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlgraph.runtime.worker import GroupWorker

        g = self.plan.group(name)
        share = sum(1 for x in self.plan.groups if x.pool == g.pool)  # colocated groups time-share bundles
        bundle = next(p for p in self.plan.pools if p.name == g.pool).bundles
        self.workers[name] = [
            ray.remote(GroupWorker).options(
                name=None,
                num_cpus=max(bundle[r].num_cpus, 0.01) / share,
                num_gpus=bundle[r].num_gpus / share,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg_of_pool[g.pool], placement_group_bundle_index=r),
                max_restarts=0,  # restarts are the runner's: it restores state and re-runs the work
            ).remote(self._plan_json, name, r, g.dp, self.plane.handle())
            for r in range(g.dp)
        ]

    def _create_source(self) -> None:
        import ray

        from rlgraph.runtime.source import SourceWorker

        self.source = ray.remote(SourceWorker).options(num_cpus=0).remote(self._plan_json, self.plane.handle())

    def _setup_groups(self, names: list[str]) -> None:
        # every rank of a group meets at rank 0's address (torch.distributed for DDP/DeepSpeed)
        meet = self._get([self.workers[g][0].rendezvous.remote() for g in names], "worker actors to start")
        setups = [w.setup.remote(*meet[i]) for i, g in enumerate(names) for w in self.workers[g]]
        self._get(setups, "worker start-up (op imports, worker classes' setup: model loading)")

    def _restart_groups(self, names: list[str]) -> None:
        """Kill every actor of the groups `names` (all ranks: they share a process group) and start
        them again on the same bundles; their state is what setup gives (restore it afterwards)."""
        import ray

        for g in names:
            for w in self.workers[g]:
                ray.kill(w, no_restart=True)
            self._create_group(g)
        if names:
            self._setup_groups(names)

    def _dead(self) -> set[str]:
        """Groups with an actor that no longer answers, plus "source" if the data source died."""
        import ray

        refs = {("source", 0): self.source.state_dict.remote()}
        for g, ws in self.workers.items():
            for r, w in enumerate(ws):
                refs[(g, r)] = w.ping.remote()
        dead = set()
        for (g, _), ref in refs.items():
            try:
                ray.get(ref, timeout=self.opts.timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                dead.add(g)
        return dead

    def _start_dataplane(self) -> Any:
        from rlgraph.runtime.dataplane import (RayObjectStoreDataPlane, TransferQueueConfig,
                                               TransferQueueDataPlane)

        backend = self.opts.dataplane or self.plan.config.get("dataplane", {}).get("backend", "transferqueue")
        if backend == "ray":
            return RayObjectStoreDataPlane.start(op_timeout_s=self.opts.timeout_s)
        units = int(self.plan.config.get("dataplane", {}).get("storage_units", 1))
        return TransferQueueDataPlane.start(TransferQueueConfig(num_storage_units=units,
                                                                op_timeout_s=self.opts.timeout_s))

    def close(self) -> None:
        """Stop what this run started: actors, placement groups, the data plane, Ray (if ours)."""
        try:
            import ray
        except ImportError:  # pragma: no cover
            return
        if ray.is_initialized():
            for ws in self.workers.values():
                for w in ws:
                    ray.kill(w, no_restart=True)
            if self.source is not None:
                ray.kill(self.source, no_restart=True)
            from ray.util.placement_group import remove_placement_group

            for pg in self.pgs:
                try:
                    remove_placement_group(pg)
                except Exception:  # already gone with a dead cluster
                    pass
        self.workers, self.source, self.pgs = {}, None, []
        if self.plane is not None and self._own_plane:
            self.plane.close()
        self.plane = None
        if self.ray is not None:
            self.ray.shutdown()
            self.ray = None

    # ------------------------------------------------------------------ waits
    def _get(self, refs: list[Any], what: str) -> list[Any]:
        import ray

        try:
            return ray.get(refs, timeout=self.opts.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise StepTimeout(f"timed out after {self.opts.timeout_s:g}s waiting for {what}") from None
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(getattr(e, "cause", None), RLGraphError) else None
            if cause is not None:
                raise cause from None
            raise

    # ------------------------------------------------------------------ steps
    def run(self) -> list[dict[str, Any]]:
        out = Path(self.opts.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        start_step = 0
        if self.opts.resume:
            ckpt = latest_checkpoint(out)
            if ckpt is not None:
                _check_same_config(ckpt, read_meta(ckpt), self.plan)
                start_step = self._restore(ckpt) + 1
        writer = MetricsWriter(out / "metrics.jsonl", resume_after=start_step - 1 if self.opts.resume else None)
        records = []
        self.reporter.start(self.steps, start_step)
        self._run_start = start_step
        import ray

        try:
            step = start_step
            pending: _Restore | None = None
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
                    self._checkpoint(out, step)
                step += 1
        finally:
            self.reporter.close()
            all_records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
            write_curve_svg(out / "reward_curve.svg", all_records, title=f"{self.plan.pipeline}: mean reward per step")
            if self.all_spans:
                write_chrome_trace(self.all_spans, out / "trace.json")
                write_timeline_svg(self.all_spans, out / "timeline.svg",
                                   title=f"{self.plan.pipeline}: {self.schedule} schedule")
        return records

    def _padded_rows(self, step: int) -> int:
        b = self.plan.batch
        return b.padded_batch_warmup if step < b.critic_warmup else b.padded_batch

    def step(self, step: int, partition: str | None = None, ops: set[str] | None = None) -> dict[str, Any]:
        """Run one step (all ops, or only `ops`) on its own partition; returns its metrics."""
        from rlgraph.runtime.dataplane import payload_bytes_in_this_process

        # a retried step gets a fresh partition: calls abandoned by the failed attempt may still write
        partition = partition or f"train_{step}" + (f"_retry{self._attempts[step]}" if self._attempts.get(step) else "")
        rows = self._padded_rows(step)
        t0 = time.time()
        bytes0 = payload_bytes_in_this_process()
        self.plane.create_partition(partition, rows)
        try:
            uids, is_padding = self._get([self.source.produce.remote(partition, rows, step * rows,
                                                                     partition.startswith("val"))],
                                         f"the data source to write step {step}")[0]
            book = StepBook(self.plan, uids, step, self.schedule)
            if ops is not None:
                for name, st in book.ops.items():
                    st.skipped = st.skipped or name not in ops
            self.reporter.step_started(step, {n: len(s.chunks) for n, s in book.ops.items() if not s.skipped})
            state = self._dispatch(book, step, partition, uids, is_padding)
            if ops is None:
                self._sync_state(book)
        finally:
            self.plane.clear(partition)
        self.all_spans += state.spans
        real = sum(1 for p in is_padding if not p)
        summaries = {c: [v for r, v in sorted(vals.items()) if r not in state.dropped]
                     for c, vals in state.summaries.items()}
        reasons: dict[str, int] = {}
        for reason, _ in state.dropped.values():
            reasons[reason] = reasons.get(reason, 0) + 1
        m = step_metrics(step, summaries=summaries, op_metrics=state.op_metrics, spans=state.spans,
                         wall_s=time.time() - t0, real_rows=real, pad_rows=len(is_padding) - real,
                         dropped=reasons, driver_payload_bytes=payload_bytes_in_this_process() - bytes0,
                         driver_result_bytes=state.result_bytes, schedule=self.schedule)
        m["faults/restarts"] = state.restarts
        return m

    def _dispatch(self, book: StepBook, step: int, partition: str, uids: list[int],
                  is_padding: list[bool]) -> _StepState:
        import ray

        st = _StepState()
        # a rank runs one call at a time, and so does a pool's bundle: colocated groups time-share it
        pool_of = {g.name: g.pool for g in self.plan.groups}
        busy: set[tuple[str, int]] = set()  # (pool, bundle index) running a call
        sent = {(g.name, r): 0 for g in self.plan.groups for r in range(g.dp)}  # rows handed to each rank
        inflight: dict[Any, _Inflight] = {}
        parts_left: dict[tuple[str, int], int] = {}

        def tags(op_name: str, part: tuple[int, ...]) -> list[bool]:
            # a row dropped by an op is padding for the ops that depend on that op
            return [is_padding[i] or (i in st.dropped and op_name in self._downstream[st.dropped[i][1]])
                    for i in part]

        def submit(info: _Inflight, batch_inputs: dict[str, Any]) -> None:
            c = info.chunk
            ref = self.workers[info.group][info.rank].run_chunk.remote(
                c.op, step, partition, c.index, list(info.part), [uids[i] for i in info.part],
                tags(c.op, info.part), batch_inputs, self._take_fault(c.op, step, c.index, info.rank))
            inflight[ref] = info
            info.batch_inputs = batch_inputs
        while not book.finished:
            for chunk in book.all_runnable():
                op = self.plan.op(chunk.op)
                dp = len(self.workers[op.group])
                free = {r for r in range(dp) if (pool_of[op.group], r) not in busy}
                if op.mode == "barrier":
                    if len(free) < dp:
                        continue
                    shards = [chunk.rows[r * len(chunk.rows) // dp:(r + 1) * len(chunk.rows) // dp]
                              for r in range(dp)]
                    targets = list(zip(range(dp), shards))
                elif free:  # by load: the idle rank that has been handed the fewest rows this step
                    targets = [(min(free, key=lambda r: (sent[(op.group, r)], r)), chunk.rows)]
                else:
                    continue
                book.start(chunk)
                parts_left[(chunk.op, chunk.index)] = len(targets)
                batch_inputs = {c: st.batch_values[c] for c in op.inputs if c in st.batch_values}
                for rank, part in targets:
                    busy.add((pool_of[op.group], rank))
                    sent[(op.group, rank)] += len(part)
                    submit(_Inflight(chunk, op.group, rank, part), batch_inputs)
            if book.finished:
                break
            if not inflight:
                raise StepTimeout(f"step {step} cannot make progress: nothing is running and nothing is ready; "
                                  f"pending: {book.unfinished()}")
            done, _ = ray.wait(list(inflight), num_returns=1, timeout=self.opts.timeout_s)
            if not done:
                running = sorted({f'{f.chunk.op}[{f.chunk.index}] on {f.group}[{f.rank}]' for f in inflight.values()})
                raise StepTimeout(f"step {step}: no op call finished within {self.opts.timeout_s:g}s; running: "
                                  f"{running}; pending: {book.unfinished()}")
            for ref in done:
                info = inflight.pop(ref)
                try:
                    result = self._get([ref], f"{info.chunk.op} on {info.group}[{info.rank}]")[0]
                except (RLGraphError, ray.exceptions.RayError) as e:
                    if isinstance(e, StepTimeout):
                        raise
                    self._repair(step, e, info, inflight, submit, st)
                    continue
                st.result_bytes += len(pickle.dumps(result))
                busy.discard((pool_of[info.group], info.rank))
                st.spans.append(result.span)
                for col, vals in result.summaries.items():
                    st.summaries.setdefault(col, {}).update(vals)
                for row, (reason, whole_group) in result.dropped.items():
                    for r in (range(len(uids)) if whole_group else (row,)):
                        if (r == row or uids[r] == uids[row]) and not is_padding[r] and r not in st.dropped:
                            st.dropped[r] = (reason, info.chunk.op)
                if result.metrics:
                    st.op_metrics.setdefault(info.chunk.op, []).append(result.metrics)
                st.batch_values.update(result.batch_values)
                key = (info.chunk.op, info.chunk.index)
                parts_left[key] -= 1
                if parts_left[key] == 0:
                    book.complete(info.chunk)
                    self.reporter.chunk_done(step, info.chunk.op)
        return st

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

    def _repair(self, step: int, e: BaseException, info: _Inflight, inflight: dict[Any, _Inflight],
                submit: Any, st: _StepState) -> None:
        """A call failed: re-run it in place when that is safe, else abort the step for a restore."""
        import ray

        died = isinstance(e, ray.exceptions.RayActorError)
        if died:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            e = WorkerDiedError(f"worker {info.group}[{info.rank}] died while running op {info.chunk.op!r} at step "
                                f"{step} (chunk {info.chunk.index}, {len(info.part)} rows): {type(e).__name__}: "
                                f"{first} (its log is under /tmp/ray/session_latest/logs)")
        self._count_failure(step, e)
        op = self.plan.op(info.chunk.op)
        stateful = self._stateful[info.group]
        # an update (or any call that may have changed worker state before failing) cannot simply run again
        changes_state = (any(self.plan.columns[c].kind == "state" for c in op.outputs)
                         or op.batching.mini_batch_samples is not None or (op.mode == "barrier" and stateful))
        if died and stateful:
            raise _Restore(e, {info.group})
        if not died and changes_state:
            raise _Restore(e, set())
        lost = [info]
        if died:  # a group that keeps no state: restart it, then run again what it had in flight
            for ref in [r for r, i in inflight.items() if i.group == info.group]:
                lost.append(inflight.pop(ref))
            self._restart_groups([info.group])
            st.restarts += len(self.workers[info.group])
        for i in lost:
            submit(i, i.batch_inputs)

    def _recover(self, step: int, out: Path, r: _Restore) -> None:
        """Restore every worker and the source to the latest checkpoint (or the initial state) and
        replay the steps since then, so that `step` can run again as if nothing had happened."""
        dead = self._dead() | r.dead
        ckpt = latest_checkpoint(out)
        ckpt_step = _checkpoint_step(ckpt) if ckpt is not None else None
        if ckpt_step is not None and ckpt_step >= step:  # written by a later attempt: not ours
            ckpt, ckpt_step = None, None
        groups = sorted(g for g in dead if g in self.workers)
        if ckpt is None:  # nothing saved: back to the state the run started from
            groups = list(self.workers)
        self._restart_groups(groups)
        if "source" in dead:
            import ray

            ray.kill(self.source, no_restart=True)
            self._create_source()
        if ckpt is not None:
            replay_from = self._restore(ckpt) + 1
        else:
            if self._run_start != 0:
                raise RLGraphError(f"step {step} failed ({r.cause}) and there is no checkpoint to restore "
                                   f"from in {out}; set trainer.save_every to make runs recoverable")
            self._get([self.source.load_state_dict.remote(self._initial_source_state)],
                      "the data source to rewind")
            replay_from = 0
        spans = len(self.all_spans)
        for s in range(replay_from, step):  # same seeds, same data: the same state as before the failure
            again = self.step(s)
            before = self._records.get(s, {})
            key = "score/mean"
            if key in before and again.get(key) != before[key]:
                import warnings

                warnings.warn(f"replayed step {s} gave {key}={again.get(key)}, the first run "
                              f"{before[key]}: the ops are not deterministic", stacklevel=2)
        del self.all_spans[spans:]

    def _sync_state(self, book: StepBook) -> None:
        """Move state columns from their producer's group to consumer groups elsewhere."""
        calls = []
        for name, col in self.plan.columns.items():
            if col.kind != "state" or col.producer not in book.ops or book.ops[col.producer].skipped:
                continue
            src_group = self.plan.op(col.producer).group
            ref = self.workers[src_group][0].export_state.remote(name)  # a reference: no bytes via the driver
            for g in sorted({self.plan.op(c).group for c in col.consumers} - {src_group}):
                calls += [w.import_state.remote(name, ref) for w in self.workers[g]]
            calls += [w.import_state.remote(name, ref) for w in self.workers[src_group][1:]]
        if calls:
            self._get(calls, "the weight sync (state columns to their consumers)")

    def validate(self, step: int) -> dict[str, Any]:
        """Run the ops that produce the scores on the validation split; returns ``val/...`` metrics."""
        targets = {"token_level_scores"} & set(self.plan.columns)
        if not targets:
            return {}
        needed = self._ancestors(targets)
        m = self.step(step, partition=f"val_{step}", ops=needed)
        return {f"val/{k}": v for k, v in m.items() if k.split("/")[0] in ("score", "reward", "response_length")}

    def _ancestors(self, columns: set[str]) -> set[str]:
        ops: set[str] = set()
        todo = list(columns)
        while todo:
            col = self.plan.columns.get(todo.pop())
            if col is None or col.producer in ops or col.producer == self.plan.source:
                continue
            ops.add(col.producer)
            todo += self.plan.op(col.producer).inputs
        return ops

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self, out: Path, step: int) -> Path:
        import json

        d = out / "checkpoints" / f"step_{step}"
        tmp = d.with_name(d.name + ".tmp")
        for g, ws in self.workers.items():
            for r, w in enumerate(ws):
                cols, inst = self._get([w.state_columns.remote(), w.instance_states.remote()],
                                       f"checkpoint state of {g}[{r}]")
                save_state({"columns": cols, "instances": inst}, tmp, f"{g}_{r}")
        src = self._get([self.source.state_dict.remote()], "the data source's position")[0]
        save_state(src, tmp, "source")
        (tmp / "meta.json").write_text(json.dumps({"format": CHECKPOINT_FORMAT, "step": step,
                                                   "pipeline": self.plan.pipeline, "config": self.plan.config}))
        if d.exists():
            import shutil

            shutil.rmtree(d)
        tmp.rename(d)
        return d

    def _restore(self, ckpt: Path) -> int:
        meta = read_meta(ckpt)
        calls = []
        for g, ws in self.workers.items():
            for r, w in enumerate(ws):
                state = load_state(ckpt, f"{g}_{r}")
                calls += [w.load_state_columns.remote(state["columns"]),
                          w.load_instance_states.remote(state["instances"])]
        calls.append(self.source.load_state_dict.remote(load_state(ckpt, "source")))
        self._get(calls, f"restoring checkpoint {ckpt}")
        return int(meta["step"])


# config keys that may differ between a checkpoint and the run resuming it: they do not change results
_RESUMABLE_KEYS = ("trainer.steps", "trainer.val_every", "trainer.save_every", "trainer.max_retries",
                   "trainer.schedule")


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _check_same_config(ckpt: Path, meta: dict[str, Any], plan: Plan) -> None:
    """--resume continues a run only with the config that wrote the checkpoint (steps may grow)."""
    from rlgraph.runtime.checkpoint import CheckpointError

    if meta.get("pipeline") not in (None, plan.pipeline):
        raise CheckpointError(f"checkpoint {str(ckpt)!r} was written by pipeline {meta['pipeline']!r}, not "
                              f"{plan.pipeline!r}; resume with the plan that wrote it, or use another output dir")
    if "config" not in meta:
        return
    old, new = _flat(meta["config"]), _flat(plan.config)
    diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and k not in _RESUMABLE_KEYS)
    if diff:
        shown = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in diff[:6])
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r} was written with another config ({shown}{' ...' if len(diff) > 6 else ''}); "
            f"--resume continues a run only with the same config (trainer.steps may change). Resume with the "
            f"original overrides, or start a fresh run in another output dir")


def _checkpoint_step(ckpt: Path) -> int:
    return int(read_meta(ckpt)["step"])


def _downstream_ops(plan: Plan) -> dict[str, set[str]]:
    """Op -> every op that reads its outputs, directly or through other ops."""
    readers: dict[str, set[str]] = {op.name: set() for op in plan.ops}
    for op in plan.ops:
        for col in op.inputs:
            producer = plan.columns[col].producer if col in plan.columns else None
            if producer in readers:
                readers[producer].add(op.name)
    out: dict[str, set[str]] = {}
    for name in readers:
        seen: set[str] = set()
        todo = list(readers[name])
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo += readers[n]
        out[name] = seen
    return out


def prepare(plan: Plan) -> None:
    """Call the pipeline's prepare hook (local assets such as data sets and tiny models)."""
    if plan.prepare:
        from rlgraph.runtime.invoke import resolve_impl

        fn, _ = resolve_impl(plan.prepare, plan.prepare_file)
        fn(plan.config)


def run_plan(plan: Plan, options: RunOptions, plane: Any = None) -> list[dict[str, Any]]:
    """Prepare, start everything, run the steps, stop everything. Returns the per-step metrics."""
    prepare(plan)
    with Runner(plan, options, plane) as runner:  # stops everything it started, also on Ctrl-C
        return runner.run()
