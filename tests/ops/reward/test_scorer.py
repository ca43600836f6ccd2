"""RewardScorer: concurrent scoring, per-sample time limits from each sample's start, errors per sample."""

import threading
import time
from pathlib import Path

import pytest

from rlgraph.ops.reward.functions import RewardFnError
from rlgraph.ops.reward.scorer import RewardScorer

FNS = str(Path(__file__).parents[2] / "resources" / "reward_fns.py")
GT = [str(i) for i in range(8)]  # odd ground truths: 1, 3, 5, 7


def _score(scorer, gts=GT):
    return scorer.score(["add"] * len(gts), gts, gts, None)


def test_threads_score_concurrently_and_keep_extras():
    s = RewardScorer(f"{FNS}:slow", executor="thread", concurrency=8)
    t0 = time.monotonic()
    out = _score(s)
    assert time.monotonic() - t0 < 0.05 * 8  # 8 x 50 ms, run at once
    assert [o.score for o in out] == [1.0] * 8 and all(o.extra == {"slow": 1.0} for o in out)


def test_thread_timeout_counts_from_each_sample_start():
    # concurrency 2: 8 samples of which 4 stall; the limit must not expire for samples still queued
    s = RewardScorer(f"{FNS}:stall_on_odd", executor="thread", concurrency=2, timeout_s=0.3)
    out = _score(s)
    assert [o.timed_out for o in out] == [i % 2 == 1 for i in range(8)]
    assert [o.score for o in out if not o.timed_out] == [1.0] * 4
    assert all("reward.timeout_s=0.3" in o.error for o in out if o.timed_out)
    assert s.abandoned_threads == 4


def test_a_fast_function_s_call_goes_to_one_thread_and_a_stall_brings_in_the_others(monkeypatch):
    from rlgraph.ops.reward import scorer

    monkeypatch.setattr(scorer, "RUN_BUDGET_S", 0.05)  # a busy machine may start a thread 2 ms late
    s = RewardScorer(f"{FNS}:stall_on_odd", executor="thread", concurrency=4, timeout_s=0.3)
    evens = [str(2 * i) for i in range(64)]
    assert all(o.score == 1.0 for o in _score(s, evens)) and 0 < s.sample_s < 5e-4  # measured: fast
    handed = []  # each thread handed a call, by the name of the thread that took it

    class Counted:  # the pool's queue, noting which thread takes each hand-out of a call
        def __init__(self, q):
            self.q = q

        def put(self, task):
            self.q.put(task)

        def get(self):
            task = self.q.get()
            if task is not None:
                handed.append(threading.current_thread().name)
            return task

    from rlgraph.ops.reward.scorer import _ThreadPool

    s.close()
    s._threads = _ThreadPool(s.fn, s.concurrency)  # fresh threads, started on the counted queue
    s._threads.tasks = Counted(s._threads.tasks)
    assert all(o.score == 1.0 for o in _score(s, evens))
    assert len(handed) == 1  # 64 samples of a fast function: one thread, no hand-off per sample
    handed.clear()
    gts = ["0", "2", "1", "4", "6", "8"]  # the third stalls; the three after it wait untaken
    t0 = time.monotonic()
    out = _score(s, gts)
    assert time.monotonic() - t0 < 2.0
    assert [o.timed_out for o in out] == [False, False, True, False, False, False]
    assert [o.score for o in out if not o.timed_out] == [1.0] * 5  # scored by the threads brought in
    assert 2 <= len(handed) <= 4 and s.abandoned_threads == 1  # other threads took the rest
    assert all(o.seconds < 0.3 for i, o in enumerate(out) if i != 2)
    assert s.sample_s is None  # it stalled: the next call starts on every thread again


def test_without_a_time_limit_a_fast_call_is_scored_on_the_caller_s_thread():
    # no limit to enforce: once a call's measured work fits one thread, the next call scores on the caller's
    # thread (no hand-off), with the same results and errors per sample; a function that turned slow goes
    # back to the threads, and with a limit a call never runs on the caller's thread
    s = RewardScorer(f"{FNS}:where_scored", executor="thread", concurrency=4, timeout_s=0)
    seen, delay = s.fn.__globals__["SCORED_ON"], s.fn.__globals__["DELAY_S"]
    gts = ["0", "2", "boom", "4"]
    first = _score(s, gts)
    assert {name for name, _ in seen} != {threading.current_thread().name}  # unmeasured: on the threads
    assert 0 < s.sample_s < 1e-3
    seen.clear()
    second = _score(s, gts)
    assert [gt for _, gt in seen] == gts and {name for name, _ in seen} == {threading.current_thread().name}
    for a, b in zip(first, second):
        assert (a.score, a.extra, a.error, a.timed_out) == (b.score, b.extra, b.error, b.timed_out)
    assert second[2].error == "ValueError: boom" and [o.score for o in second] == [1.0, 1.0, 0.0, 1.0]
    delay[0] = 0.004  # 16 ms for the call: more than one thread's budget (2 ms)
    seen.clear()
    slowed = _score(s, gts)  # started here; the samples left once 2 ms had passed go to the threads
    assert [gt for _, gt in seen][:1] == ["0"] and seen[0][0] == threading.current_thread().name
    assert threading.current_thread().name not in {name for name, _ in seen[-2:]}
    assert [o.score for o in slowed] == [1.0, 1.0, 0.0, 1.0] and slowed[2].error == "ValueError: boom"
    seen.clear()
    _score(s, gts)
    assert threading.current_thread().name not in {name for name, _ in seen}  # measured slow: on the threads
    delay[0] = 0.0
    limited = RewardScorer(f"{FNS}:where_scored", executor="thread", concurrency=4, timeout_s=10)
    _score(limited, gts)
    seen.clear()
    _score(limited, gts)
    assert threading.current_thread().name not in {name for name, _ in seen}
    s.close()
    limited.close()


