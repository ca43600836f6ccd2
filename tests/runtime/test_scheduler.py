"""The step scheduler: chunks, readiness, dispatch and repair decisions, pure bookkeeping (no Ray)."""

import pytest

from rlgraph import compile
from rlgraph.graph.loader import load_pipeline
from rlgraph.runtime.scheduler import Repair, StepScheduler, home_group, make_chunks, repair_for, row_homes


def _plan(example, *overrides):
    pipeline, _ = load_pipeline(f"tests/resources/{example}_pinned.py")
    return compile(pipeline, list(overrides))


def _rows(batch, n, pad):
    # rows of one prompt are contiguous; each padding row is its own group
    uids = [p for p in range(batch) for _ in range(n)] + [batch + i for i in range(pad)]
    return uids, [False] * (batch * n) + [True] * pad


def _sched(plan, batch, n, schedule="stream", step=0, pad=None, **kw):
    pad = plan.batch.pad_rows if pad is None else pad
    uids, padding = _rows(batch, n, pad)
    return StepScheduler(plan, uids, padding, step, schedule, **kw)


def test_chunks_cover_rows_once_per_mode():
    plan = _plan("grpo", "data.batch_size=3", "rollout.n=4", "actor.mini_batch_size=2",
                 "rollout.micro_batch_size=2", "reward.micro_batch_size=5")
    # 3 prompts x 4 = 12 samples; multiple = lcm(1, 2*4) = 8 -> padded 16: 4 padding rows
    assert plan.batch.padded_batch == 16
    uids, _ = _rows(3, 4, 4)
    gen = make_chunks(plan.op("generate"), uids)  # per rank: one call with all rows (the body batches inside)
    assert [c.rows for c in gen] == [tuple(range(16))]
    adv = make_chunks(plan.op("advantage"), uids)  # group mode, one group per chunk (no micro_batch_size)
    assert [c.rows for c in adv] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12,), (13,), (14,), (15,)]
    rew = make_chunks(plan.op("reward"), uids)  # stream mode, 5 rows per chunk
    assert [len(c.rows) for c in rew] == [5, 5, 5, 1]
    upd = make_chunks(plan.op("update_actor"), uids)  # barrier: one chunk of all rows
    assert upd[0].rows == tuple(range(16)) and len(upd) == 1
    for chunks in (gen, adv, rew, upd):
        rows = [r for c in chunks for r in c.rows]
        assert sorted(rows) == list(range(16))
    # two actor ranks: generate's 7 groups (3 prompts, 4 padding rows) split 3 + 4, whole groups each
    two = _plan("grpo", "data.batch_size=3", "rollout.n=4", "actor.mini_batch_size=2", "groups.actor.dp=2")
    assert [c.rows for c in make_chunks(two.op("generate"), uids)] == [tuple(range(12)), (12, 13, 14, 15)]


def _drain(sched):
    """Start every call the scheduler gives, finish them all, repeat; return the calls in order."""
    calls = []
    while not sched.finished:
        wave = sched.next_calls()
        assert wave, f"deadlock: {sched.unfinished()}"
        calls += wave
        for c in wave:
            sched.call_done(c)
    return calls


def _work(calls):
    """(op, chunk index, rows) of every chunk the calls run, those of the ops fused into them included."""
    return sorted((ch.op, ch.index, ch.rows) for c in calls for ch in (*c.chunks, *(x for _, f in c.fused for x in f)))


@pytest.mark.parametrize("fuse", ["true", "false"])
@pytest.mark.parametrize("schedule", ["stream", "sync"])
def test_same_calls_under_both_schedules(schedule, fuse):
    plan = _plan("ppo", "data.batch_size=4", "rollout.n=2", "rollout.micro_batch_size=1", f"trainer.fuse_ops={fuse}")
    calls = _work(_drain(_sched(plan, 4, 2, schedule)))
    other = _work(_drain(_sched(plan, 4, 2, "stream" if schedule == "sync" else "sync")))
    assert calls == other
    assert {op.name for op in plan.ops} == {c[0] for c in calls}


