"""Scoring many samples at once with a rule-based reward function, each under a time limit.

A `RewardScorer` wraps one verl-signature function (``module:function``) and scores a list of
samples concurrently, in one of three ways:

- ``thread`` (default): up to ``concurrency`` samples at once on threads: right for functions
  that wait on I/O (a sandbox, an HTTP judge) or release the GIL; without a time limit
  (``timeout_s=0``), a call whose samples' measured work fits one thread is scored on the
  caller's own thread, one sample after another, as a single-process trainer scores;
- ``process``: a `pebble` process pool of ``concurrency`` processes, for CPU-heavy functions
  (symbolic math, running tests); a sample over its time limit has its process killed; a sample
  whose process died under it (killed from outside, the OOM killer, a crash) is scored again on a
  fresh process, up to ``process_restarts`` times, before it counts as an error;
- ``async def`` functions always run on an event loop, ``concurrency`` at a time.

The time limit counts from when a sample starts, not from when it was queued. A sample that
raises, times out, or returns something that is not a score becomes an `Outcome` with an
``error``; what happens next (score zero, drop the group, fail the step) is the reward op's
policy, not the scorer's. A thread cannot be killed, so a timed-out thread keeps running in
the background while scoring continues on fresh threads; use ``process`` when a function may
hang for good.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import multiprocessing
import queue
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Sequence

from rlgraph.ops.names import EXECUTORS
from rlgraph.ops.reward.functions import RewardFnError, load_reward_fn, normalise_score

__all__ = ["Outcome", "RewardScorer", "Scores"]



@dataclass
class Outcome:
    """One sample's result: its score and extras, or the error that replaced them."""

    score: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # "<ExceptionType>: message" when the function failed
    timed_out: bool = False
    seconds: float = 0.0


@dataclass
class Scores:
    """A call's results, kept per column rather than as an `Outcome` a sample (128 of those cost more
    than a rule-based function's scoring): each sample's score (0.0 where it failed) and seconds, and
    only for the samples that need one, the failed sample's `Outcome` or the function's extras."""

    values: list[float]
    seconds: list[float]
    failed: dict[int, Outcome] = field(default_factory=dict)  # sample -> its outcome with the error
    extras: dict[int, dict[str, Any]] = field(default_factory=dict)  # sample -> extras of a dict result

    def outcomes(self) -> list[Outcome]:
        """One `Outcome` a sample."""
        return [self.failed.get(i) or Outcome(v, dict(self.extras.get(i, {})), None, False, s)
                for i, (v, s) in enumerate(zip(self.values, self.seconds))]


