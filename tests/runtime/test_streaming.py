"""Streaming op bodies on real Ray and TransferQueue: a generator yields its groups as they finish,
each part is put and reported at once, and ops downstream start on it while the call still runs."""

import dataclasses
import json
from pathlib import Path

import pytest

from rlgraph import compile
from rlgraph.graph.loader import load_pipeline
from rlgraph.runtime.runner import Fault, RunOptions, run_plan

pytestmark = pytest.mark.ray

PIPELINE = str(Path(__file__).parents[1] / "resources" / "stream_pipeline.py")
VOLATILE = ("timing/", "throughput/", "driver/result_bytes", "schedule", "load/", "gen/gen_metrics/seconds")


def _plan(*overrides):
    pipeline, ref = load_pipeline(PIPELINE)
    return compile(pipeline, list(overrides), pipeline_ref=ref)


def _stable(records):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def _same_after_one_retry(retried, clean):
    """Step 1 failed once and ran again: the records are the clean run's, but for its retry count."""
    assert retried[1]["faults/retries"] == 1
    assert _stable(retried) == [{**r, "faults/retries": retried[i]["faults/retries"]}
                                for i, r in enumerate(_stable(clean))]


def _same_after_a_restore(killed, clean):
    """A worker died at step 1: restored and replayed, the records are the clean run's but for the faults."""
    assert _stable(killed) == [{**r, "faults/retries": r["faults/retries"] + (1 if r["step"] == 1 else 0),
                                "faults/restarts": killed[i]["faults/restarts"]}
                               for i, r in enumerate(_stable(clean))]


