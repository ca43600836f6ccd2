"""When a call or a process fails: repair in place, or restore and replay.

Failures are repaired at the cheapest level that is still exact (`repair_for` in the scheduler
decides which): a call whose op keeps no state runs again; a dead group that keeps no state is
restarted and its calls run again; otherwise every worker and the source are restored from the
latest checkpoint (or restarted from the initial state when there is none) and the steps since
are replayed. Ops are seeded per (step, op, chunk), so a replay equals the undisturbed run.
Each step may fail ``trainer.max_retries`` times; the next failure ends the run with the cause.

`Fault` is the fault-injection hook the tests and the soak use: it breaks a chosen call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from rlgraph.errors import InvariantError, RLGraphError, WorkerDiedError
from rlgraph.graph.plan import Plan
from rlgraph.runtime.checkpoint import checkpoint_step, has_state, latest_checkpoint, read_checkpoint, verify_checkpoint
from rlgraph.runtime.dataplane.errors import DataPlaneDied
from rlgraph.runtime.fleet import PLANE, SOURCE, Fleet
from rlgraph.runtime.scheduler import Call, Repair, repair_for
from rlgraph.runtime.step import LiveStep, StepKey
from rlgraph.runtime.weights import VERSIONS, WeightMover

if TYPE_CHECKING:
    from rlgraph.runtime.reporter import Reporter

__all__ = ["Fault", "Restore", "Recovery", "first_line"]


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


class Restore(Exception):
    """The step cannot be repaired in place: restore from a checkpoint and replay (internal to
    the runner; it never reaches a user)."""

    def __init__(self, cause: BaseException, dead: set[str]) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.dead = dead  # groups (or SOURCE, PLANE) whose actors died

    @property
    def plane_lost(self) -> bool:
        return PLANE in self.dead


def plane_lost(e: BaseException) -> bool:
    """Whether `e` means the data plane is gone (then it has nothing to clear and answers nothing)."""
    return isinstance(e, DataPlaneDied) or (isinstance(e, Restore) and e.plane_lost)


def first_line(e: BaseException) -> str:
    """An error's type and the first line of its message, for a one-line fault report."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:160]}" if text else type(e).__name__


def _chunks(call: Call) -> str:
    """The chunks a call held, for people: "chunk 3", or "chunks 0, 1, 2" for a batched call."""
    idx = [c.index for c in call.chunks]
    return f"chunk {idx[0]}" if len(idx) == 1 else "chunks " + ", ".join(map(str, idx))


