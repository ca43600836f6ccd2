"""Recovery's bookkeeping without Ray: retries counted per step, the error kept as what it is,
injected faults taken once; and, on Ray, a failed step's partitions cleared only after its other
calls have ended. The repairs themselves run end to end in test_faults.py, test_streaming.py and
tests/reliability/."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlgraph.errors import OpError, PipelineError, Problem, RLGraphError
from rlgraph.runtime.recovery import Fault, Recovery, Restore, first_line, plane_lost
from rlgraph.runtime.dataplane.base import DataPlaneDied
from rlgraph.runtime.fleet import PLANE


def _recovery(max_retries=1, faults=()):
    return Recovery(plan=None, fleet=None, weights=None, reporter=SimpleNamespace(fault=lambda m: None),
                    max_retries=max_retries, faults=list(faults))


def test_a_step_may_fail_max_retries_times_then_its_error_ends_the_run_as_what_it_is():
    r = _recovery(max_retries=1)
    e = OpError("op 'score' failed on worker reward[0] at step 3")
    r.count(3, e)  # the first failure is repaired
    r.count(4, e)  # failures count per step
    with pytest.raises(OpError, match=r"(?s)op 'score' failed.*step 3 failed 2 times; gave up after "
                                      r"trainer\.max_retries=1 retries") as info:
        r.count(3, e)
    assert info.value.__cause__ is None and r.attempts == {3: 2, 4: 1}


def test_an_error_whose_constructor_takes_other_arguments_keeps_its_type_and_fields():
    problem = Problem("cycle", "ops a and b read each other", "drop one edge")
    e = PipelineError([problem], "p")
    again = e.with_message("more context")
    assert type(again) is PipelineError and again.problems == [problem] and str(again) == "more context"
    r = _recovery(max_retries=0)
    with pytest.raises(PipelineError, match="gave up after trainer.max_retries=0"):
        r.count(0, e)


def test_a_foreign_error_becomes_an_rlgraph_error_naming_its_type():
    with pytest.raises(RLGraphError, match=r"^ValueError: bad\n\(step 0 failed 1 times"):
        _recovery(max_retries=0).count(0, ValueError("bad"))


def test_an_injected_fault_is_taken_as_many_times_as_asked_on_its_rank_only():
    r = _recovery(faults=[Fault("gen", step=2, chunk=1, kind="kill", rank=1, times=2)])
    assert r.take_fault("gen", 2, [1], rank=0) is None
    assert [r.take_fault("gen", 2, [0, 1], rank=1) for _ in range(3)] == ["kill", "kill", None]
    assert r.take_fault("gen", 3, [1], rank=1) is None


def test_a_fault_of_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="Fault.kind='explode'; use raise, kill or kill_after"):
        Fault("gen", step=0, kind="explode")


def test_a_lost_data_plane_is_told_apart_from_other_failures():
    dead = DataPlaneDied(["storage_0"], "running op 'gen' at step 0")
    assert plane_lost(dead) and plane_lost(Restore(dead, {PLANE}))
    assert not plane_lost(Restore(OpError("x"), {"actor"})) and not plane_lost(OpError("x"))


def test_first_line_gives_the_type_and_the_start_of_the_message():
    assert first_line(RuntimeError("boom\nat line 3")) == "RuntimeError: boom"
    assert first_line(RuntimeError()) == "RuntimeError"
    assert len(first_line(RuntimeError("x" * 500))) == len("RuntimeError: ") + 160


def test_a_lost_plane_past_its_retries_still_names_the_dead_processes():
    with pytest.raises(DataPlaneDied, match="storage_0 died") as info:
        _recovery(max_retries=0).count(0, DataPlaneDied(["storage_0"], "running op 'gen'"))
    assert info.value.dead == ["storage_0"]


class _Busy:
    """A stand-in worker: one call at a time, in order, as rlgraph's workers run their calls."""

    def work(self, seconds: float) -> None:
        import time

        time.sleep(seconds)

    def ping(self) -> bool:
        return True

    def forget(self, partition: str) -> None:
        pass


def _fleet(workers, source=None, timeout_s=30.0):
    from rlgraph.runtime.fleet import Fleet

    fleet = Fleet.__new__(Fleet)  # only what fence and clear_failed use
    cleared: list[str] = []
    fleet.workers, fleet.source, fleet.timeout_s = {"g": workers}, source, timeout_s
    fleet.plane = SimpleNamespace(clear=cleared.append)
    fleet._ahead_pending = {}  # reads ahead planned for workers (clear drops a cleared partition's)
    fleet._forget_pending = {}  # cleared partitions each worker is told of with its next call
    return fleet, cleared


