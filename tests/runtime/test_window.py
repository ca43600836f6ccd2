"""The cross-step order of `rlgraph.runtime.window`, without Ray: which op of which step may start,
and which version of the weights each read sees, for k = 0, 1, 2 steps of staleness.

The driver below plays the runtime: calls stay running across passes and finish one at a time,
in the order of dispatch or in a seeded random order; it records the version each state read
sees when its call is handed out, and checks the rule of the docs: at step t, an op with lag L
reads what its producer wrote at step t-1-L, never anything newer or older, whatever the order.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from rlgraph import compile
from rlgraph.graph.loader import load_pipeline
from rlgraph.runtime.scheduler import Slots, StepScheduler
from rlgraph.runtime.window import Window, reads_step

ROOT = Path(__file__).parents[2]
STATEFUL = {"actor": True, "rollout": True, "reward": False, "advantage": False}


def _plan(*overrides):
    pipeline, ref = load_pipeline(str(ROOT / "examples" / "grpo_async.py"))
    # reuse_forward=false keeps old_logprob: an op of the actor's group that reads the weights the update writes
    return compile(pipeline, ["data.batch_size=4", "rollout.n=2", "actor.mini_batch_size=4",
                              "trainer.reuse_forward=false", *overrides], pipeline_ref=ref)


def _drive(plan, steps, seed=None):
    """Run `steps` steps with up to k+1 in flight; returns ([(step, op, version read)], most in flight).
    `seed`: finish running calls in a random order (None: first handed out, first done)."""
    k = int(plan.config["trainer"]["max_staleness"])
    window, slots = Window(plan, STATEFUL), Slots(plan)
    uids = [u for u in range(4) for _ in range(2)]
    rng = random.Random(seed)
    reads, running, next_step, most = [], [], 0, 0
    while next_step < steps or window.live:
        while next_step < steps and len(window.live) < k + 1:
            window.admit(next_step, StepScheduler(plan, uids, [False] * 8, next_step, slots=slots,
                                                  gated=window.gated_ops()))
            next_step += 1
        most = max(most, len(window.live))
        synced = True
        while synced:  # weight syncs are instant here: apply them, then open what they unblock
            synced = False
            for gate in window.gates():
                if gate.sync:
                    window.holds(*gate.sync)
                    synced = True
                else:
                    window.live[gate.key].open(gate.op)
        for key in sorted(window.live):
            for call in window.live[key].next_calls():
                op = plan.op(call.chunk.op)
                if op.state_inputs:
                    reads.append((key.step, op.name, window.held[("policy_weights", "rollout")] if op.group == "rollout"
                                  else "own"))
                running.append((key, call))
        if list(window.pop_done()):
            continue
        assert running, f"stalled: { {s: window.live[s].unfinished() for s in window.live} }"
        key, call = running.pop(rng.randrange(len(running)) if seed is not None else 0)
        sched = window.live[key]
        if sched.call_done(call) and sched.op_finished(call.chunk.op):
            window.produced(call.chunk.op, key.step)
    return reads, most


@pytest.mark.parametrize("k", [0, 1, 2])
def test_each_read_sees_the_version_of_step_t_minus_1_minus_lag(k):
    plan = _plan(f"trainer.max_staleness={k}")
    assert plan.op("generate").lag == k and plan.op("old_logprob").lag == 0
    reads, most = _drive(plan, 6)
    gen = [(s, v) for s, op, v in reads if op == "generate"]
    # at step t the rollout holds update_actor's weights of step t-1-k (None: the initial ones)
    assert gen == [(t, reads_step(t, k) if reads_step(t, k) >= 0 else None) for t in range(6)]
    assert most == k + 1  # the window really filled


@pytest.mark.parametrize("k", [1, 2])
def test_the_order_of_completions_does_not_change_the_versions(k):
    plan = _plan(f"trainer.max_staleness={k}")
    first, _ = _drive(plan, 6)
    for seed in range(4):
        shuffled, _ = _drive(plan, 6, seed=seed)
        assert sorted(shuffled, key=repr) == sorted(first, key=repr), seed


def test_a_stateful_group_runs_its_steps_in_order():
    plan = _plan("trainer.max_staleness=2")
    window, slots = Window(plan, STATEFUL), Slots(plan)
    uids = [u for u in range(4) for _ in range(2)]
    for t in range(3):
        window.admit(t, StepScheduler(plan, uids, [False] * 8, t, slots=slots, gated=window.gated_ops()))
    opened = {(g.key.step, g.op) for g in window.gates() if g.sync is None}
    # step 0 may start everything; the rollout of steps 1 and 2 waits for generate of the step before,
    # old_logprob of step 1 for update_actor of step 0
    assert (0, "generate") in opened and (0, "old_logprob") in opened
    assert (1, "generate") not in opened and (1, "old_logprob") not in opened and (2, "generate") not in opened


def test_after_a_restore_the_rollout_is_given_its_version_or_sent_back_to_the_initial_weights():
    plan = _plan("trainer.max_staleness=1")
    uids = [u for u in range(4) for _ in range(2)]
    window = Window(plan, STATEFUL)
    window.first = 1  # restored from the checkpoint of step 0; nothing was written before step 1 reads
    window.reset_held(initial=False)
    window.admit(1, StepScheduler(plan, uids, [False] * 8, 1, gated=window.gated_ops()))
    (gate,) = [g for g in window.gates() if g.op == "generate"]
    assert gate.sync == ("policy_weights", "rollout", None)  # step 1 reads step -1: the initial weights
    window.holds_initial("rollout")
    assert [g.sync for g in window.gates() if g.op == "generate"] == [None]
    # restored at step 3 with update_actor's weights of steps 1 and 2 kept: step 4 reads step 2's
    window = Window(plan, STATEFUL)
    window.first = 4
    window.reset_held(initial=False)
    window.kept["policy_weights"] = [1, 2]
    window.admit(4, StepScheduler(plan, uids, [False] * 8, 4, gated=window.gated_ops()))
    assert [g.sync for g in window.gates() if g.op == "generate"] == [("policy_weights", "rollout", 2)]


def test_partial_rollout_reads_the_newest_version_written_before_its_step_and_is_pushed_it():
    plan = _plan("trainer.max_staleness=2", "rollout.partial=true")
    uids = [u for u in range(4) for _ in range(2)]
    window = Window(plan, STATEFUL)
    assert window.partial == {"generate"} and window.pushed == {("policy_weights", "rollout")}
    assert window.pushes(busy=set()) == []  # nothing written yet: the rollout holds the initial weights
    window.first = 5
    window.kept["policy_weights"] = [1, 2, 3]  # update_actor finished steps 1..3, step 4 still running
    window.holds("policy_weights", "rollout", 1)
    window.admit(5, StepScheduler(plan, uids, [False] * 8, 5, gated=window.gated_ops()))
    # without partial, step 5 reads step 2's weights (5 - 1 - 2); with it, the newest before step 5
    assert [g.sync for g in window.gates() if g.op == "generate"] == [("policy_weights", "rollout", 3)]
    assert window.pushes(busy=set()) == [("policy_weights", "rollout", 3)]
    assert window.pushes(busy={("policy_weights", "rollout")}) == []  # one sync at a time, asked again later
    window.holds("policy_weights", "rollout", 3)
    assert window.pushes(busy=set()) == [] and [g.sync for g in window.gates() if g.op == "generate"] == [None]
    # a plan without it: the fixed version, and no pushes
    plain = Window(_plan("trainer.max_staleness=2"), STATEFUL)
    assert plain.partial == set() and plain.pushed == set()


def test_kept_versions_are_pruned_once_no_step_can_read_them():
    plan = _plan("trainer.max_staleness=1")
    window = Window(plan, STATEFUL)
    assert window.crossing == {"policy_weights"}  # read by the rollout group, written by the actor's
    for s in range(4):
        window.produced("update_actor", s)
    # steps from 4 on read update_actor's weights of step >= 2 (4 - 1 - 1)
    assert window.prunable(4) == [("policy_weights", 0), ("policy_weights", 1)]
    assert window.kept["policy_weights"] == [2, 3]


def test_state_ops_include_ops_that_only_read_state():
    # a group that only reads a state column (the rollout) holds it between calls: restarting it would
    # lose the weights it was given, so it counts as keeping state (Fleet.stateful, Window.stateful)
    plan = _plan("trainer.max_staleness=1")
    assert plan.state_ops() == {"generate", "old_logprob", "update_actor"}


def test_the_next_step_s_call_is_queued_behind_the_call_that_ends_the_step_before():
    """examples/grpo.py: every op on the actor's one rank, the update fused into generation's call, so a
    step is one call. Once step 1 is admitted, its call may go to the actor behind step 0's (the worker
    runs them in order and checks that step 0's ended well first): the hand-off through the driver
    between two steps is gone. Not while step 0 still has calls of the group to send."""
    from rlgraph.runtime.scheduler import call_token
    from rlgraph.runtime.step import StepKey

    pipeline, ref = load_pipeline(str(ROOT / "examples" / "grpo.py"))
    uids = [u for u in range(4) for _ in range(2)]

    def start(plan):
        window, slots = Window(plan, {"actor": True}), Slots(plan)
        s0 = StepScheduler(plan, uids, [False] * 8, 0, schedule="sync", slots=slots, gated=window.gated_ops())
        window.admit(0, s0)
        for gate in window.gates():
            assert gate.after is None  # nothing before step 0
            s0.open(gate.op)
        (c0,) = s0.next_calls()
        s1 = StepScheduler(plan, uids, [False] * 8, 1, schedule="sync", slots=slots, gated=window.gated_ops())
        window.admit(1, s1)
        return window, slots, s0, s1, c0

    plan = compile(pipeline, ["data.batch_size=4", "rollout.n=2", "actor.mini_batch_size=4"], pipeline_ref=ref)
    window, slots, s0, s1, c0 = start(plan)
    (gate,) = window.gates()
    assert (gate.key, gate.op, gate.after) == (StepKey(1), "generate", (StepKey(0), c0))
    s1.open(gate.op, (c0, call_token("p0", c0.chunk.op, c0.chunk.index)))
    (c1,) = s1.next_calls()
    assert c1.after == "p0/generate/0" and slots.queued == {("actor", 0): c1}
    assert s1.next_calls() == [] and window.gates() == []  # one call queued per rank, and no more
    s0.call_done(c0)
    assert list(window.pop_done()) == [StepKey(0)] and slots.busy == {("actor", 0)} and not slots.queued
    assert slots.running[("actor", 0)] is c1 and s1.lone_call("actor") is c1
    again = s1.rerun(c1)  # step 1's call failed and is sent again (recovery): behind nothing now
    assert again.after == "" and again.chunk == c1.chunk
    assert slots.running[("actor", 0)] is again and s1.lone_call("actor") is again
    s1.call_done(again)
    assert s1.finished and not slots.busy and slots.used == {"actor": 0} and not slots.running

    # every op dispatched on its own: while step 0 generates, its update is still to be sent
    plan = compile(pipeline, ["data.batch_size=4", "rollout.n=2", "actor.mini_batch_size=4", "trainer.fuse_ops=false"],
                   pipeline_ref=ref)
    window, slots, s0, s1, c0 = start(plan)
    assert window.gates() == []
    s0.call_done(c0)
    while (calls := s0.next_calls()) and calls[0].chunk.op != "update_actor":
        for c in calls:
            s0.call_done(c)
    (update,) = calls  # step 0's last call: step 1's ops may queue behind it, generation first
    gates = window.gates()
    assert {g.op for g in gates} >= {"generate", "update_actor"} and {g.after for g in gates} == {(StepKey(0), update)}
    for g in gates:
        s1.open(g.op, (update, "p0/update_actor/0"))
    (c1,) = s1.next_calls()
    assert (c1.chunk.op, c1.after) == ("generate", "p0/update_actor/0")
    s0.call_done(update)
    assert s1.next_calls() == []  # the rank runs step 1's generation now: nothing queues behind the update any more
    s1.call_done(c1)
    assert all(c.after == "" for c in s1.next_calls())


def test_no_call_queues_behind_one_whose_new_weights_another_group_reads():
    """examples/grpo_async.py: the update's weights go to the rollout group, exported from the actor
    once the update's call ended; a call of the next step queued behind it would have changed them by
    then. Its next update waits for the hand-off, as before."""
    plan = _plan()
    window, slots = Window(plan, STATEFUL), Slots(plan)
    uids = [u for u in range(4) for _ in range(2)]
    for step in (0, 1):
        window.admit(step, StepScheduler(plan, uids, [False] * 8, step, slots=slots, gated=window.gated_ops()))
    s0 = window.live[min(window.live)]
    while not s0.lone_call("actor"):  # run step 0 until its update is the actor's last call
        for gate in window.gates():
            if gate.sync:
                window.holds(*gate.sync)
            elif gate.key.step == 0:
                s0.open(gate.op)
        for call in s0.next_calls():
            if call.chunk.op != "update_actor":
                s0.call_done(call)
    assert all(g.after is None for g in window.gates())
    assert not any(g.key.step == 1 and g.op in ("update_actor", "old_logprob") for g in window.gates())
