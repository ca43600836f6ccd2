"""Op 'update' names no worker group (it would have no workers to run on)."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"score": T.float32()}, group="workers")
def judge(prompt: T.str()):
    return 1.0


@rlgraph.op(outputs={"update_metrics": T.json().metric()}, granularity="batch")
def update(score: T.float32()):
    return {}


pipeline = Pipeline("no_group", DataSource({"prompt": T.str()}), [judge, update], [WorkerGroup("workers")])
