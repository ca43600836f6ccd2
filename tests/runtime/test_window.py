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
