"""Scoring many samples at once with a rule-based reward function, each under a time limit.

A `RewardScorer` wraps one verl-signature function (``module:function``) and scores a list of
samples concurrently, in one of three ways:

- ``thread`` (default): up to ``concurrency`` samples at once on threads: right for functions
  that wait on I/O (a sandbox, an HTTP judge) or release the GIL;
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

__all__ = ["Outcome", "RewardScorer"]



@dataclass
class Outcome:
    """One sample's result: its score and extras, or the error that replaced them."""

    score: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # "<ExceptionType>: message" when the function failed
    timed_out: bool = False
    seconds: float = 0.0


# ---------------------------------------------------------------- process-pool side
_CHILD_FN: dict[str, Any] = {}


def _child_score(ref: str, kwargs: dict[str, Any]) -> Any:
    """Runs in a pool process: import the function once per process, call it."""
    fn = _CHILD_FN.get(ref)
    if fn is None:
        fn = _CHILD_FN[ref] = load_reward_fn(ref)
    return fn(**kwargs)


# A pool thread takes a run of samples at once, as many as take about this long by the function's
# measured time per sample (and at most its share of the call's samples): handing samples one by one
# to threads costs ~20 us each, far more than a rule-based check (a 128-sample call of the addition
# task: 2.7 ms on the pool, 0.07 ms of scoring)
RUN_BUDGET_S = 0.002


class _Batch:
    """One `score` call's samples on the thread pool: results, when each running one started, and
    the run (the samples one thread scores in turn) each belongs to."""

    def __init__(self, n: int) -> None:
        self.results: list[tuple[str, Any, float] | None] = [None] * n
        self.started: dict[int, float] = {}
        self.remaining = n
        self.cond = threading.Condition()
        self.run_of: dict[int, list[tuple[int, dict[str, Any]]]] = {}

    def rest_of_run(self, i: int) -> list[tuple[int, dict[str, Any]]]:
        """The samples after `i` in its run that no thread has started (call under `cond`)."""
        run = self.run_of.get(i, [])
        after = [k for k, (j, _) in enumerate(run) if j == i]
        return [(j, kw) for j, kw in run[after[0] + 1:] if self.results[j] is None and j not in self.started] \
            if after else []


class _ThreadPool:
    """Long-lived scoring threads, `size` of them taking runs of samples off one queue (threads
    started per sample cost more than a rule-based function's scoring). A thread whose sample runs
    past its time limit is left behind: it ends once its function returns, the rest of its run goes
    back on the queue, and `replace` starts a fresh thread, so `size` threads keep serving."""

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
            task = self.tasks.get()
            if task is None:  # stopped
                return
            batch, run = task
            for i, kwargs in run:
                t0 = time.monotonic()
                with batch.cond:
                    batch.started[i] = t0
                try:
                    res: tuple[str, Any] = ("ok", self.fn(**kwargs))
                except Exception as e:  # the user's function failed: recorded per sample
                    res = ("error", _describe(e))
                with batch.cond:
                    if batch.results[i] is not None:  # given up on (timeout): this thread was replaced
                        return
                    batch.results[i] = (res[0], res[1], time.monotonic() - t0)
                    batch.started.pop(i, None)
                    batch.remaining -= 1
                    if not batch.remaining:
                        batch.cond.notify_all()


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()
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
        n = len(data_sources)
        extra_infos = list(extra_infos) if extra_infos is not None else [None] * n
        if not (len(solution_strs) == len(ground_truths) == len(extra_infos) == n):
            raise RewardFnError(f"RewardScorer.score got lists of different lengths: {n} data sources, "
                                f"{len(solution_strs)} solutions, {len(ground_truths)} ground truths, "
                                f"{len(extra_infos)} extra infos")
        calls = [{"data_source": data_sources[i], "solution_str": solution_strs[i],
                  "ground_truth": ground_truths[i], "extra_info": extra_infos[i]} for i in range(n)]
        if not calls:
            return []
        if self.is_async:
            raw = asyncio.run(self._run_async(calls))
        elif self.executor == "process":
            raw = self._run_processes(calls)
        else:
            raw = self._run_threads(calls)
        return [self._finish(i, calls[i], r) for i, r in enumerate(raw)]

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
    def _finish(self, i: int, call: dict[str, Any], raw: tuple[str, Any, float]) -> Outcome:
        kind, value, seconds = raw
        if kind == "timeout":
            return Outcome(error=f"TimeoutError: took longer than reward.timeout_s={self.timeout_s:g}s",
                           timed_out=True, seconds=seconds)
        if kind == "error":
            return Outcome(error=value, seconds=seconds)
        if type(value) is float and math.isfinite(value) or type(value) is int:  # the common case, checked cheaply
            return Outcome(score=float(value), seconds=seconds)
        where = f"reward function {self.label!r} on sample {i} (data_source={call['data_source']!r})"
        try:
            score, extra = normalise_score(value, where)
        except RewardFnError as e:
            return Outcome(error=f"RewardFnError: {e}", seconds=seconds)
        return Outcome(score=score, extra=extra, seconds=seconds)

    # ------------------------------------------------------------------ threads
    def _run_threads(self, calls: list[dict[str, Any]]) -> list[tuple[str, Any, float]]:
        if self._threads is None:
            self._threads = _ThreadPool(self.fn, self.concurrency)
        batch = _Batch(len(calls))
        # before the function's cost is known (its first call), or once it has timed out: one
        # sample per run, so slow samples never queue behind each other on one thread; and never
        # fewer runs than threads, so a function that turns slow still runs `concurrency` at a time
        size = 1 if not self.sample_s else max(1, min(-(-len(calls) // self.concurrency),
                                                      int(RUN_BUDGET_S / self.sample_s)))
        for a in range(0, len(calls), size):
            run = [(i, calls[i]) for i in range(a, min(a + size, len(calls)))]
            batch.run_of.update((i, run) for i, _ in run)
            self._threads.tasks.put((batch, run))
        self._threads.fill()
        with batch.cond:
            while batch.remaining:
                now = time.monotonic()
                if self.timeout_s is not None:
                    for i, t0 in list(batch.started.items()):
                        if now - t0 >= self.timeout_s:
                            batch.results[i] = ("timeout", None, now - t0)
                            del batch.started[i]
                            batch.remaining -= 1
                            self.abandoned_threads += 1
                            for j, kw in batch.rest_of_run(i):  # the stuck thread never starts these
                                batch.run_of[j] = [(j, kw)]
                                self._threads.tasks.put((batch, [(j, kw)]))
                            self._threads.replace()  # the stuck thread leaves the pool; a fresh one joins
                if not batch.remaining:
                    break
                wait = 0.5 if self.timeout_s is None else max(
                    0.001, min((t0 + self.timeout_s - now for t0 in batch.started.values()), default=0.05))
                batch.cond.wait(timeout=min(wait, 0.5))
        timed = [r[2] for r in batch.results if r is not None and r[0] != "timeout"]
        timed_out = any(r is not None and r[0] == "timeout" for r in batch.results)
        self.sample_s = None if timed_out or not timed else sum(timed) / len(timed)
        return batch.results  # type: ignore[return-value]

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
