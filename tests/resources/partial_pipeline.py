"""Partial rollout on plain functions: the rollout (`gen`, stale_ok, `partial` on) runs a step ahead
of the update; while a call of step t runs, it waits for the weights step t-1's update writes,
which must reach it mid-call (the runtime pushes them on the workers' control thread).

gen records the weight version it started with and the one it ended with; update reports both, so
a test sees which version each step's rollout used, and that it never saw one written at or after
its own step.
"""

import time

import torch

from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup, op, op_spec


class Prompts:
    def __init__(self, config, seed):
        self.position = 0

    def next_batch(self, batch_size):
        rows = [torch.full((2,), float(self.position + i)) for i in range(batch_size)]
        self.position += batch_size
        return {"x": rows}

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = int(state["position"])


def _version(w):
    return -1 if w is None else int(w)


@op(outputs={"v_start": T.int64(), "v_end": T.int64()}, granularity="batch", group="rollout")
def gen(x: T.float32("xlen"), w: T.float32().state(), *, partial: bool = True, wait_s: float = 30.0, ctx=None):
    """Wait (up to `wait_s`) until weights written at step t-1 show in ctx.state; take them."""
    start = _version(w)
    want, deadline = ctx.step - 1, time.time() + wait_s
    end = start
    while partial and end < want and time.time() < deadline:
        time.sleep(0.02)
        end = max(end, _version(ctx.state.get("w")))
    n = x.shape[0]
    return {"v_start": torch.full((n,), start, dtype=torch.int64), "v_end": torch.full((n,), end, dtype=torch.int64)}


@op(outputs={"update_metrics": T.json().metric(), "w": T.float32().state()}, granularity="batch", group="train")
def update(v_start: T.int64(), v_end: T.int64(), *, hold_s: float = 0.3, ctx=None):
    time.sleep(hold_s)  # the next step's rollout is running meanwhile
    return {"update_metrics": {"v_start": float(v_start.max()), "v_end": float(v_end.max()),
                               "v_end_min": float(v_end.min())}, "w": torch.tensor(float(ctx.step))}


pipeline = Pipeline(
    name="partial_tensors",
    source=DataSource(columns={"x": T.float32("xlen")}, impl=Prompts),
    ops=[op_spec(gen).with_(stale_ok=True), update],  # the rollout may run a step ahead
    groups=[WorkerGroup("rollout", num_cpus=0.5), WorkerGroup("train", num_cpus=0.5)],
    cluster=Cluster(cpus_per_node=8),
    config={"data": {"batch_size": 4}, "trainer": {"steps": 4, "max_staleness": 1}},
)