def test_stream_starts_reward_before_generation_ends_and_sync_does_not():
    plan = _plan("ppo", "data.batch_size=4", "rollout.n=2", "reward.micro_batch_size=2")
    stream = _sched(plan, 4, 2, "stream")
    (gen,) = [c for c in stream.next_calls() if c.chunk.op == "generate"]  # one call: all of the rank's rows
    assert gen.rows == tuple(range(plan.batch.padded_batch))
    stream.rows_done("generate", (0, 1))  # a part: the first group is generated
    wave = stream.next_calls()
    assert [c.rows for c in wave if c.chunk.op == "reward"] == [(0, 1)]
    assert not [c for c in wave if c.chunk.op == "advantage"]  # a barrier: waits for every row
    sync = _sched(plan, 4, 2, "sync")
    (g,) = sync.next_calls()
    sync.rows_done("generate", (0, 1))
    assert sync.next_calls() == []  # stage 1 waits for all of stage 0, parts or not
    assert [name for name, _ in g.fused] == ["old_logprob", "ref"]  # they run inside generation's call
    sync.call_done(g)
    # generation (and the actor's forward passes fused into it) done: the other stage-1 readers start
    assert {c.chunk.op for c in sync.next_calls()} == {"reward", "values"}
    assert sync.op_finished("old_logprob") and sync.op_finished("ref")


def test_partial_outputs_release_downstream_chunks_before_the_call_ends():
    plan = _plan("grpo", "data.batch_size=4", "rollout.n=2", "rollout.micro_batch_size=4",
                 "reward.micro_batch_size=2")
    sched = _sched(plan, 4, 2)
    (gen,) = sched.next_calls()
    assert gen.rows == tuple(range(8))  # one call for all 4 groups
    sched.rows_done("generate", (2, 3))  # the second group finished first
    wave = sched.next_calls()
    assert [(c.chunk.op, c.rows) for c in wave] == [("reward", (2, 3))]
    sched.rows_done("generate", (2, 3))  # reported twice: nothing changes
    assert sched.next_calls() == []
    assert sched.call_done(wave[0])  # the reward chunk is done
    assert sched.call_done(gen)  # the rest of generation's rows become ready with the call
    # the three reward chunks now ready go out as one call (one rank): rows in chunk order
    assert [(c.rows, [k.index for k in c.chunks]) for c in _drain(sched) if c.chunk.op == "reward"] == [
        ((0, 1, 4, 5, 6, 7), [0, 2, 3])]