class Recovery:
    """Counts each step's failures, mends failed calls, and restores the fleet for a replay."""

    def __init__(self, plan: Plan, fleet: Fleet, weights: WeightMover, reporter: Reporter, max_retries: int,
                 faults: list[Fault]) -> None:
        self.plan, self.fleet, self.weights, self.reporter = plan, fleet, weights, reporter
        self.max_retries = max_retries
        self.attempts: dict[int, int] = {}  # step -> failures so far
        self.restarted = 0  # actors a restore restarted, not yet in a written step's faults/restarts
        self._faults = {f: f.times for f in faults}

    def take_fault(self, op: str, step: int, chunks: list[int], rank: int) -> str | None:
        """The injected fault for a call of `chunks` (one of them named by a fault), if one is left."""
        for f, left in self._faults.items():
            if left > 0 and (f.op, f.step) == (op, step) and f.chunk in chunks and f.rank in (None, rank):
                self._faults[f] = left - 1
                return f.kind
        return None

    def fault_for(self, call: Call, step: int) -> tuple[str, str] | None:
        """(kind, op) of the first fault left for `call`'s op or an op fused into it, if any."""
        for name, chunks in ((call.chunk.op, call.chunks), *call.fused):
            kind = self.take_fault(name, step, [c.index for c in chunks], call.rank)
            if kind is not None:
                return kind, name
        return None

    def count(self, step: int, e: BaseException) -> None:
        """Record a failure of `step`; past trainer.max_retries, raise it (as what it is) for good."""
        n = self.attempts[step] = self.attempts.get(step, 0) + 1
        if n <= self.max_retries:
            return
        msg = (f"{e}\n(step {step} failed {n} times; gave up after trainer.max_retries={self.max_retries} "
               f"retries. Fix the cause above, or raise trainer.max_retries if the failures are transient)")
        if isinstance(e, RLGraphError):
            raise e.with_message(msg) from None
        raise RLGraphError(f"{type(e).__name__}: {msg}") from None

    def actor_died_outside(self, step: int, e: BaseException) -> Restore:
        """An actor died between op calls (seen by a driver-side call): restore everything."""
        self.count(step, e)
        self.reporter.fault(f"an actor died at step {step} outside an op call ({first_line(e)}); "
                            f"restoring every worker and replaying")
        return Restore(e, set())

    def repair(self, lv: LiveStep, e: BaseException, call: Call, inflight: dict[Any, Any],
               live: dict[StepKey, LiveStep], resubmit: Callable[[Call, LiveStep], None]) -> None:
        """A call failed: mend it as `repair_for` says (calls to run again go to `resubmit`), or
        raise `Restore` to abort the steps in flight."""
        import ray

        step = lv.step
        if isinstance(e, InvariantError):  # a bug, not a transient failure: retrying cannot help
            raise e
        lost = self.fleet.plane_dead()
        if lost:  # the call failed because the data plane did: nothing runs until it is replaced
            e = DataPlaneDied(lost, f"running op {call.chunk.op!r} at step {step}")
            self.count(step, e)
            raise Restore(e, {PLANE})
        died = isinstance(e, ray.exceptions.RayActorError)
        if died:
            e = WorkerDiedError(f"worker {call.group}[{call.rank}] died while running op {call.chunk.op!r} at step "
                                f"{step} ({_chunks(call)}, {len(call.rows)} rows): {first_line(e)} "
                                f"(its log is under /tmp/ray/session_latest/logs)")
        self.count(step, e)
        action = repair_for(self.plan, call.chunk.op, died, self.fleet.stateful[call.group],
                            [name for name, _ in call.fused])
        what = (f"worker {call.group}[{call.rank}] died" if died else
                f"op {call.chunk.op!r} failed on {call.group}[{call.rank}] ({first_line(e)})")
        if action is Repair.RESTORE:
            self.reporter.fault(f"{what} at step {step}; restoring every worker and replaying")
            raise Restore(e, {call.group} if died else set())
        again = [(lv, call)]
        restarted = ""
        if action is Repair.RESTART_GROUP:  # then run again what the group had in flight, of every step
            for ref in [r for r, w in inflight.items() if w[0] not in ("sync", "admit") and w[1].group == call.group]:
                key, c = inflight.pop(ref)
                again.append((live[key], c))
            lv.rec.restarts += self.fleet.restart([call.group])
            restarted = f"restarted group {call.group!r}, "
        self.reporter.fault(f"{what} at step {step}; {restarted}running {len(again)} call(s) again")
        for owner, c in again:
            resubmit(owner.sched.rerun(c), owner)

    def take_restarts(self) -> int:
        """The actors restores restarted since the last written step (its record counts them once)."""
        n, self.restarted = self.restarted, 0
        return n

    def recover(self, step: int, out: Path, r: Restore, run_start: int) -> int:
        """Restore every worker and the source to the latest checkpoint (or the initial state);
        returns the first step to run again (the steps before `step` are replayed, not written)."""
        ckpt = latest_checkpoint(out)
        if ckpt is not None and checkpoint_step(ckpt) >= step:  # written by a later attempt: not ours
            ckpt = None
        if ckpt is not None:
            verify_checkpoint(ckpt)  # a damaged file is a CheckpointDamaged naming it, not a wrong restore
        where = f"the checkpoint of step {checkpoint_step(ckpt)}" if ckpt is not None else "the start"
        lost = sorted(r.cause.dead) if isinstance(r.cause, DataPlaneDied) else self.fleet.plane_dead()
        if r.plane_lost or lost:
            t0 = time.time()
            self.restarted += self.fleet.restart_plane()  # a new plane; every group and the source restarted on it
            self.reporter.fault(f"the data plane's {', '.join(lost) or 'actor'} died at step {step}; started a new "
                                f"data plane and every worker in {time.time() - t0:.1f}s, replaying from {where}")
        else:
            dead = self.fleet.dead() | r.dead
            # nothing saved: back to the state the run started from, every group
            self.restarted += self.fleet.restart(list(self.fleet.workers) if ckpt is None
                                                 else [g for g in dead if g in self.fleet.workers])
            if SOURCE in dead:
                self.restarted += self.fleet.restart_source()
        if ckpt is not None:
            return self.restore(ckpt) + 1
        if run_start != 0:
            raise RLGraphError(f"step {step} failed ({r.cause}) and there is no checkpoint to restore "
                               f"from in {out}; set trainer.save_every to make runs recoverable")
        self.fleet.rewind_source()
        self.weights.forget()
        self.weights.window.reset_held(initial=True)
        return 0

    def restore(self, ckpt: Path) -> int:
        """Load checkpoint `ckpt` into the actors and the kept state-column values; returns its step."""
        names = self.fleet.state_names()
        step, states = read_checkpoint(ckpt, names + ([VERSIONS] if has_state(ckpt, VERSIONS) else []))
        self.fleet.load_states({k: v for k, v in states.items() if k != VERSIONS}, f"restoring checkpoint {ckpt}")
        self.weights.restore(states.get(VERSIONS), states)
        return step