def test_samples_are_scored_once_each_on_many_threads_with_the_results_in_order():
    s = RewardScorer(f"{FNS}:slow", executor="thread", concurrency=8)
    gts = [str(i) for i in range(40)]
    out = _score(s, gts)
    assert [o.score for o in out] == [1.0] * 40 and all(o.extra == {"slow": 1.0} for o in out)
    assert s._threads.started == 8  # 40 x 50 ms on all eight threads (the cost was not known yet)


@pytest.mark.parametrize("timeout_s", [0.2, 0.0])
def test_every_sample_is_scored_exactly_once_through_stalls_and_the_pool_stays_whole(timeout_s):
    s = RewardScorer(f"{FNS}:counted", executor="thread", concurrency=4, timeout_s=timeout_s)
    calls = s.fn.__globals__["CALLS"]
    for round_ in range(3):  # the first call on every thread, then as many as the measured cost needs
        calls.clear()
        gts = [str(i) for i in range(48)]  # 3, 10, 17, ... stall 0.5 s
        out = _score(s, gts)
        assert all(calls[g] == 1 for g in gts) and len(calls) == 48  # none lost, none scored twice
        stalled = [int(g) % 7 == 3 for g in gts]
        if timeout_s:
            assert [o.timed_out for o in out] == stalled
        assert [o.score for o, st in zip(out, stalled) if not (timeout_s and st)] == \
            [1.0] * (48 - (sum(stalled) if timeout_s else 0))
        assert s._threads.serving == 4  # given-up threads were replaced
    assert s.abandoned_threads == (21 if timeout_s else 0)  # 7 stalls a call


def test_errors_are_per_sample():
    s = RewardScorer(f"{FNS}:raise_on_odd", concurrency=3)
    out = _score(s)
    assert [o.error is not None for o in out] == [i % 2 == 1 for i in range(8)]
    assert out[1].error == "ValueError: odd ground truth 1" and not out[1].timed_out
    bad = _score(RewardScorer(f"{FNS}:not_a_number"), ["1"])[0]
    assert bad.error.startswith("RewardFnError:") and "returned str 'high'" in bad.error


def test_async_functions_run_on_an_event_loop():
    s = RewardScorer(f"{FNS}:async_stall_on_odd", concurrency=4, timeout_s=0.3)
    assert s.is_async
    out = _score(s)
    assert [o.timed_out for o in out] == [i % 2 == 1 for i in range(8)]


def test_process_pool_kills_stalled_samples():
    s = RewardScorer(f"{FNS}:stall_on_odd", executor="process", concurrency=2, timeout_s=0.5)
    try:
        t0 = time.monotonic()
        out = _score(s)
        assert time.monotonic() - t0 < 25  # the 30 s stalls were cut
        assert [o.timed_out for o in out] == [i % 2 == 1 for i in range(8)]
        assert [o.score for o in out if not o.timed_out] == [1.0] * 4
    finally:
        s.close()


def _pool_processes():
    import psutil

    servers = [p for p in psutil.Process().children() if "forkserver" in " ".join(p.cmdline())]
    return servers + [p for server in servers for p in server.children()]  # it and the pool's processes


def test_a_scoring_process_killed_from_outside_costs_no_sample():
    """kill -9 of the pool's processes and the fork server they come from, mid-call (a user, the OOM
    killer): each sample they were scoring is scored again on a fresh process (the fork server is
    started again) and the call's results equal an undisturbed call's."""
    import os
    import signal
    import threading

    s = RewardScorer(f"{FNS}:slow_in_process", executor="process", concurrency=2)
    try:
        clean = [(o.score, o.error) for o in _score(s)]
        assert s.restarted == 0 and all(e is None for _, e in clean)
        killed = []

        def kill_soon():
            time.sleep(0.25)  # the first two samples are running
            for p in _pool_processes():
                os.kill(p.pid, signal.SIGKILL)
                killed.append(p.pid)

        killer = threading.Thread(target=kill_soon)
        killer.start()
        out = _score(s)
        killer.join()
        assert killed
        assert [(o.score, o.error) for o in out] == clean
        assert s.restarted >= 1
    finally:
        s.close()


