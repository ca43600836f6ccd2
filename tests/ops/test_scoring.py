"""RewardScorer: concurrent scoring, per-sample time limits from each sample's start, errors per sample."""

import time
from pathlib import Path

import pytest

from rlgraph.ops.rewards import RewardFnError
from rlgraph.ops.scoring import RewardScorer

FNS = str(Path(__file__).parents[1] / "resources" / "reward_fns.py")
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


def test_bad_settings_are_errors():
    with pytest.raises(RewardFnError, match="executor 'gpu'"):
        RewardScorer(f"{FNS}:slow", executor="gpu")
    with pytest.raises(RewardFnError, match="has signature"):
        RewardScorer("rlgraph.ops.rewards:parse_answer")


def test_a_bad_reward_function_fails_compilation():
    from rlgraph import PipelineError, compile
    from rlgraph.graph.loader import load_pipeline

    pipeline, ref = load_pipeline(str(Path(FNS).with_name("reward_pipeline.py")))
    with pytest.raises(PipelineError, match=r"op 'reward': reward function 'rlgraph.ops.rewards:parse_answer' has "
                                            r"signature"):
        compile(pipeline, ["reward.fn=rlgraph.ops.rewards:parse_answer"], pipeline_ref=ref)