class _Raised:
    """In a call's list of results: the function raised on this sample (its `_describe`d exception)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


_TIMED_OUT = object()  # in a call's list of results: the sample ran past its time limit


# ---------------------------------------------------------------- process-pool side
_CHILD_FN: dict[str, Any] = {}


def _child_score(ref: str, kwargs: dict[str, Any]) -> Any:
    """Runs in a pool process: import the function once per process, call it."""
    fn = _CHILD_FN.get(ref)
    if fn is None:
        fn = _CHILD_FN[ref] = load_reward_fn(ref)
    return fn(**kwargs)


# A call's samples wait in one list that its threads take from in turn, one at a time; it starts
# on as many threads as its measured work needs, about `RUN_BUDGET_S` of scoring each (a fast
# rule-based function's call: one thread), and gets the rest of `concurrency` whenever samples have
# waited that long untaken (a function that turned slow, or a sample that stalled). A sample handed
# to a thread costs more than a rule-based check: a 512-sample call of the addition task cost
# 1.4 ms on eight threads with two locks a sample, where its scoring takes 0.2 ms.
RUN_BUDGET_S = 0.002

# a process pool's sample is waited for in slices of this long, asking between them whether its pool
# broke (`_settles`)
POOL_CHECK_S = 0.5


class _Batch:
    """One `score` call's samples on the thread pool: their arguments, results, the next sample no
    thread has taken, when each sample being scored started, and how many threads serve it.

    A thread takes no lock per sample. It takes the next index off the end of `untaken` (a list's
    ``pop`` is one C call: atomic under the GIL), records the sample's start in
    `started`, and claims the sample's result by popping that entry; the caller gives a sample up
    (its time ran out) by popping it first. Whoever pops the entry owns ``results[i]`` (a dict's
    ``pop`` is atomic under the GIL too). `serving` changes under `cond`, once per thread and batch."""

    def __init__(self, columns: tuple[Sequence[Any], ...]) -> None:
        self.columns = columns  # data sources, solutions, ground truths, extra infos
        self.n = len(columns[0])
        self.results: list[tuple[str, Any, float] | None] = [None] * self.n
        self.untaken = list(range(self.n - 1, -1, -1))  # the samples no thread has taken, the next last
        self.started: dict[int, float] = {}  # sample -> when a thread started it, until claimed
        self.serving = 0  # threads handed this batch and not yet done with it (not counting given-up ones)
        self.cond = threading.Condition(threading.Lock())

    def done(self) -> bool:
        """Every sample has a result (call under `cond`): all were taken and no thread still scores one."""
        return self.serving == 0 and not self.started and not self.untaken


class _ThreadPool:
    """Long-lived scoring threads, `size` of them, each taking a batch off one queue and scoring
    its samples until none is left untaken (threads started per sample cost more than a rule-based
    function's scoring). A thread whose sample runs past its time limit is left behind: it ends
    once its function returns, and `replace` starts a fresh thread, so `size` threads keep serving."""

    def __init__(self, fn: Any, size: int) -> None:
        self.fn = fn
        self.size = size
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.serving = 0  # threads in the pool (not left behind)
        self.started = 0

    def fill(self) -> None:
        with self.lock:
            while self.serving < self.size:
                self.serving += 1
                self.started += 1
                threading.Thread(target=self._serve, daemon=True, name=f"reward-{self.started}").start()

    def stop(self) -> None:
        """Let every serving thread end once it is idle (one stop mark each on the queue)."""
        with self.lock:
            for _ in range(self.serving):
                self.tasks.put(None)
            self.serving = 0

    def replace(self) -> None:
        with self.lock:
            self.serving -= 1
        self.fill()

    def _serve(self) -> None:
        while True:
            batch = self.tasks.get()
            if batch is None:  # stopped
                return
            if not self._score(batch):  # given up on (timeout): this thread was replaced
                return

    def _score(self, batch: _Batch) -> bool:
        """Score `batch`'s untaken samples one after another; False when one of them was given up on
        (its time ran out: the caller has replaced this thread)."""
        fn, (sources, solutions, truths, extras) = self.fn, batch.columns
        started, results, untaken, clock = batch.started, batch.results, batch.untaken, time.monotonic
        while True:
            try:
                i = untaken.pop()
            except IndexError:  # every sample taken
                with batch.cond:
                    batch.serving -= 1
                    if batch.done():
                        batch.cond.notify_all()
                return True
            t0 = started[i] = clock()
            try:
                res: tuple[str, Any] = ("ok", fn(data_source=sources[i], solution_str=solutions[i],
                                                 ground_truth=truths[i], extra_info=extras[i]))
            except BaseException as e:  # noqa: BLE001 - the user's function failed (even sys.exit): per sample;
                res = ("error", _describe(e))  # this thread serves on, so the call never waits on a dead one
            if started.pop(i, None) is None:  # given up on: its result is the caller's timeout
                return False
            results[i] = (res[0], res[1], clock() - t0)


def _settles(future: Any, pool: Any) -> bool:
    """Wait for a pool task's `future`; False when its pool broke first and left it unsettled: pebble
    settles the tasks it had started when its pool breaks (every process killed at once, its fork
    server with them), not those still in its queue, which would be waited for without end."""
    while not concurrent.futures.wait([future], timeout=POOL_CHECK_S).done:
        if not pool.active:
            return bool(concurrent.futures.wait([future], timeout=0).done)  # settled as it broke
    return True


def _unpacked(raw: Sequence[tuple[str, Any, float]]) -> tuple[list[Any], list[float]]:
    """A pool's ``(kind, value, seconds)`` results as what each sample's function gave (its return
    value, a `_Raised`, or `_TIMED_OUT`) and the seconds each took."""
    values = [v if kind == "ok" else _Raised(v) if kind == "error" else _TIMED_OUT for kind, v, _ in raw]
    return values, [r[2] for r in raw]


def _describe(e: BaseException) -> str:
    try:
        text = str(e).strip().splitlines()
    except Exception:  # noqa: BLE001 - an exception whose message cannot be made: its type says enough
        text = []
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


class RewardScorer:
    """Scores samples with the function `ref` (see the module doc); reuse it across calls."""

    def __init__(self, ref: str, executor: str = "thread", concurrency: int = 8, timeout_s: float = 0.0,
                 process_restarts: int = 2) -> None:
        if executor not in EXECUTORS:
            raise RewardFnError(f"reward executor {executor!r} is not one of {', '.join(EXECUTORS)}")
        if concurrency < 1:
            raise RewardFnError(f"reward concurrency must be at least 1, got {concurrency}")
        self.ref = ref
        self.fn = load_reward_fn(ref)  # checks the signature here, in the worker, before any sample
        self.is_async = inspect.iscoroutinefunction(self.fn)
        self.executor = executor
        self.concurrency = int(concurrency)
        self.timeout_s = float(timeout_s) if timeout_s and timeout_s > 0 else None
        self.label = getattr(self.fn, "__qualname__", ref)
        self.process_restarts = max(0, int(process_restarts))
        self._pool: Any = None
        self._threads: _ThreadPool | None = None
        self.abandoned_threads = 0  # timed-out threads still running in the background
        self.sample_s: float | None = None  # the function's mean time per sample in the last call (threads)
        self.restarted = 0  # samples scored again because their process died (all calls so far)

    # ------------------------------------------------------------------ public
    def score(self, data_sources: Sequence[str], solution_strs: Sequence[str], ground_truths: Sequence[str],
              extra_infos: Sequence[dict | None] | None = None) -> list[Outcome]:
        """One `Outcome` a sample (see `scores`)."""
        return self.scores(data_sources, solution_strs, ground_truths, extra_infos).outcomes()

    def scores(self, data_sources: Sequence[str], solution_strs: Sequence[str], ground_truths: Sequence[str],
               extra_infos: Sequence[dict | None] | None = None) -> Scores:
        """Score the samples (one list a field, in order): their `Scores`."""
        n = len(data_sources)
        extra_infos = list(extra_infos) if extra_infos is not None else [None] * n
        if not (len(solution_strs) == len(ground_truths) == len(extra_infos) == n):
            raise RewardFnError(f"RewardScorer.score got lists of different lengths: {n} data sources, "
                                f"{len(solution_strs)} solutions, {len(ground_truths)} ground truths, "
                                f"{len(extra_infos)} extra infos")
        if not n:
            return Scores([], [])
        columns = (data_sources, solution_strs, ground_truths, extra_infos)
        if self.is_async or self.executor == "process":
            calls = [{"data_source": data_sources[i], "solution_str": solution_strs[i],
                      "ground_truth": ground_truths[i], "extra_info": extra_infos[i]} for i in range(n)]
            values, seconds = _unpacked(asyncio.run(self._run_async(calls)) if self.is_async
                                        else self._run_processes(calls))
        elif self.timeout_s is None and self.sample_s is not None and n * self.sample_s <= RUN_BUDGET_S:
            values, seconds = self._run_inline(columns)
        else:
            values, seconds = _unpacked(self._run_threads(columns))
        # the common case, every score a finite float, kept as the function gave it (a sum of floats is
        # finite only if each is, or it overflowed: then the loop below tells)
        if all(type(v) is float for v in values) and math.isfinite(sum(values)):
            return Scores(values, seconds)
        out = Scores([0.0] * n, seconds)
        for i, value in enumerate(values):
            if type(value) is float and math.isfinite(value) or type(value) is int:
                out.values[i] = float(value)
                continue
            o = self._finish(i, data_sources[i], value, seconds[i])
            if o.error is not None:
                out.failed[i] = o
            else:
                out.values[i] = o.score
                if o.extra:
                    out.extras[i] = o.extra
        return out

    def close(self) -> None:
        if self._threads is not None:
            self._threads.stop()
            self._threads = None
        if self._pool is not None:
            self._pool.stop()
            self._pool.join(timeout=10)
            self._pool = None

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ result handling
    def _finish(self, i: int, data_source: Any, value: Any, seconds: float) -> Outcome:
        """A sample's outcome from what its function gave (a `_Raised`, `_TIMED_OUT` or its return value),
        but for a finite number, which `scores` keeps as it is (the common case)."""
        if value is _TIMED_OUT:
            return Outcome(error=f"TimeoutError: took longer than reward.timeout_s={self.timeout_s:g}s",
                           timed_out=True, seconds=seconds)
        if type(value) is _Raised:
            return Outcome(error=value.text, seconds=seconds)
        where = f"reward function {self.label!r} on sample {i} (data_source={data_source!r})"
        try:
            score, extra = normalise_score(value, where)
        except RewardFnError as e:
            return Outcome(error=f"RewardFnError: {e}", seconds=seconds)
        return Outcome(score=score, extra=extra, seconds=seconds)

    # ------------------------------------------------------------------ threads
    def _run_inline(self, columns: tuple[Sequence[Any], ...]) -> tuple[list[Any], list[float]]:
        """Score one sample after another on the calling thread: for a call without a time limit whose
        measured work fits one thread (`RUN_BUDGET_S`), where a hand-off to a thread and back costs
        more than the scoring (a 128-sample call of the addition task: 0.04 ms of scoring, 0.25 ms on
        a thread). No limit means none to enforce, so nothing here needs a thread that can be left behind.
        A function that turned slow hands the call's samples left to the threads once the call has taken
        `RUN_BUDGET_S` (they score them concurrently, as the call would have gone had it been measured so).
        Gives what the function returned for each sample (a `_Raised` where it raised) and the seconds
        each took: their mean, as the call is timed as a whole."""
        fn, clock = self.fn, time.monotonic
        out: list[Any] = []
        start = clock()
        for source, solution, truth, extra in zip(*columns):
            if out and clock() - start > RUN_BUDGET_S:
                done, spent = len(out), clock() - start
                values, seconds = _unpacked(self._run_threads(tuple(c[done:] for c in columns)))
                return out + values, [spent / done] * done + seconds
            try:
                out.append(fn(data_source=source, solution_str=solution, ground_truth=truth, extra_info=extra))
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001 - the user's function failed: per sample, as on a thread
                out.append(_Raised(_describe(e)))
        self.sample_s = (clock() - start) / len(out)
        return out, [self.sample_s] * len(out)

    def _run_threads(self, columns: tuple[Sequence[Any], ...]) -> list[tuple[str, Any, float]]:
        if self._threads is None:
            self._threads = _ThreadPool(self.fn, self.concurrency)
        pool = self._threads
        batch = _Batch(columns)
        # before the function's cost is known (its first call), or once it has timed out: every
        # thread at once; else as many as the measured work needs (`RUN_BUDGET_S` each)
        want = self.concurrency if not self.sample_s else -(-batch.n * self.sample_s // RUN_BUDGET_S)
        pool.fill()
        with batch.cond:
            try:
                self._wait(batch, pool, int(want))
            finally:  # an interrupted wait (Ctrl-C): the threads take no more of this call's samples
                batch.untaken.clear()
        timed = [r[2] for r in batch.results if r is not None and r[0] != "timeout"]
        timed_out = any(r is not None and r[0] == "timeout" for r in batch.results)
        self.sample_s = None if timed_out or not timed else sum(timed) / len(timed)
        return batch.results  # type: ignore[return-value]

    def _wait(self, batch: _Batch, pool: _ThreadPool, want: int) -> None:
        """Hand `batch` to `want` threads and wait until every sample has a result, giving up samples
        past their time limit and bringing in more threads when samples wait untaken (under ``batch.cond``)."""
        added = time.monotonic()
        self._add_threads(batch, want)
        while not batch.done():
            now = time.monotonic()
            if self.timeout_s is not None:
                for i, t0 in batch.started.copy().items():
                    if now - t0 >= self.timeout_s and batch.started.pop(i, None) is not None:
                        batch.results[i] = ("timeout", None, now - t0)
                        self.abandoned_threads += 1
                        batch.serving -= 1  # the stuck thread leaves the pool; a fresh one joins,
                        pool.replace()
                        self._add_threads(batch, 1)  # and serves this batch in its place
            if batch.done():
                break
            waiting = bool(batch.untaken) and batch.serving < self.concurrency
            if waiting and now - added >= RUN_BUDGET_S:  # samples waited untaken: every thread at once
                self._add_threads(batch, self.concurrency)
                added, waiting = now, False
            wait = 0.5 if self.timeout_s is None else max(
                0.001, min((t0 + self.timeout_s - now for t0 in batch.started.copy().values()), default=0.05))
            if waiting:
                wait = min(wait, max(added + RUN_BUDGET_S - now, 1e-4))
            batch.cond.wait(timeout=min(wait, 0.5))

    def _add_threads(self, batch: _Batch, count: int) -> None:
        """Up to `count` more threads on `batch`, at most `concurrency` serving it and one an untaken
        sample (call under ``batch.cond``)."""
        count = min(count, self.concurrency - batch.serving, len(batch.untaken))
        for _ in range(max(0, count)):
            batch.serving += 1
            self._threads.tasks.put(batch)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ processes
    def _ensure_pool(self) -> Any:
        if self._pool is None:
            import pebble

            # forkserver: children are forked from a clean single-threaded server process that has
            # imported this module once, never from the worker itself (a fork of a Ray worker with
            # its threads, sockets and torch state is unsafe, and spawning anew costs seconds per
            # process, paid again whenever a timed-out process is replaced)
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload([__name__])
            self._pool = pebble.ProcessPool(max_workers=self.concurrency, context=ctx)
        return self._pool

    def _run_processes(self, calls: list[dict[str, Any]]) -> list[tuple[str, Any, float]]:
        """Score `calls` on the pool. A sample whose process died under it (an outside kill, the OOM
        killer, a crash) is scored again on a fresh process, up to `process_restarts` times: the
        death says nothing about the sample. pebble marks its whole pool broken when a process dies
        between tasks, so a broken pool is replaced and its samples are scored again the same way."""
        import pebble
        from concurrent.futures.process import BrokenProcessPool

        t0 = time.monotonic()
        out: list[tuple[str, Any, float] | None] = [None] * len(calls)
        deaths = [0] * len(calls)
        pending = list(range(len(calls)))
        while pending:
            pool = self._ensure_pool()
            if not pool.active:  # broke after its last call (a process died while it was idle)
                self._discard_pool()
                pool = self._ensure_pool()
            futures = [(i, pool.schedule(_child_score, args=(self.ref, calls[i]), timeout=self.timeout_s))
                       for i in pending]
            again = []
            for i, f in futures:
                try:
                    if not _settles(f, pool):
                        raise BrokenProcessPool("the scoring pool broke before it started this sample")
                    out[i] = ("ok", f.result(), time.monotonic() - t0)
                    continue
                except FutureTimeout:
                    out[i] = ("timeout", None, time.monotonic() - t0)
                    continue
                except (pebble.ProcessExpired, BrokenProcessPool) as e:
                    died: BaseException = e
                except Exception as e:
                    if pool.active:  # the function raised: an error of this sample
                        out[i] = ("error", _describe(e), time.monotonic() - t0)
                        continue
                    died = e
                deaths[i] += 1
                if deaths[i] <= self.process_restarts:
                    self.restarted += 1
                    again.append(i)
                else:
                    code = getattr(died, "exitcode", None)
                    out[i] = ("error", f"ProcessExpired: the scoring process died under this sample {deaths[i]} "
                              f"times (last: {f'exit code {code}' if code is not None else _describe(died)}): "
                              f"the function crashes its process or runs out of memory", time.monotonic() - t0)
            pending = again  # a pool broken meanwhile is replaced at the top of the loop
        return out  # type: ignore[return-value]

    def _discard_pool(self) -> None:
        if self._pool is not None:
            try:
                self._pool.stop()
                self._pool.join(timeout=5)
            except Exception:  # a broken pool may not join cleanly; its processes are gone or going
                pass
            self._pool = None

    # ------------------------------------------------------------------ asyncio
    async def _run_async(self, calls: list[dict[str, Any]]) -> list[tuple[str, Any, float]]:
        sem = asyncio.Semaphore(self.concurrency)

        async def one(call: dict[str, Any]) -> tuple[str, Any, float]:
            async with sem:
                t0 = time.monotonic()
                try:
                    value = await asyncio.wait_for(self.fn(**call), timeout=self.timeout_s)
                    return ("ok", value, time.monotonic() - t0)
                except asyncio.TimeoutError:
                    return ("timeout", None, time.monotonic() - t0)
                except Exception as e:
                    return ("error", _describe(e), time.monotonic() - t0)

        return list(await asyncio.gather(*(one(c) for c in calls)))
