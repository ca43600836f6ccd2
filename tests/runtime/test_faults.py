"""Fault tolerance on real Ray and TransferQueue: ops that raise and workers that die mid-step are
retried, restarted and restored so the run ends exactly as an undisturbed one; retries are bounded;
every sample is accounted for (produced = trained + padding + dropped)."""

from pathlib import Path

import pytest

from rlgraph import compile
from rlgraph.graph.loader import load_pipeline
from rlgraph.runtime.invoke import OpError
from rlgraph.runtime.runner import Fault, RunOptions, WorkerDiedError, run_plan

pytestmark = pytest.mark.ray

PIPELINE = str(Path(__file__).parents[1] / "resources" / "tensor_pipeline.py")
# 5 prompts x n=3 = 15 samples; actor dp=2 -> 16 rows, 1 padding row; score: 3 rows per call
OVERRIDES = ["gen.n=3", "groups.actor.dp=2"]
VOLATILE = ("timing/", "throughput/", "driver/result_bytes", "schedule", "load/", "faults/")
STEPS = 3


def _plan(*overrides):
    pipeline, ref = load_pipeline(PIPELINE)
    return compile(pipeline, [*OVERRIDES, *overrides], pipeline_ref=ref)


def _run(plan, out, plane, **kw):
    return run_plan(plan, RunOptions(out_dir=out, timeout_s=120, steps=STEPS, **kw), plane=plane)


def _stable(records):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def _accounted(rec):
    produced = rec["samples/real"] + rec["samples/padding"]
    return produced == rec["samples/trained"] + rec["samples/padding"] + rec["samples/dropped"] == 16


@pytest.fixture(scope="module")
def baseline(tq_plane, tmp_path_factory):
    return _run(_plan(), tmp_path_factory.mktemp("baseline"), tq_plane)


@pytest.mark.slow
def test_stateless_failures_are_repaired_in_place(tq_plane, tmp_path, baseline):
    faults = [
        Fault("score", step=0, chunk=2, kind="raise"),  # a stateless op raised: run it again in place
        Fault("score", step=1, chunk=1, kind="kill"),  # a stateless worker died: restart it, re-run its work
        Fault("adv", step=2, chunk=0, kind="kill_after"),  # ... after it had written its outputs
    ]
    recs = _run(_plan(), tmp_path, tq_plane, faults=faults)
    assert _stable(recs) == _stable(baseline)
    assert [r["faults/retries"] for r in recs] == [1, 1, 1]
    assert [r["faults/restarts"] for r in recs] == [0, 1, 1]
    assert all(_accounted(r) for r in recs)


@pytest.mark.parametrize("save_every", [1, 0])
def test_dead_stateful_worker_is_restored_and_the_steps_replayed(tq_plane, tmp_path, baseline, save_every):
    # rank 1 of the dp=2 actor group dies while generating in step 2: the group restarts, every worker
    # is restored from the step-1 checkpoint (or, without checkpoints, from the start, replaying 0-1)
    # and, in step 1, an update raises: not re-run in place (it may have changed the weights) but restored
    faults = [Fault("gen", step=2, chunk=1, kind="kill"), Fault("update", step=1, chunk=0, kind="raise", rank=0)]
    recs = _run(_plan(f"trainer.save_every={save_every}"), tmp_path, tq_plane, faults=faults)
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert _stable(recs) == _stable(baseline)
    assert [r["faults/retries"] for r in recs] == [0, 1, 1]
    # actors restarted, counted in the step each restore ran for: with a checkpoint the raise is restored
    # in place and the kill restarts the dead group (dp=2); without one, every worker (5) restarts both times
    workers = sum(g.dp for g in _plan().groups)
    assert [r["faults/restarts"] for r in recs] == ([0, 0, 2] if save_every else [0, workers, workers])
    assert all(_accounted(r) for r in recs)


def test_retries_are_bounded(tq_plane, tmp_path):
    with pytest.raises(OpError, match=r"(?s)injected failure in score step 0 chunk 0.*step 0 failed 3 times; "
                                      r"gave up after trainer\.max_retries=2 retries"):
        _run(_plan(), tmp_path, tq_plane, faults=[Fault("score", step=0, chunk=0, times=5)])


def test_no_retries_fails_at_once(tq_plane, tmp_path):
    # the call holding chunk 0 (3 rows), with the other chunks of score ready at the same time (batched)
    with pytest.raises(WorkerDiedError, match=r"(?s)worker reward\[0\] died while running op 'score' at step 0 "
                                              r"\(chunks? 0(, \d+)*, (3|6|9|12) rows\): ActorDiedError.*gave up after "
                                              r"trainer\.max_retries=0"):
        _run(_plan("trainer.max_retries=0"), tmp_path, tq_plane, faults=[Fault("score", step=0, kind="kill")])
