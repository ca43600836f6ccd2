"""The runner on real Ray and TransferQueue, with plans whose ops are plain tensor functions.

Ray and the TransferQueue plane start once per session (conftest); each test starts its own
worker actors, which is what a run does.
"""

import json
from pathlib import Path

import pytest

from rlgraph import compile
from rlgraph.graph.loader import load_pipeline
from rlgraph.runtime.cluster import ClusterError, missing_resources
from rlgraph.runtime.invoke import OpError
from rlgraph.runtime.runner import Runner, RunOptions, run_plan

pytestmark = pytest.mark.ray

PIPELINE = str(Path(__file__).parents[1] / "resources" / "tensor_pipeline.py")
# 5 prompts x n=3 = 15 samples; actor dp=2 -> multiple lcm(2, 1, 1, 1) = 2 -> 16 rows, 1 padding row
PADDED = ["gen.n=3", "groups.actor.dp=2"]
VOLATILE = ("timing/", "throughput/", "driver/result_bytes", "schedule", "load/")  # load: which rank ran a chunk


def _plan(*overrides):
    pipeline, ref = load_pipeline(PIPELINE)
    return compile(pipeline, list(overrides), pipeline_ref=ref)


def _stable(records):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def _run(plan, out, plane, **kw):
    return run_plan(plan, RunOptions(out_dir=out, timeout_s=60, **kw), plane=plane)


def test_stream_and_sync_give_identical_results(tq_plane, tmp_path):
    plan = _plan(*PADDED)
    assert plan.batch.padded_batch == 16 and plan.batch.pad_rows == 1
    stream = _run(plan, tmp_path / "stream", tq_plane, steps=3, schedule="stream")
    sync = _run(plan, tmp_path / "sync", tq_plane, steps=3, schedule="sync")
    assert [r["schedule"] for r in stream] == ["stream"] * 3 and sync[0]["schedule"] == "sync"
    assert _stable(stream) == _stable(sync)
    # the update's state moved between steps: w grows every step, identically
    ws = [r["update/update_metrics/w"] for r in stream]
    assert ws == sorted(ws) and len(set(ws)) == 3


def test_both_data_planes_give_identical_results(tq_plane, ray_plane, tmp_path):
    plan = _plan(*PADDED)
    a = _run(plan, tmp_path / "tq", tq_plane, steps=2)
    b = _run(plan, tmp_path / "ray", ray_plane, steps=2)
    # the locality metrics are TransferQueue's alone (it knows each row's storage unit and node)
    assert all(r["dataplane/local_bytes"] > 0 for r in a) and not any("dataplane/local_bytes" in r for r in b)
    here = lambda rs: [{k: v for k, v in r.items() if not k.startswith("dataplane/")} for r in _stable(rs)]  # noqa: E731
    assert here(a) == here(b)


def test_padding_rows_never_reach_accuracy_metrics(tq_plane, tmp_path):
    plan = _plan(*PADDED)
    (rec,) = _run(plan, tmp_path, tq_plane, steps=1)
    # the padding row scores 1000 (see tensor_pipeline.score); real rows score below 1
    assert rec["samples/padding"] == 1 and rec["samples/real"] == 15
    assert rec["score/max"] < 1.0
    # throughput counts every row, padding included
    assert rec["throughput/samples_per_s"] == pytest.approx(16 / rec["timing/step_s"])


def test_driver_moves_metadata_only(tq_plane, tmp_path):
    plan = _plan(*PADDED, "data.batch_size=40")
    recs = _run(plan, tmp_path, tq_plane, steps=2)
    for r in recs:
        assert r["driver/payload_bytes"] == 0  # no column payload through the driver process
        # the small results the driver does receive: spans (each with its data-plane time, io_s, about 17
        # bytes a call), metrics, per-row floats
        assert r["driver/result_bytes"] < 42_000


def test_outputs_trace_and_timeline(tq_plane, tmp_path):
    plan = _plan(*PADDED)
    _run(plan, tmp_path, tq_plane, steps=2)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(ln)["step"] for ln in lines] == [0, 1]
    trace = json.loads((tmp_path / "trace.json").read_text())
    calls = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["name"] for e in calls} == {"gen", "score", "values", "adv", "update"}
    # actor dp=2: generation chunks ran on both ranks of the actor group
    actor_pid = next(e["pid"] for e in trace["traceEvents"] if e.get("args", {}).get("name") == "group actor")
    assert {e["tid"] for e in calls if e["pid"] == actor_pid and e["name"] == "gen"} == {0, 1}
    svg = (tmp_path / "timeline.svg").read_text()
    assert "<svg" in svg and "actor[1]" in svg and "gen" in svg
    assert (tmp_path / "timeline.png").stat().st_size > 0
    assert (tmp_path / "reward_curve.svg").is_file() and (tmp_path / "reward_curve.png").stat().st_size > 0