@pytest.mark.ray
def test_a_failed_step_s_partitions_are_cleared_after_its_other_calls_have_ended(ray_cluster):
    """An abandoned call must not read a shared-memory segment its writer reuses once the partition
    is forgotten, nor put into row indexes TransferQueue gives the retry: fence first."""
    import time

    import ray

    from rlgraph.errors import StepTimeout

    busy, dead = ray.remote(_Busy).options(num_cpus=0), ray.remote(_Busy).options(num_cpus=0)
    a, b, c = busy.remote(), busy.remote(), dead.remote()
    ray.get([a.ping.remote(), b.ping.remote(), c.ping.remote()])
    ray.kill(c)  # a dead worker answers with an error, and holds nothing up
    fleet, cleared = _fleet([a, b, c], source=None)
    try:
        running = a.work.remote(1.5)
        t0 = time.monotonic()
        fleet.clear_failed(["train_3"], OpError("update failed"))
        assert time.monotonic() - t0 >= 1.2 and ray.get(running, timeout=1) is None
        assert cleared == ["train_3"]
        a.work.remote(30)  # a hung call: the run ends on the timeout, so nothing waits for it
        t0 = time.monotonic()
        fleet.clear_failed(["train_4"], StepTimeout("no progress"))
        assert time.monotonic() - t0 < 1.0 and cleared == ["train_3", "train_4"]
    finally:
        for w in (a, b):
            ray.kill(w)


class _Recorder:
    """A stand-in actor handle: records each method's .remote(...) call."""

    def __init__(self, log: list) -> None:
        self._log = log

    def __getattr__(self, method: str):
        log = self._log
        remote = lambda *args, **kwargs: log.append((method, args, kwargs))  # noqa: E731
        return SimpleNamespace(remote=remote, options=lambda **_: SimpleNamespace(remote=remote))


def test_a_cleared_partition_is_forgotten_with_each_worker_s_next_call_or_on_its_own_past_a_few():
    """Fleet.clear tells each worker (and the source) to drop what it kept of the partition with its
    next call (a call of its own would run between the worker's calls, on the step's path); a worker
    with no call while FORGET_BATCH partitions wait is sent them on their own."""
    from rlgraph.runtime.fleet import FORGET_BATCH, Fleet

    calls_a, calls_b, calls_src = [], [], []
    fleet = Fleet.__new__(Fleet)
    fleet.workers, fleet.source = {"g": [_Recorder(calls_a), _Recorder(calls_b)]}, _Recorder(calls_src)
    fleet.plane = SimpleNamespace(clear=lambda p: None, addresses=lambda partition, rows: None)
    fleet.plan = SimpleNamespace(op=lambda name: SimpleNamespace(streams=False))
    fleet._ahead_pending, fleet._forget_pending, fleet._parts_readers = {}, {}, {}
    fleet.clear("train_0")
    fleet.clear("train_1")
    assert calls_a == calls_b == calls_src == []  # nothing sent on its own
    call = SimpleNamespace(chunk=SimpleNamespace(op="gen", index=0), group="g", rank=0, fused=(), rows=[0, 1],
                           spans=[(0, 2)], after="")
    fleet.submit(call, step=2, partition="train_2", uids=[10, 11], tags=(False, False), batch_inputs={}, fault=None)
    (method, _, kwargs), = calls_a
    assert method == "run_chunk" and kwargs["forget"] == ["train_0", "train_1"]
    fleet.submit(call, step=3, partition="train_2", uids=[10, 11], tags=(False, False), batch_inputs={}, fault=None)
    assert "forget" not in calls_a[1][2]  # told once
    fleet.produce("train_3", rows=2, uid_start=0, validation=False)
    assert calls_src[0][0] == "produce" and calls_src[0][1][-1] == ["train_0", "train_1"]
    assert FORGET_BATCH == 4
    for k in range(2, 6):  # rank 1 got no call: at 4 waiting, they are sent on their own (rank 0 too, from train_2)
        fleet.clear(f"train_{k}")
    assert [args[0] for method, args, _ in calls_b if method == "forget"] == [f"train_{k}" for k in range(4)]
    assert [args[0] for method, args, _ in calls_a if method == "forget"] == [f"train_{k}" for k in range(2, 6)]
    assert fleet._forget_pending[("g", 1)] == ["train_4", "train_5"] and ("g", 0) not in fleet._forget_pending
