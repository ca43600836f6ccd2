"""The step record, built once, and metrics.jsonl, written and read by one module. No Ray."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rlgraph.runtime.metrics import IdleClock, MetricsWriter, read_metrics, step_record
from rlgraph.runtime.step import LiveStep, StepKey, StepRecord, VALIDATE
from rlgraph.runtime.trace import Span


def _plan():
    return SimpleNamespace(summaries={"token_level_scores": "score"})


def _live(key, is_padding, dropped=None, refill=None, spans=()):
    sched = SimpleNamespace(dropped=dropped or {})
    rec = StepRecord(spans=list(spans), summaries={"token_level_scores": {0: 1.0, 1: 0.0, 2: 1.0}})
    lv = LiveStep(key, "train_0", sched, is_padding, t0=10.0, bytes0=5, t1=12.0, bytes1=5, rec=rec)
    lv.refill = refill or {}
    return lv


def test_a_step_record_counts_real_padding_and_dropped_rows_and_averages_real_rows_only():
    lv = _live(StepKey(3), [False, False, False, True], dropped={1: ("reward_error", True)})
    m = step_record(lv, _plan(), "stream", retries=1)
    assert m["step"] == 3 and isinstance(m["step"], int)
    assert (m["samples/real"], m["samples/padding"], m["samples/trained"], m["samples/dropped/reward_error"]) == \
        (3, 1, 2, 1)
    assert m["score/mean"] == 1.0  # the dropped row 1 is left out of the mean
    assert m["timing/step_s"] == 2.0 and m["driver/payload_bytes"] == 0 and m["faults/retries"] == 1


def test_a_refilled_step_counts_every_rounds_samples_and_only_its_own_padding():
    refill = {"real": 64, "dropped": {"zero_variance": 32}, "metrics": {"refill/rounds": 2}}
    lv = _live(StepKey(0), [False] * 32, refill=refill)
    m = step_record(lv, _plan(), "stream")
    assert (m["samples/real"], m["samples/trained"], m["samples/padding"]) == (64, 32, 0)
    assert m["refill/rounds"] == 2


def test_validation_keys_come_from_the_summaries_only():
    lv = _live(StepKey(1), [False] * 3)
    val = step_record(_live(StepKey(1, VALIDATE), [False] * 3), _plan(), "stream")
    m = step_record(lv, _plan(), "stream", validation=val)
    assert m["val/score/mean"] == pytest.approx(2 / 3)
    assert not any(k.startswith("val/samples") or k.startswith("val/timing") for k in m)


def test_the_idle_clock_measures_each_group_from_its_last_call_in_the_steps_before():
    clock = IdleClock()
    first = [Span("gen", "actor", 0, 0, 0, 4, start=0.0, end=1.0)]
    second = [Span("gen", "actor", 0, 1, 0, 4, start=1.5, end=2.0)]
    assert clock.record(first) == {}
    assert clock.record(second) == {"timing/idle/actor_s": 0.5}
    clock.clear()
    assert clock.record(second) == {}


def test_step_keys_order_rounds_before_their_step_and_validation_after_it():
    keys = [StepKey(1, VALIDATE), StepKey(2, 0, 1), StepKey(1), StepKey(2), StepKey(2, 0, 0), StepKey(1, 0, 0)]
    assert [str(k) for k in sorted(keys)] == ["1.round0", "1", "1.val", "2.round0", "2.round1", "2"]


def test_resume_keeps_the_steps_up_to_the_checkpoint_and_drops_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(4)) + '{"step": 4, "sco')
    with pytest.warns(RuntimeWarning, match=r"metrics.jsonl:5 is not a whole metrics record"):
        writer = MetricsWriter(path, resume_after=2)
    assert read_metrics(path) == [{"step": 0}, {"step": 1}, {"step": 2}]
    writer.write({"step": 3, "score/mean": 0.5})
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()


def test_a_new_run_starts_an_empty_file_and_reading_a_missing_one_gives_nothing(tmp_path):
    path = tmp_path / "out" / "metrics.jsonl"
    assert read_metrics(path) == []
    MetricsWriter(path)
    assert path.read_text() == ""
    path.write_text('{"step": 0}\nnot json\n[1, 2]\n{"step": 1}\n')
    assert read_metrics(path) == [{"step": 0}, {"step": 1}]  # what is not a record is skipped