def _spans(out):
    return [e for e in json.loads((out / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]


def test_plan_declares_the_streaming_op():
    plan = _plan()
    gen = plan.op("gen")
    assert gen.streams and gen.batching.per_rank and plan.op("score").streams is False
    assert plan.op("adv").vectorised and not gen.vectorised
    # one call per rank: 6 prompts x 2 on one rank, in one chunk
    from rlgraph.runtime.scheduler import make_chunks

    uids = [p for p in range(6) for _ in range(2)]
    assert [c.rows for c in make_chunks(gen, uids)] == [tuple(range(12))]


def test_parts_start_downstream_ops_before_the_call_ends_and_schedules_agree(tq_plane, tmp_path):
    plan = _plan()
    stream = run_plan(plan, RunOptions(out_dir=tmp_path / "stream", steps=2, schedule="stream", timeout_s=120),
                      plane=tq_plane)
    sync = run_plan(plan, RunOptions(out_dir=tmp_path / "sync", steps=2, schedule="sync", timeout_s=120),
                    plane=tq_plane)
    assert _stable(stream) == _stable(sync)
    assert stream[0]["gen/gen_metrics/groups"] == 6 and stream[1]["update/update_metrics/w"] > 1.0
    # adv is vectorised: however its groups arrive (one call for all six under sync), a record per group
    assert [r["adv/adv_metrics/groups_count"] for r in stream + sync] == [6] * 4
    assert all(r["adv/adv_metrics/chunk_rows_max"] == 2 for r in stream + sync)
    assert [r["timing/adv/calls"] for r in sync] == [1, 1]
    for out, overlaps in ((tmp_path / "stream", True), (tmp_path / "sync", False)):
        spans = _spans(out)
        for step in (0, 1):
            (gen,) = [s for s in spans if s["name"] == "gen" and s["args"]["step"] == step]
            gen_end = gen["ts"] + gen["dur"]
            early = [s for s in spans if s["name"] in ("score", "adv") and s["args"]["step"] == step
                     and s["ts"] < gen_end]
            assert bool(early) == overlaps, (out.name, step, gen, early)
        parts = [e for e in json.loads((out / "trace.json").read_text())["traceEvents"] if e["ph"] == "i"]
        assert len([p for p in parts if p["name"] == "gen part"]) == 2 * 6  # a part per group, per step


def test_a_streaming_call_that_fails_after_a_part_is_run_again(tq_plane, tmp_path):
    plan = _plan()
    clean = run_plan(plan, RunOptions(out_dir=tmp_path / "clean", steps=2, timeout_s=120), plane=tq_plane)
    failing = _plan("gen.fail_step=1")
    # fail_step makes gen raise after its first part on every try: more tries than retries -> the step fails
    with pytest.raises(Exception, match=r"gen was told to fail after its first part"):
        run_plan(failing, RunOptions(out_dir=tmp_path / "fail", steps=2, timeout_s=120), plane=tq_plane)
    # failing once, after its first part was handed on (score may have started on it): run again, same results
    once = _plan("gen.fail_step=1", f"gen.fail_once_file={tmp_path / 'failed_once'}")
    retried = run_plan(once, RunOptions(out_dir=tmp_path / "once", steps=2, timeout_s=120), plane=tq_plane)
    _same_after_one_retry(retried, clean)
    # a worker killed after it wrote its outputs (all parts) costs a restore and replay, no sample
    killed = run_plan(plan, RunOptions(out_dir=tmp_path / "killed", steps=2, timeout_s=120,
                                       faults=[Fault("gen", step=1, kind="kill_after")]), plane=tq_plane)
    _same_after_a_restore(killed, clean)


def test_an_op_fused_into_a_streaming_call_runs_inside_it_and_changes_no_result(tq_plane, tmp_path):
    plan = _plan()
    assert plan.op("lp").fused_into == "gen" and plan.followers("gen") == ["lp"]
    # adv (per group) rides in score's calls (per sample, 2 rows = one group of n=2), reading gen's mask
    # with score's get and the source's uid
    assert plan.op("adv").fused_into == "score" and plan.followers("score") == ["adv"]
    unfused = _plan("trainer.fuse_ops=false")
    assert unfused.op("lp").fused_into is None and unfused.op("adv").fused_into is None
    fused = run_plan(plan, RunOptions(out_dir=tmp_path / "fused", steps=2, timeout_s=120), plane=tq_plane)
    sync = run_plan(plan, RunOptions(out_dir=tmp_path / "sync", steps=2, schedule="sync", timeout_s=120),
                    plane=tq_plane)
    alone = run_plan(unfused, RunOptions(out_dir=tmp_path / "alone", steps=2, timeout_s=120), plane=tq_plane)
    assert _stable(fused) == _stable(sync)
    # unfused, the same results; only the data plane carries more (adv's get of the scores and mask)
    moved = "dataplane/local_bytes"
    assert [{k: v for k, v in r.items() if k != moved} for r in _stable(fused)] == \
        [{k: v for k, v in r.items() if k != moved} for r in _stable(alone)]
    assert all(f[moved] < a[moved] for f, a in zip(fused, alone))
    # 12 rows in chunks of 5: three lp metric records per step, in both runs
    assert [r["lp/lp_metrics/rows"] for r in fused] == [12 / 3] * 2 and fused[1]["lp/lp_metrics/chunk"] == 1
    for step in (0, 1):
        spans = [s for s in _spans(tmp_path / "fused") if s["args"]["step"] == step]
        (gen,) = [s for s in spans if s["name"] == "gen"]
        (lp,) = [s for s in spans if s["name"] == "lp"]  # one call's worth: inside gen's, right after its body
        assert lp["args"]["fused_into"] == "gen" and lp["tid"] == gen["tid"]
        assert gen["ts"] + gen["dur"] <= lp["ts"] + 1
        (alone_lp,) = [s for s in _spans(tmp_path / "alone") if s["args"]["step"] == step and s["name"] == "lp"]
        assert "fused_into" not in alone_lp["args"]


def test_a_failure_inside_a_fused_op_runs_the_fused_call_again(tq_plane, tmp_path):
    plan = _plan()
    clean = run_plan(plan, RunOptions(out_dir=tmp_path / "clean", steps=2, timeout_s=120), plane=tq_plane)
    with pytest.raises(Exception, match=r"op 'lp' failed on worker actor\[0\] at step 1 .*lp was told to fail"):
        run_plan(_plan("lp.fail_step=1"), RunOptions(out_dir=tmp_path / "fail", steps=2, timeout_s=120),
                 plane=tq_plane)
    once = _plan("lp.fail_step=1", f"lp.fail_once_file={tmp_path / 'failed_once'}")
    retried = run_plan(once, RunOptions(out_dir=tmp_path / "once", steps=2, timeout_s=120), plane=tq_plane)
    _same_after_one_retry(retried, clean)
    # the actor killed inside the fused op (after gen's parts were put): a restore and replay, no sample lost
    killed = run_plan(plan, RunOptions(out_dir=tmp_path / "killed", steps=2, timeout_s=120,
                                       faults=[Fault("lp", step=1, chunk=1, kind="kill")]), plane=tq_plane)
    assert killed[1]["faults/restarts"] >= 1
    _same_after_a_restore(killed, clean)
    # the reward worker (no state) killed inside adv, fused into score's call: restarted, the call run again
    dead = run_plan(plan, RunOptions(out_dir=tmp_path / "dead_adv", steps=2, timeout_s=120,
                                     faults=[Fault("adv", step=1, chunk=0, kind="kill")]), plane=tq_plane)
    assert [r["faults/restarts"] for r in dead] == [0, 1]  # its group alone, no restore
    assert _stable(dead) == [{**r, "faults/retries": dead[i]["faults/retries"],
                              "faults/restarts": dead[i]["faults/restarts"]} for i, r in enumerate(_stable(clean))]


def test_a_streaming_call_whose_parts_no_other_group_reads_returns_once_with_the_same_results(tq_plane, tmp_path,
                                                                                              monkeypatch):
    """With score and adv on the actor too, nothing can start on gen's parts before its call ends
    (its group's ops wait for the call, and it has one rank): Fleet calls run_chunk_whole, one Ray
    result instead of a report per part; the parts' summaries come with the call's result, and every
    record is the one the same layout gives with its parts streamed."""
    from rlgraph.graph.dsl import op_spec
    from rlgraph.runtime.fleet import Fleet

    pipeline, ref = load_pipeline(PIPELINE)
    local = pipeline.with_ops(*(op_spec(o).with_(group="actor") for o in pipeline.ops if op_spec(o).name in
                                ("score", "adv"))).with_groups(drop=["reward"])
    local = dataclasses.replace(local, summaries={**local.summaries, "mask": "length"})  # a summary of gen's parts
    whole = compile(local, [], pipeline_ref=ref)
    fleet = Fleet.__new__(Fleet)
    for plan, elsewhere in ((whole, False), (_plan(), True),  # score, on the reward group, starts on gen's parts
                            (compile(local, ["groups.actor.dp=2"], pipeline_ref=ref), True)):  # a rank may be free
        fleet.plan, fleet._parts_readers = plan, {}
        assert fleet._parts_read_elsewhere("gen") is elsewhere
    once = run_plan(whole, RunOptions(out_dir=tmp_path / "whole", steps=2, timeout_s=120), plane=tq_plane)
    calls = []
    real = Fleet.submit
    monkeypatch.setattr(Fleet, "_parts_read_elsewhere", lambda self, op: True)
    monkeypatch.setattr(Fleet, "submit", lambda self, call, *a, **k: calls.append(call.chunk.op) or real(self, call, *a,
                                                                                                          **k))
    streamed = run_plan(whole, RunOptions(out_dir=tmp_path / "streamed", steps=2, timeout_s=120), plane=tq_plane)
    assert calls.count("gen") == 2 and _stable(once) == _stable(streamed)
    assert all(r["length/mean"] >= 1 for r in once)  # each row's mask sum came with the call's one result
    parts = [e for e in json.loads((tmp_path / "whole" / "trace.json").read_text())["traceEvents"] if e["ph"] == "i"]
    assert len([p for p in parts if p["name"] == "gen part"]) == 2 * 6  # the worker still times each part
