"""The fuse pass: which ops of a worker group run inside another op's calls, and which stay apart."""

from __future__ import annotations

import pytest
import torch

from rlgraph import Batching, Cluster, DataSource, Pipeline, T, WorkerGroup, compile, op
from rlgraph.graph.dsl import op_spec
from rlgraph.graph.loader import load_pipeline
from rlgraph.runtime.worker import local_columns


def _fused(plan):
    return {o.name: o.fused_into for o in plan.ops if o.fused_into}


def test_the_actor_s_forward_passes_run_inside_generation_s_calls(ppo, grpo):
    plan = compile(ppo)
    assert _fused(plan) == {"old_logprob": "generate", "ref": "generate"}
    assert plan.followers("generate") == ["old_logprob", "ref"] and plan.followers("ref") == []
    # the critic's values (another group) and the update (a barrier that writes state) stay apart
    assert plan.op("values").fused_into is None and plan.op("update_actor").fused_into is None
    assert not plan.batches_calls("ref")  # never dispatched, so never batched
    assert _fused(compile(grpo, ["actor.mini_batch_size=8"])) == {"ref": "generate"}  # old_logprob is left out
    assert _fused(compile(grpo, ["actor.mini_batch_size=8", "trainer.reuse_forward=false"])) == {
        "old_logprob": "generate", "ref": "generate"}
    assert _fused(compile(ppo, ["trainer.fuse_ops=false"])) == {}


def test_a_rollout_group_of_its_own_fuses_nothing_into_generation():
    # asynchronous training: generate runs on 'rollout', ref and old_logprob on 'actor'
    pipeline, _ = load_pipeline("examples/grpo_async.py")
    plan = compile(pipeline)
    assert plan.op("generate").group != plan.op("ref").group and _fused(plan) == {}


def test_dynamic_sampling_s_rounds_are_not_fused():
    dapo, _ = load_pipeline("examples/dapo.py")
    plan = compile(dapo)
    assert plan.refill is not None and "generate" in plan.refill.round_ops
    assert _fused(plan) == {}


# -- small pipelines: one rule each -----------------------------------------------------------------

L = "len"


@op(outputs={"a_out": T.float32(L)}, group="g")
def a(x: T.float32(L), *, micro_batch_size: int = 2):
    return {"a_out": x}


@op(outputs={"b_out": T.float32(L)}, group="g")
def b(a_out: T.float32(L), *, micro_batch_size: int = 3):
    return {"b_out": a_out}


@op(outputs={"c_out": T.float32(L)}, group="h")
def c(a_out: T.float32(L)):
    return {"c_out": a_out}


@op(outputs={"b_out": T.float32(L)}, group="g", granularity="group")
def b_per_group(a_out: T.float32(L)):
    return {"b_out": a_out}


@op(outputs={"b_out": T.float32(L)}, group="g")
def b_reads_c(a_out: T.float32(L), c_out: T.float32(L)):
    return {"b_out": a_out + c_out}


@op(outputs={"b_out": T.float32(L)}, group="g")
def b_reads_state(a_out: T.float32(L), w: T.float32().state()):
    return {"b_out": a_out}


@op(outputs={"w": T.float32().state(), "m": T.json().metric()}, group="g", granularity="batch")
def upd(b_out: T.float32(L), w: T.float32().state()):
    return {"w": torch.tensor(0.0), "m": {}}


@op(outputs={"d_out": T.float32(L)}, group="g")
def d(b_out: T.float32(L), x: T.float32(L)):
    return {"d_out": b_out + x}


class _Rows:
    def __init__(self, config, seed):
        pass

    def next_batch(self, batch_size):
        return {"x": [torch.ones(2)] * batch_size}


def _plan(*ops_):
    groups = [WorkerGroup("g", num_cpus=0.5), WorkerGroup("h", num_cpus=0.5)]
    used = {op_spec(o).group for o in ops_}
    pipeline = Pipeline(name="fuse_rules", source=DataSource(columns={"x": T.float32(L)}, impl=_Rows),
                        ops=list(ops_), groups=[g for g in groups if g.name in used], cluster=Cluster(cpus_per_node=8),
                        config={"data": {"batch_size": 4}},
                        outputs=[c for o in ops_ for c, t in op_spec(o).outputs.items() if t.kind == "data"])
    return compile(pipeline)


def test_a_chain_of_one_group_fuses_and_chunks_follow_the_leader():
    plan = _plan(a, b, d)
    assert _fused(plan) == {"b": "a", "d": "a"}  # d reads b (in the chain) and the source: it joins too
    assert plan.followers("a") == ["b", "d"]


def test_a_leader_of_many_calls_that_feeds_another_pool_keeps_its_calls_back_to_back():
    # a's chunks (2 rows each) feed c on pool h: b between them would hold c back
    assert _fused(_plan(a, b, c)) == {}


@pytest.mark.parametrize("follower", [b_reads_c, b_per_group, b_reads_state])
def test_a_follower_that_needs_more_than_the_leader_s_rows_stays_apart(follower):
    ops_ = [a, c, follower] if follower is b_reads_c else [a, follower]
    extra = [upd] if follower is b_reads_state else []
    plan = _plan(*ops_, *extra)
    # another group's column; whole groups after a leader of row chunks; state the leader does not read
    assert plan.op(op_spec(follower).name).fused_into is None


def test_a_column_read_only_inside_a_chain_never_leaves_the_worker():
    plan = _plan(a, b, upd)  # a -> b fused; upd (a barrier writing state) reads b's output
    kept, private = local_columns(plan, "g")
    assert "a_out" in private  # read by b alone, inside a's calls
    assert "b_out" in kept


@op(outputs={"a_out": T.float32(L)}, group="g", granularity="group",
    batching=Batching(per_rank=True))
def a_per_rank(x: T.float32(L)):
    return {"a_out": x}


@op(outputs={"b_out": T.float32(L)}, group="g", granularity="group",
    batching=Batching(per_rank=True))
def b_per_rank(a_out: T.float32(L)):
    return {"b_out": a_out}


def test_a_per_rank_follower_stays_apart():
    # inside a leader's call it would be cut into dp pieces per leader chunk: one call per rank no more
    plan = _plan(a_per_rank, b_per_rank)
    assert plan.op("a_per_rank").batching.per_rank and _fused(plan) == {}


def test_a_follower_reading_a_source_column_is_fused_at_run_time_too():
    """d reads b's output and the source's x: compiled as fused, and dispatched in a's calls (a
    column read only inside the chain is private, so running d apart would find it nowhere)."""
    from rlgraph.runtime.scheduler import StepScheduler

    plan = _plan(a, b, d)
    sched = StepScheduler(plan, [0, 1, 2, 3], [False] * 4, 0)
    calls = []
    while not sched.finished:
        wave = sched.next_calls()
        assert wave, sched.unfinished()
        calls += wave
        for c in wave:
            sched.call_done(c)
    assert {c.chunk.op for c in calls} == {"a"}
    assert all([name for name, _ in c.fused] == ["b", "d"] for c in calls)
