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
    # old_logprob is left out; the advantage (per group) rides in the reward's calls of 64 rows = 8 groups
    assert _fused(compile(grpo, ["actor.mini_batch_size=8"])) == {"ref": "generate", "advantage": "reward"}
    assert _fused(compile(grpo, ["actor.mini_batch_size=8", "trainer.reuse_forward=false"])) == {
        "old_logprob": "generate", "ref": "generate", "advantage": "reward"}
    # a reward that may drop groups (on_error=drop_group) leads nothing: what it drops must reach the advantage
    assert "advantage" not in _fused(compile(grpo, ["reward.on_error=drop_group"]))
    # micro-batches of 12 rows cut the groups of 8: the advantage runs in calls of its own
    assert "advantage" not in _fused(compile(grpo, ["reward.micro_batch_size=12"]))
    assert _fused(compile(ppo, ["trainer.fuse_ops=false"])) == {}


def test_a_rollout_group_of_its_own_fuses_only_what_runs_on_it():
    # asynchronous training: generate, reward, ref and the advantage run on 'rollout', the update on 'actor'
    pipeline, _ = load_pipeline("examples/grpo_async.py")
    plan = compile(pipeline)
    assert plan.op("generate").group == plan.op("ref").group == "rollout"
    assert _fused(plan) == {"reward": "generate", "ref": "generate", "advantage": "generate"}
    # the reference on the actor's group: it runs in calls of its own there
    from rlgraph.ops import stages

    plan = compile(pipeline.with_ops(stages.ref(group="actor")))
    assert plan.op("generate").group != plan.op("ref").group
    assert _fused(plan) == {"reward": "generate", "advantage": "generate"}


def test_examples_grpo_runs_its_whole_step_in_generation_s_calls():
    # every op on the policy's group, one rank: the reward, the reference and the advantage ride in
    # generation's calls, and the update (a barrier that writes the weights) closes the chain, since
    # generation makes one call per step there
    pipeline, _ = load_pipeline("examples/grpo.py")
    plan = compile(pipeline)
    assert {g.name for g in plan.groups} == {"actor"}
    assert _fused(plan) == {"reward": "generate", "ref": "generate", "advantage": "generate",
                            "update_actor": "generate"}
    assert plan.followers("generate") == ["reward", "ref", "advantage", "update_actor"]
    # two actor ranks: generation makes a call per rank, the update (every row) is dispatched on its own
    assert "update_actor" not in _fused(compile(pipeline, ["groups.actor.dp=2"]))


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


def _pipeline(*ops_):
    groups = [WorkerGroup("g", num_cpus=0.5), WorkerGroup("h", num_cpus=0.5)]
    used = {op_spec(o).group for o in ops_}
    return Pipeline(name="fuse_rules", source=DataSource(columns={"x": T.float32(L)}, impl=_Rows),
                    ops=list(ops_), groups=[g for g in groups if g.name in used], cluster=Cluster(cpus_per_node=8),
                    config={"data": {"batch_size": 4}},
                    outputs=[c for o in ops_ for c, t in op_spec(o).outputs.items() if t.kind == "data"])


def _plan(*ops_):
    return compile(_pipeline(*ops_))


def test_a_chain_of_one_group_fuses_and_chunks_follow_the_leader():
    plan = _plan(a, b, d)
    assert _fused(plan) == {"b": "a", "d": "a"}  # d reads b (in the chain) and the source: it joins too
    assert plan.followers("a") == ["b", "d"]


def test_a_leader_of_many_calls_that_feeds_another_pool_keeps_its_calls_back_to_back():
    # a's chunks (2 rows each) feed c on pool h: b between them would hold c back
    assert _fused(_plan(a, b, c)) == {}


@pytest.mark.parametrize("follower", [b_reads_c, b_reads_state])
def test_a_follower_that_needs_more_than_the_leader_s_rows_stays_apart(follower):
    ops_ = [a, c, follower] if follower is b_reads_c else [a, follower]
    extra = [upd] if follower is b_reads_state else []
    plan = _plan(*ops_, *extra)
    # another group's column; state the leader does not read
    assert plan.op(op_spec(follower).name).fused_into is None


@op(outputs={"a_out": T.float32(L)}, group="g", group_size_param="n")
def a_sampled(x: T.float32(L), *, micro_batch_size: int = 4, n: int = 2):
    return {"a_out": x}