def test_dispatch_prefers_the_least_loaded_idle_rank_and_shards_barriers():
    plan = _plan("ppo", "data.batch_size=4", "rollout.n=2", "groups.reward.dp=3", "cluster.cpus_per_node=16",
                 "reward.micro_batch_size=2", "groups.actor.dp=2")
    # 8 samples padded to lcm(dp 2, dp 3, 4 x 2) = 24: 4 groups + 16 padding rows = 20 groups, 10 per actor rank
    assert plan.batch.padded_batch == 24
    sched = _sched(plan, 4, 2)
    gens = sched.next_calls()
    assert [(c.chunk.index, c.rank, c.rows) for c in gens] == [(0, 0, tuple(range(14))), (1, 1, tuple(range(14, 24)))]
    assert sched.next_calls() == []  # both actor ranks busy
    sched.rows_done("generate", (4, 5))  # parts of both calls: the reward pool takes them, least loaded first
    (rew,) = sched.next_calls()
    assert (rew.chunk.op, rew.rows, rew.rank) == ("reward", (4, 5), 0)
    sched.rows_done("generate", (0, 1))
    (rew2,) = sched.next_calls()
    assert (rew2.rows, rew2.rank) == ((0, 1), 1)  # rank 0 is busy: the idle rank handed the fewest rows
    sched.call_done(rew)
    sched.rows_done("generate", (2, 3))
    (rew3,) = sched.next_calls()
    assert (rew3.rows, rew3.rank) == ((2, 3), 2)  # ranks 0 and 2 idle; rank 2 was handed no rows yet
    for c in (*gens, rew2, rew3):
        sched.call_done(c)
    # the rest: the update is a barrier over both actor ranks, one contiguous shard each
    calls = _drain(sched)
    shards = [c for c in calls if c.chunk.op == "update_actor"]
    rows = plan.batch.padded_batch
    assert [(c.rank, c.rows) for c in shards] == [(0, tuple(range(rows // 2))), (1, tuple(range(rows // 2, rows)))]
    assert sched.finished


def test_rows_are_stored_on_the_nodes_of_the_home_groups_ranks():
    plan = _plan("ppo", "data.batch_size=4", "rollout.n=2", "groups.reward.dp=3", "cluster.cpus_per_node=16",
                 "reward.micro_batch_size=2", "groups.actor.dp=2")
    # the actor group (generate, old log-probs, update: every per-token column) outweighs the others
    assert home_group(plan) == "actor"
    nodes = {("actor", 0): "A", ("actor", 1): "B", ("reward", 0): "C", ("reward", 1): "B", ("reward", 2): "A"}
    # units 0 and 2 on node A, unit 1 on B, unit 3 on C: rank 0's half on A (its first unit), rank 1's on B
    assert row_homes(plan, 24, nodes, ["A", "B", "A", "C"]) == [0] * 12 + [1] * 12
    # two ranks on one node take turns over its units; a node without a unit falls back to k % units
    same = {**nodes, ("actor", 1): "A"}
    assert row_homes(plan, 8, same, ["A", "B", "A"]) == [0] * 4 + [2] * 4
    assert row_homes(plan, 8, {**nodes, ("actor", 0): "D"}, ["A", "B"]) == [0] * 4 + [1] * 4
    assert row_homes(plan, 8, {("actor", 0): "A"}, ["A"]) is None  # a rank's node unknown
    assert row_homes(plan, 8, nodes, []) is None  # no units (the Ray store)


def test_dispatch_prefers_idle_ranks_on_the_node_of_the_chunks_rows():
    plan = _plan("ppo", "data.batch_size=4", "rollout.n=2", "groups.reward.dp=3", "cluster.cpus_per_node=16",
                 "reward.micro_batch_size=2", "groups.actor.dp=2")
    nodes = {("actor", 0): "A", ("actor", 1): "B", ("reward", 0): "C", ("reward", 1): "B", ("reward", 2): "A"}
    homes = row_homes(plan, 24, nodes, ["A", "B"])
    sched = _sched(plan, 4, 2, row_nodes=[["A", "B"][h] for h in homes], rank_nodes=nodes)
    gens = sched.next_calls()
    assert [(c.rank, c.rows[0]) for c in gens] == [(0, 0), (1, 14)]
    sched.rows_done("generate", (0, 1, 16, 17))
    # rows 0-1 live on A: reward rank 2 (on A), not rank 0 (fewest rows, but on C); rows 16-17 on B: rank 1
    calls = {c.rows: c for c in sched.next_calls()}
    assert {rows: c.rank for rows, c in calls.items()} == {(0, 1): 2, (16, 17): 1}
    sched.rows_done("generate", (2, 3))
    # no idle rank on A: the call goes out anyway (locality never idles a worker), to the least loaded
    (far,) = sched.next_calls()
    assert (far.rows, far.rank) == ((2, 3), 0)
    # the node map is read at dispatch: a rank restarted on another node counts from then on
    sched.call_done(far)
    sched.call_done(calls[(16, 17)])
    nodes[("reward", 1)] = "A"  # ranks 0 (on C) and 1 (now on A) idle, 2 rows handed to each
    sched.rows_done("generate", (4, 5))
    (moved,) = sched.next_calls()
    assert (moved.rows, moved.rank) == ((4, 5), 1)


def test_a_refilled_batch_runs_the_rounds_ops_on_its_padding_rows_only():
    plan = _plan("grpo", "data.batch_size=3", "rollout.n=4", "actor.mini_batch_size=2",
                 "rollout.micro_batch_size=2", "reward.micro_batch_size=5")
    # 8 rows copied in from the rounds (2 groups, with generate's and reward's columns), 8 padding rows
    uids, padding = [7] * 4 + [9] * 4 + list(range(100, 108)), [False] * 8 + [True] * 8
    carried = (["responses", "response_mask", "prompts", "token_level_scores", "input_ids", "attention_mask",
                "position_ids", "rollout_log_probs", "policy_version", "policy_version_end"], range(8),
               ["generate", "reward"])
    sched = StepScheduler(plan, uids, padding, 0, carried=carried)
    assert [c.rows for c in sched.ops["generate"].chunks] == [tuple(range(8, 16))]
    assert all(r >= 8 for c in sched.ops["reward"].chunks for r in c.rows)
    first = sched.next_calls()
    # the copied rows are ready at once: old_logprob (actor, after generate in plan order) and the
    # advantage of their two groups (one batched call) start beside the padding rows' generation
    assert {(c.chunk.op, c.rows) for c in first} >= {("generate", tuple(range(8, 16))), ("advantage", tuple(range(8)))}
    for c in first:
        sched.call_done(c)
    calls = _drain(sched)
    done = {(c.chunk.op, r) for c in [*first, *calls] for r in c.rows}
    assert {r for op, r in done if op in ("generate", "reward")} == set(range(8, 16))
    assert {r for op, r in done if op == "update_actor"} == set(range(16))
    # a batch without padding rows: the rounds' ops have nothing left to run, and are done
    full = StepScheduler(plan, [7] * 4 + [9] * 4, [False] * 8, 0,
                         carried=(carried[0], range(8), carried[2]))
    assert full.ops["generate"].chunks == [] and full.op_finished("generate")
    assert {c.chunk.op for c in _drain(full)} == {"old_logprob", "ref", "advantage", "update_actor"}


def test_ready_chunks_go_out_as_one_call_per_idle_rank():
    plan = _plan("grpo", "data.batch_size=8", "rollout.n=2", "rollout.micro_batch_size=8", "reward.micro_batch_size=2",
                 "groups.reward.dp=2")
    sched = _sched(plan, 8, 2)
    (gen,) = sched.next_calls()
    assert sched.call_done(gen)  # all 16 rows generated at once: 8 reward chunks are ready
    rewards = [c for c in sched.next_calls() if c.chunk.op == "reward"]
    # shared evenly over the two idle ranks, chunks in index order, each call's rows in chunk order
    assert sorted((c.rank, [k.index for k in c.chunks]) for c in rewards) == [(0, [0, 1, 2, 3]), (1, [4, 5, 6, 7])]
    assert [c.spans for c in sorted(rewards, key=lambda c: c.rank)] == [[(0, 2), (1, 2), (2, 2), (3, 2)],
                                                                         [(4, 2), (5, 2), (6, 2), (7, 2)]]
    assert rewards[0].rows == tuple(r for k in rewards[0].chunks for r in k.rows)
    for c in rewards:
        assert sched.call_done(c)
    assert sched.op_finished("reward")
    # the same step with batch_calls=False: one call per chunk
    single = StepScheduler(plan, [r // 2 for r in range(16)], [False] * 16, 0, batch_calls=False)
    (gen,) = single.next_calls()
    single.call_done(gen)
    assert sorted(len(c.chunks) for c in single.next_calls() if c.chunk.op == "reward") == [1, 1]


def test_colocated_groups_take_turns_on_their_pool():
    plan = _plan("ppo", "data.batch_size=2", "rollout.n=2", "groups.critic.pool=actor", "actor.mini_batch_size=2",
                 "critic.mini_batch_size=2")
    sched = _sched(plan, 2, 2)
    busy = []
    while not sched.finished:
        wave = sched.next_calls()
        pools = [plan.group(c.group).pool for c in wave]
        assert len(pools) == len(set(zip(pools, [c.rank for c in wave])))  # one call per bundle
        busy.append({c.group for c in wave if plan.group(c.group).pool == "actor"})
        for c in wave:
            sched.call_done(c)
    assert all(len(groups) <= 1 for groups in busy)  # actor and critic never at once


def test_warmup_and_validation_skip_ops():
    plan = _plan("ppo", "trainer.critic_warmup=2")
    sched = _sched(plan, 8, 4, pad=plan.batch.pad_rows_warmup)
    assert sched.ops["update_actor"].skipped and not sched.ops["update_critic"].skipped
    assert "update_actor" not in sched.chunk_counts()
    assert "generate" in sched.unfinished()
    calls = _drain(sched)
    assert "update_actor" not in {c.chunk.op for c in calls}
    val = _sched(plan, 8, 4, ops={"generate", "reward"}, pad=plan.batch.pad_rows_warmup)
    assert {c.chunk.op for c in _drain(val)} == {"generate", "reward"}


def test_unfinished_names_missing_columns():
    plan = _plan("ppo", "data.batch_size=4", "rollout.n=2")
    sched = _sched(plan, 4, 2)
    sched.next_calls()
    desc = sched.unfinished()
    assert desc["generate"].startswith("0/") and "1 running" in desc["generate"]
    assert "waiting for columns" in desc["advantage"] and "'token_level_scores'" in desc["advantage"]


def test_dropped_rows_are_padding_only_downstream_of_the_dropping_op():
    plan = _plan("ppo", "data.batch_size=2", "rollout.n=2", "actor.mini_batch_size=2", "critic.mini_batch_size=2",
                 "reward.on_error=drop_group")
    assert plan.op("reward").drops and not _plan("ppo").op("reward").drops  # only drop_group drops rows
    sched = _sched(plan, 2, 2)
    sched.drop(1, "reward_error", "reward", whole_group=True)  # rows 0 and 1 share a prompt
    assert sched.dropped == {0: ("reward_error", "reward"), 1: ("reward_error", "reward")}
    assert sched.tags("advantage", (0, 1, 2)) == (True, True, False)
    assert sched.tags("old_logprob", (0, 1, 2)) == (False, False, False)  # not downstream of reward
    sched.drop(2, "other", "reward", whole_group=False)
    assert 3 not in sched.dropped


def test_repair_decisions():
    plan = _plan("ppo")
    assert repair_for(plan, "reward", died=False, stateful=False) is Repair.RERUN
    assert repair_for(plan, "reward", died=True, stateful=False) is Repair.RESTART_GROUP
    assert repair_for(plan, "generate", died=False, stateful=True) is Repair.RERUN
    assert repair_for(plan, "generate", died=True, stateful=True) is Repair.RESTORE
    assert repair_for(plan, "update_actor", died=False, stateful=True) is Repair.RESTORE  # may have stepped
    # a call that carries the update (fused after generation) may have stepped too
    assert repair_for(plan, "generate", died=False, stateful=True, fused=["ref", "update_actor"]) is Repair.RESTORE
    assert repair_for(plan, "generate", died=False, stateful=True, fused=["ref"]) is Repair.RERUN


def test_a_completion_touches_only_the_chunks_it_unblocks():
    """Marking rows ready visits the readers of the finished op's columns on those rows, whatever else
    the plan holds: a reader of a column the call did not write is never looked at."""
    plan = _plan("ppo", "data.batch_size=4", "rollout.n=2")
    sched = _sched(plan, 4, 2)
    seen = []
    for st in sched.ops.values():
        orig = st.missing

        class Spy(list):
            def __setitem__(self, k, v, _name=st.plan.name):
                seen.append(_name)
                super().__setitem__(k, v)

        st.missing = Spy(orig)
    sched.next_calls()
    seen.clear()
    sched.rows_done("generate", (0, 1))  # a part of generation: two rows
    # its readers, less the ops fused into its calls (they wait for no rows: they run inside them)
    readers = {o.name for o in plan.ops if set(o.inputs) & set(plan.op("generate").outputs) and not o.fused_into}
    assert set(seen) == readers and "update_critic" in readers and "ref" not in readers
    # each reader's chunk of rows 0,1 is touched once per (input column of generate, row)
    for name in readers:
        cols = set(plan.op(name).inputs) & set(plan.op("generate").outputs)
        assert seen.count(name) == len(cols) * 2


def test_a_fused_op_runs_in_its_leader_s_calls_on_the_same_rows():
    plan = _plan("grpo", "data.batch_size=4", "rollout.n=2", "actor.mini_batch_size=4", "groups.actor.dp=2",
                 "ref.micro_batch_size=3")
    assert plan.op("ref").fused_into == "generate"
    sched = _sched(plan, 4, 2, gated={"generate", "ref", "update_actor"})
    assert sched.gated == {"generate", "update_actor"}  # ref is never dispatched: its leader's gate holds it
    sched.open("generate")
    gens = [c for c in sched.next_calls() if c.chunk.op == "generate"]
    assert len(gens) == 2  # one call per rank
    for g in gens:
        ((name, chunks),) = g.fused
        # ref's chunks: the rank's rows, in ref's own micro-batches of 3 rows
        assert name == "ref" and tuple(r for c in chunks for r in c.rows) == g.rows
        assert [len(c.rows) for c in chunks] == [3] * (len(g.rows) // 3) + ([len(g.rows) % 3] if len(g.rows) % 3 else [])
    assert sorted(c.index for g in gens for _, chunks in g.fused for c in chunks) == list(range(len(sched.ops["ref"].chunks)))
    assert "inside generate's calls" in sched.unfinished()["ref"]
    sched.call_done(gens[0])
    assert not sched.op_finished("ref") and sched.ops["ref"].done == len(gens[0].fused[0][1])
    sched.call_done(gens[1])
    assert sched.op_finished("ref") and sched.op_finished("generate")
    sched.open("update_actor")
    assert not [c for c in _drain(sched) if c.chunk.op == "ref"]  # nothing of ref went out on its own


def test_a_step_that_skips_a_fused_op_sends_its_leader_alone():
    plan = _plan("grpo", "data.batch_size=4", "rollout.n=2", "actor.mini_batch_size=4")
    val = _sched(plan, 4, 2, ops={"generate", "reward"})  # validation: ref is not needed
    calls = _drain(val)
    assert calls[0].chunk.op == "generate" and calls[0].fused == ()
    assert {c.chunk.op for c in calls} == {"generate", "reward"}
    # a refilled batch: generate runs on the padding rows only, so ref (on every row) runs on its own
    carried = (["responses", "response_mask", "prompts", "token_level_scores", "input_ids", "attention_mask",
                "position_ids", "rollout_log_probs", "policy_version", "policy_version_end"], range(4), ["generate",
                                                                                                   "reward"])
    refill = StepScheduler(plan, [1, 1, 2, 2, 7, 7, 8, 8], [False] * 4 + [True] * 4, 0, carried=carried)
    assert "ref" in {c.chunk.op for c in _drain(refill)}


def test_a_group_of_one_rank_runs_every_row_of_its_ops_so_its_rows_are_known_ahead():
    plan = _plan("grpo", "data.batch_size=3", "rollout.n=4", "actor.mini_batch_size=2", "reward.micro_batch_size=5")
    sched = _sched(plan, 3, 4)
    assert sched.single_rank_rows("generate") == tuple(range(16))
    assert sched.single_rank_rows("ref") is None  # fused into generate's calls: never dispatched itself
    calls = [c for c in sched.next_calls() if c.chunk.op == "generate"]
    assert [c.rows for c in calls] == [sched.single_rank_rows("generate")]
    # two ranks: which rank runs a chunk is decided at dispatch, so no rows are known ahead
    two = _sched(_plan("grpo", "data.batch_size=3", "rollout.n=4", "actor.mini_batch_size=2", "groups.actor.dp=2"),
                 3, 4)
    assert two.single_rank_rows("generate") is None