def test_the_trace_keeps_the_latest_steps_and_the_driver_no_records(tq_plane, tmp_path):
    """A long run's driver stays flat: trace.json has the op calls of the last `trace_steps` steps
    only, and with keep_records off run() keeps no record (metrics.jsonl has them all)."""
    plan = _plan(*PADDED)
    with Runner(plan, RunOptions(out_dir=tmp_path, timeout_s=60, steps=3, trace_steps=1, keep_records=False),
                tq_plane) as runner:
        assert runner.run() == []
        assert runner.written == 3
    assert [json.loads(ln)["step"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    calls = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["step"] for e in calls} == {2}


def test_groups_on_one_pool_take_turns(tq_plane, tmp_path):
    # score (group reward) and values (group critic) do not depend on each other; on one pool they
    # must still never run at the same time: they time-share its bundle
    plan = _plan(*PADDED, "groups.critic.pool=reward")
    assert [p.name for p in plan.pools if "critic" in p.groups] == ["reward"]
    _run(plan, tmp_path, tq_plane, steps=2)  # ready chunks are batched: at least a call of each per step
    calls = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
             if e["ph"] == "X" and e["name"] in ("score", "values")]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in calls)
    assert len(spans) >= 4 and {e["name"] for e in calls} == {"score", "values"}
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:])), spans


def test_raising_op_fails_the_step_with_op_rank_step_and_samples(tq_plane, tmp_path):
    plan = _plan(*PADDED, "gen.fail_step=1")
    with pytest.raises(OpError, match=r"op 'gen' failed on worker actor\[\d\] at step 1 \(chunk \d+, "
                                      r"\d+ rows, sample uids \[.*\]\): ValueError: gen was told to fail"):
        _run(plan, tmp_path, tq_plane, steps=3)
    # step 0 was recorded before the failure; the run shut its actors down and the plane is usable
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1
    assert _run(_plan(*PADDED), tmp_path / "after", tq_plane, steps=1)


def test_a_run_that_ends_closes_its_worker_classes_and_a_failed_one_is_killed_as_it_is(tq_plane, tmp_path):
    # a worker class's close() (a vLLM engine's processes and shared memory) runs when the run ends; a run
    # that fails, whose calls may still be running, kills its workers without waiting for them
    import random
    import sys

    pipeline, ref = load_pipeline(PIPELINE)
    resources = sys.modules[pipeline.op("score").impl.split(":")[0]]
    pipeline = pipeline.with_ops(resources.closing_score)
    closed = resources.CLOSED_DIR
    for fail in (False, True):
        seed = random.randrange(1 << 30)
        plan = compile(pipeline, [*PADDED, f"trainer.seed={seed}", *(["gen.fail_step=0"] if fail else [])],
                       pipeline_ref=ref)
        if fail:
            with pytest.raises(OpError, match="gen was told to fail"):
                _run(plan, tmp_path / "failed", tq_plane, steps=1)
        else:
            assert len(_run(plan, tmp_path / "ended", tq_plane, steps=1)) == 1
        marks = sorted(closed.glob(f"{seed}-*")) if closed.is_dir() else []
        for m in marks:
            m.unlink()
        assert len(marks) == (0 if fail else 1)  # the reward group's one rank


def test_an_interrupt_while_the_workers_close_still_stops_them_and_is_raised(tq_plane, tmp_path, monkeypatch):
    # Ctrl-C (or SIGTERM) during the wait for the workers' close: the actors are killed all the same
    import ray

    from rlgraph.runtime.fleet import Fleet

    runner = Runner(_plan(*PADDED), RunOptions(out_dir=tmp_path, timeout_s=60), plane=tq_plane)
    runner.start()
    workers = [w for ws in runner.fleet.workers.values() for w in ws]
    assert workers and runner.fleet.started

    def interrupted(_workers):
        raise KeyboardInterrupt

    monkeypatch.setattr(Fleet, "_close_workers", staticmethod(interrupted))
    with pytest.raises(KeyboardInterrupt):
        runner.close()
    for w in workers:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(w.ping.remote(), timeout=30)
    assert runner.fleet.workers == {} and not runner.fleet.started