def test_a_pool_whose_processes_were_killed_between_calls_is_replaced():
    """pebble marks a pool broken when its processes die between tasks; the next call gets a new
    pool and scores every sample."""
    import os
    import signal

    s = RewardScorer(f"{FNS}:slow", executor="process", concurrency=2)
    try:
        clean = [(o.score, o.error) for o in _score(s)]
        for p in _pool_processes():
            os.kill(p.pid, signal.SIGKILL)
        assert [(o.score, o.error) for o in _score(s)] == clean
    finally:
        s.close()


@pytest.mark.timeout(60)
def test_samples_a_broken_pool_never_started_are_scored_again_on_a_new_pool(monkeypatch):
    """pebble settles the tasks it had started when its pool breaks, not those still in its queue:
    those are scored again on a new pool instead of being waited for without end (it happened when
    the pool's processes and fork server were killed at once: the call hung to the step's timeout)."""
    from concurrent.futures import Future

    from rlgraph.ops.reward import scorer as scorer_mod

    class Broken:  # a pool that takes the samples and breaks before starting any of them
        active = True

        def schedule(self, fn, args=(), timeout=None):
            self.active = False
            return Future()  # never settled, as pebble leaves a queued task of a broken pool

        def stop(self):
            pass

        def join(self, timeout=None):
            pass

    monkeypatch.setattr(scorer_mod, "POOL_CHECK_S", 0.05, raising=False)
    s = RewardScorer(f"{FNS}:slow", executor="process", concurrency=2)
    try:
        clean = [(o.score, o.error) for o in _score(s, GT[:4])]
        s._discard_pool()
        s._pool = Broken()
        t0 = time.monotonic()
        out = _score(s, GT[:4])
        assert time.monotonic() - t0 < 30
        assert [(o.score, o.error) for o in out] == clean and s.restarted == 4
    finally:
        s.close()


def test_a_function_that_kills_its_process_every_time_becomes_an_error_after_the_restarts():
    s = RewardScorer(f"{FNS}:crash_on_odd", executor="process", concurrency=2, process_restarts=1)
    try:
        out = _score(s, GT[:4])
        assert [o.error is None for o in out] == [True, False, True, False]
        assert out[1].error.startswith("ProcessExpired: the scoring process died under this sample 2 times")
        assert s.restarted == 2  # one restart for each odd sample
    finally:
        s.close()


def test_bad_settings_are_errors():
    with pytest.raises(RewardFnError, match="executor 'gpu'"):
        RewardScorer(f"{FNS}:slow", executor="gpu")
    with pytest.raises(RewardFnError, match="has signature"):
        RewardScorer("rlgraph.ops.reward.functions:parse_answer")


def test_a_bad_reward_function_fails_compilation():
    from rlgraph import PipelineError, compile
    from rlgraph.graph.loader import load_pipeline

    pipeline, ref = load_pipeline(str(Path(FNS).with_name("reward_pipeline.py")))
    with pytest.raises(PipelineError, match=r"op 'reward': reward function "
                                            r"'rlgraph.ops.reward.functions:parse_answer' has signature"):
        compile(pipeline, ["reward.fn=rlgraph.ops.reward.functions:parse_answer"], pipeline_ref=ref)


@pytest.mark.parametrize("timeout_s", [0.0, 10.0])
def test_scores_keep_floats_as_given_and_every_other_result_as_one_outcome_would(timeout_s):
    # a call's Scores: each sample's score (0 where it failed), the failed samples' outcomes, the extras of
    # dict results; a call of finite floats only is kept as the function gave it. On the caller's thread
    # (timeout_s=0, from the second call) and on the threads alike
    s = RewardScorer(f"{FNS}:mixed", executor="thread", concurrency=2, timeout_s=timeout_s)
    gts = ["half", "one", "dict", "nan", "str", "raise", "big", "big", "true"]
    for _ in range(2):
        got = s.scores(["add"] * len(gts), gts, gts, None)
    assert got.values == [0.5, 1.0, 0.25, 0.0, 0.0, 0.0, 1e308, 1e308, 1.0]  # True counts as 1
    assert sorted(got.failed) == [3, 4, 5] and got.failed[5].error == "ValueError: asked to"
    assert "non-finite score nan" in got.failed[3].error and "returned str 'high'" in got.failed[4].error
    assert got.extras == {2: {"k": 1.0}}
    outcomes = got.outcomes()
    assert [o.score for o in outcomes] == got.values and outcomes[2].extra == {"k": 1.0}
    assert [o.error is not None for o in outcomes] == [i in (3, 4, 5) for i in range(len(gts))]
    floats = s.scores(["add"] * 3, ["x"] * 3, ["half", "big", "half"], None)
    assert floats.values == [0.5, 1e308, 0.5] and not floats.failed and not floats.extras
    s.close()