@pytest.mark.parametrize(("micro_batch", "n", "fused"), [(4, 2, True), (4, 4, True), (2, 4, False), (6, 4, False)])
def test_a_per_group_follower_rides_in_a_per_sample_leader_only_on_whole_groups(micro_batch, n, fused):
    # the reward (per sample) can carry the advantage (per group) when each micro-batch is whole groups
    plan = compile(_pipeline(a_sampled, b_per_group), [f"a_sampled.micro_batch_size={micro_batch}", f"a_sampled.n={n}"])
    assert (plan.op("b_per_group").fused_into == "a_sampled") is fused
    if fused:  # and every follower chunk is one group inside one leader chunk
        from rlgraph.runtime.scheduler import make_chunks

        uids = [r // n for r in range(plan.batch.padded_batch)]
        lead = make_chunks(plan.op("a_sampled"), uids)
        inner = make_chunks(plan.op("b_per_group"), uids, within=lead)
        assert all(len({uids[r] for r in c.rows}) == 1 and len(c.rows) == n for c in inner)


@op(outputs={"e_out": T.float32(L)}, group="h")
def e(x: T.float32(L)):
    return {"e_out": x}


@op(outputs={"a_out": T.float32(L)}, group="g")
def a_reads_e(x: T.float32(L), e_out: T.float32(L), *, micro_batch_size: int = 2):
    return {"a_out": x + e_out}


@op(outputs={"b_out": T.float32(L)}, group="g")
def b_reads_e(a_out: T.float32(L), e_out: T.float32(L)):
    return {"b_out": a_out + e_out}


def test_a_follower_may_read_what_its_leader_read_from_another_group():
    # e_out comes from group h, but a_reads_e read it: it is ready when a's call starts
    plan = _plan(e, a_reads_e, b_reads_e)
    assert _fused(plan) == {"b_reads_e": "a_reads_e"}
    from rlgraph.runtime.scheduler import _fused_this_step

    assert _fused_this_step(plan, {o.name: False for o in plan.ops}, ()) == {"b_reads_e": "a_reads_e"}


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


@op(outputs={"w": T.float32().state(), "m": T.json().metric()}, group="g", granularity="batch")
def upd_a(a_out: T.float32(L)):
    return {"w": torch.tensor(0.0), "m": {}}


@op(outputs={"w": T.float32().state(), "m": T.json().metric()}, group="g", granularity="batch")
def upd_b(b_out: T.float32(L)):
    return {"w": torch.tensor(0.0), "m": {}}


@op(outputs={"a_out": T.float32(L)}, group="g", granularity="group", batching=Batching(per_rank=True))
def a_per_rank_reads_w(x: T.float32(L), w: T.float32().state()):
    return {"a_out": x}


@op(outputs={"b_out": T.float32(L)}, group="g")
def b_after_upd(a_out: T.float32(L), w: T.float32().state()):
    return {"b_out": a_out}


def test_an_update_closes_a_chain_whose_leader_makes_one_call_per_step():
    # a per-rank leader on a group of one rank: one call per step, so the update (a barrier that writes
    # state, on every row) runs in it, after the forward passes
    plan = _plan(a_per_rank, b, upd_b)
    assert _fused(plan) == {"b": "a_per_rank", "upd_b": "a_per_rank"}
    from rlgraph.runtime.scheduler import StepScheduler

    sched = StepScheduler(plan, [0, 1, 2, 3], [False] * 4, 0, schedule="sync")
    (call,) = sched.next_calls()  # the step is one call; the update's one chunk holds every row
    assert [(name, [ch.rows for ch in chunks]) for name, chunks in call.fused] == [
        ("b", [(0, 1, 2), (3,)]), ("upd_b", [(0, 1, 2, 3)])]
    assert sched.call_done(call) and sched.finished
    # a leader of several calls per step (micro-batches of 2 rows), or on two ranks: the update waits for
    # all of them and is dispatched on its own
    assert _fused(_plan(a, b, upd_b)) == {"b": "a"}
    assert _fused(compile(_pipeline(a_per_rank, b, upd_b), ["groups.g.dp=2"])) == {"b": "a_per_rank"}
    assert _fused(compile(_pipeline(a_per_rank, b, upd_b), ["trainer.fuse_ops=false"])) == {}


def test_a_follower_never_reads_state_its_own_chain_wrote_before_it():
    # the leader and b_after_upd read w; upd_a, before b_after_upd in the chain, writes it: inside the call
    # b_after_upd would see this step's new value, where on its own it sees the one before
    plan = _plan(a_per_rank_reads_w, upd_a, b_after_upd)
    assert _fused(plan) == {"upd_a": "a_per_rank_reads_w"}
    assert plan.op("b_after_upd").fused_into is None