def test_missing_resources_fail_before_any_actor_starts(tq_plane, tmp_path):
    plan = _plan("cluster.gpus_per_node=2", "groups.critic.num_gpus=1")
    runner = Runner(plan, RunOptions(out_dir=tmp_path, timeout_s=30), plane=tq_plane)
    with pytest.raises(ClusterError, match=r"1 GPUs needed, the cluster has 0") as e:
        runner.start()
    assert "nothing was started" in str(e.value)
    assert runner.fleet.workers == {} and runner.fleet.source is None
    runner.close()


def test_old_rlgraph_ray_sessions_are_pruned_and_others_left_alone(tmp_path):
    import os

    from rlgraph.runtime.cluster import MARKER, prune_sessions

    def session(name, pid, marked=True, age=0):
        d = tmp_path / f"session_{name}"
        d.mkdir()
        (d / "logs").mkdir()
        if marked:
            (d / MARKER).write_text(str(pid))
            os.utime(d / MARKER, (1e9 + age, 1e9 + age))
        return d

    dead = 2 ** 22 + 12345  # above Linux's default pid_max: no such process
    old = [session(f"old{i}", dead, age=i) for i in range(4)]
    running = session("running", os.getpid(), age=-10)  # its driver is alive (this test)
    foreign = session("foreign", dead, marked=False)  # not started by rlgraph
    current = session("current", dead, age=100)
    removed = prune_sessions(tmp_path, kept=2, current=current)
    assert sorted(removed) == sorted(old[:2])  # the two oldest finished ones
    assert all(d.exists() for d in [*old[2:], running, foreign, current])
    assert sorted(prune_sessions(tmp_path, kept=0)) == sorted([*old[2:], current])
    assert running.exists() and foreign.exists()


def test_missing_resources_lists_per_node_fit():
    plan = _plan("cluster.num_nodes=2", "cluster.cpus_per_node=4", "groups.actor.num_cpus=1.5", "groups.actor.dp=2",
                 "dataplane.storage_units=1")  # the default is one unit per node; this checks node 0's reservation
    # needs 2 (data plane: controller and one unit) + 2 x 1.5 (actor) + 0.5 + 0.5 + 0.25 = 6.25 CPUs
    assert missing_resources(plan, [{"CPU": 4.0}, {"CPU": 4.0}]) == []
    assert "6.25 CPUs needed" in missing_resources(plan, [{"CPU": 3.0}, {"CPU": 3.0}])[0]
    # 6.3 CPUs in all, but the data plane leaves 0.2 on node 0; node 1 (4.1) takes the actor's
    # 1.5 + 1.5, critic 0.5 and reward 0.5, leaving 0.1: the 0.25 CPU 'adv' slot fits nowhere
    problems = missing_resources(plan, [{"CPU": 2.2}, {"CPU": 4.1}])
    assert problems == ["pool 'adv' slot 0 needs 0.25 CPU and 0 GPU on one node; no node has that left (free after "
                        "the data plane and the other slots: node 0 0.2 CPU / 0 GPU, node 1 0.1 CPU / 0 GPU)"]


def test_resume_continues_exactly(tq_plane, tmp_path):
    plan = _plan(*PADDED, "trainer.save_every=1")
    full = _run(plan, tmp_path / "full", tq_plane, steps=4)
    _run(plan, tmp_path / "cut", tq_plane, steps=2)
    assert (tmp_path / "cut" / "checkpoints" / "step_1" / "meta.json").is_file()
    resumed = _run(plan, tmp_path / "cut", tq_plane, steps=4, resume=True)
    assert [r["step"] for r in resumed] == [2, 3]
    assert _stable(resumed) == _stable(full[2:])
    lines = (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(ln)["step"] for ln in lines] == [0, 1, 2, 3]


def test_a_damaged_checkpoint_is_refused_and_fallback_resumes_from_the_good_one(tq_plane, tmp_path):
    """A flipped bit in the latest checkpoint: --resume names the file and the good checkpoint;
    --resume --fallback continues from that one and ends as the uninterrupted run."""
    from rlgraph.runtime.checkpoint import CheckpointDamaged

    plan = _plan(*PADDED, "trainer.save_every=1", "trainer.keep_checkpoints=2")
    full = _run(plan, tmp_path / "full", tq_plane, steps=4)
    _run(plan, tmp_path / "cut", tq_plane, steps=3)
    ckpts = tmp_path / "cut" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_1", "step_2"]  # the newest 2 kept
    damaged = next(p for p in sorted((ckpts / "step_2").iterdir()) if p.suffix == ".safetensors")
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0x04
    damaged.write_bytes(bytes(data))
    with pytest.raises(CheckpointDamaged, match=rf"{damaged.name} has sha256 .*the newest good checkpoint is "
                                                 rf"'.*step_1': resume from it with --resume --fallback"):
        _run(plan, tmp_path / "cut", tq_plane, steps=4, resume=True)
    with pytest.warns(RuntimeWarning, match="--fallback: resuming from"):
        resumed = _run(plan, tmp_path / "cut", tq_plane, steps=4, resume=True, fallback=True)
    assert [r["step"] for r in resumed] == [2, 3]
    assert _stable(resumed) == _stable(full[2:])
    assert (ckpts / "step_2.damaged").is_dir()


