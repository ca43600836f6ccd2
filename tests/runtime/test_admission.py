"""A step's admission in two halves (`rlgraph.runtime.admission`): the source fills the next step's
partition while the event loop runs the current step's calls; a source that fails there stops the
run with its own error and leaves no partition behind."""

import json
from pathlib import Path

import pytest

from rlgraph import compile
from rlgraph.graph.loader import load_pipeline
from rlgraph.runtime.runner import Runner, RunOptions

pytestmark = pytest.mark.ray

PIPELINE = str(Path(__file__).parents[1] / "resources" / "tensor_pipeline.py")


def _plan(*overrides):
    pipeline, ref = load_pipeline(PIPELINE)
    return compile(pipeline, list(overrides), pipeline_ref=ref)


def _partitions(plane):
    return set(plane._run(plane._client.async_get_partition_list(), "list the controller's partitions"))


def test_the_next_step_is_admitted_while_the_current_one_runs(tq_plane, tmp_path, monkeypatch):
    from rlgraph.runtime import admission

    plan = _plan("trainer.steps=3")
    events = []  # in the driver's order: ("produce", step), ("admitted", step), ("submit", step)
    admitted = admission.admitted
    monkeypatch.setattr(admission, "admitted", lambda runner, a: events.append(("admitted", a.key.step))
                        or admitted(runner, a))
    with Runner(plan, RunOptions(out_dir=tmp_path, timeout_s=60), tq_plane) as runner:
        produce, submit = runner.fleet.produce, runner.fleet.submit
        runner.fleet.produce = lambda partition, *a: events.append(("produce", int(partition.split("_")[1]))) \
            or produce(partition, *a)
        runner.fleet.submit = lambda call, step, *a, **kw: events.append(("submit", step)) or submit(call, step, *a, **kw)
        records = runner.run()
    assert [r["step"] for r in records] == [0, 1, 2]
    # step 1's source call was under way while calls of step 0 went out
    start, end = events.index(("produce", 1)), events.index(("admitted", 1))
    assert ("submit", 0) in events[start:end], events


def test_a_source_failing_on_a_later_step_stops_the_run_and_leaves_no_partition(tq_plane, tmp_path):
    plan = _plan("data.fail_at=10", "trainer.steps=4")  # 5 prompts a batch: the third batch fails
    before = _partitions(tq_plane)
    with pytest.raises(Exception, match="told to fail at position 10"):
        with Runner(plan, RunOptions(out_dir=tmp_path, timeout_s=60), tq_plane) as runner:
            runner.run()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0]  # step 2's batch failed while step 1 ran: step 0 was written, step 1 abandoned
    assert _partitions(tq_plane) <= before  # the failed step's partition, and every other, cleared


def test_an_ended_step_s_partition_is_cleared_after_a_call_of_the_next_and_none_is_left(tq_plane, tmp_path):
    """The clear waits for the calls out after the next wait (`Runner._events`): the next step's first
    call overlaps the next admission only (its partition and the source's call), and the clear
    overlaps a call of its own."""
    plan = _plan("trainer.steps=4")
    before = _partitions(tq_plane)
    events = []
    with Runner(plan, RunOptions(out_dir=tmp_path, timeout_s=60), tq_plane) as runner:
        produce, submit, clear = runner.fleet.produce, runner.fleet.submit, runner.fleet.clear
        runner.fleet.produce = lambda partition, *a: events.append(("produce", partition)) or produce(partition, *a)
        runner.fleet.submit = lambda call, step, *a, **kw: events.append(("submit", step)) or submit(call, step, *a, **kw)
        runner.fleet.clear = lambda partition: events.append(("clear", partition)) or clear(partition)
        records = runner.run()
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert [e[1] for e in events if e[0] == "clear"] == ["train_0", "train_1", "train_2", "train_3"]
    for step in (0, 1):  # cleared once a call of the step after it and the admission of the one after that were out
        before_clear = events[:events.index(("clear", f"train_{step}"))]
        assert ("submit", step + 1) in before_clear and ("produce", f"train_{step + 2}") in before_clear, events
    assert _partitions(tq_plane) <= before