def test_metrics_lines_are_on_disk_before_each_checkpoint_and_at_the_end_not_at_every_step(tq_plane, tmp_path,
                                                                                             monkeypatch):
    """metrics.jsonl is fsynced before each checkpoint (a resume keeps its lines up to that
    checkpoint) and at the run's end, not on every step's path."""
    from rlgraph.runtime import metrics, runner

    events = []
    checkpoint = runner.write_checkpoint
    monkeypatch.setattr(metrics, "fsync", lambda path: events.append(
        ("fsync", Path(path).name, [json.loads(line)["step"] for line in Path(path).read_text().splitlines()])))
    monkeypatch.setattr(runner, "write_checkpoint", lambda out, step, *a, **k: (
        events.append(("checkpoint", step)), checkpoint(out, step, *a, **k))[1])
    _run(_plan(*PADDED, "trainer.save_every=2"), tmp_path, tq_plane, steps=3)
    assert events == [("fsync", "metrics.jsonl", [0, 1]), ("checkpoint", 1), ("fsync", "metrics.jsonl", [0, 1, 2])]


@pytest.mark.slow
def test_resume_with_another_config_is_refused(tq_plane, tmp_path):
    from rlgraph.runtime.checkpoint import CheckpointError

    _run(_plan(*PADDED, "trainer.save_every=1"), tmp_path, tq_plane, steps=1)
    with pytest.raises(CheckpointError, match=r"was written with another config \(update\.lr: 0\.1 -> 0\.5\); "
                                              r"--resume continues a run only with the same config"):
        _run(_plan(*PADDED, "trainer.save_every=1", "update.lr=0.5"), tmp_path, tq_plane, steps=2, resume=True)
    # trainer.steps (and other settings that do not change results) may differ
    assert [r["step"] for r in _run(_plan(*PADDED, "trainer.save_every=2"), tmp_path, tq_plane, steps=2,
                                     resume=True)] == [1]


def test_validation_runs_on_its_own_partition(tq_plane, tmp_path):
    plan = _plan(*PADDED, "trainer.val_every=2")
    recs = _run(plan, tmp_path, tq_plane, steps=2)
    assert "val/score/mean" not in recs[0] and "val/score/mean" in recs[1]
    # validation prompts are ones of length 3 (tensor_pipeline.CountSource.next_val_batch)
    assert recs[1]["val/score/mean"] > 0


def test_generation_takes_its_inputs_from_a_read_ahead_and_the_results_stay_the_same(tq_plane, tmp_path,
                                                                                      monkeypatch):
    """One actor rank: the driver has it read the next step's prompts while it runs the update (sent with the
    update's call); gen's calls from step 1 on take their rows from that read (trace.json says so), and the
    run's results equal those of a run whose calls read for themselves."""
    from rlgraph.runtime import actor

    plan = _plan()
    assert actor.read_ahead_ops(plan) == {"gen": ("x",)}
    ahead = _run(plan, tmp_path / "ahead", tq_plane, steps=3)
    calls = [e for e in json.loads((tmp_path / "ahead" / "trace.json").read_text())["traceEvents"]
             if e["ph"] == "X" and e["name"] == "gen"]
    # gen runs one call per group of rows on its one rank: each takes its rows of the read
    assert len(calls) > 3 and all(e["args"].get("read_ahead", 0) == (e["args"]["step"] > 0) for e in calls)
    monkeypatch.setattr(actor, "read_ahead_ops", lambda plan: {})  # where the fleet reads it
    plain = _run(plan, tmp_path / "plain", tq_plane, steps=3)
    assert not any(e["args"].get("read_ahead") for e in json.loads((tmp_path / "plain" / "trace.json").read_text())
                   ["traceEvents"] if e["ph"] == "X")
    assert _stable(ahead) == _stable(plain)
