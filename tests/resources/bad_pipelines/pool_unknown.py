"""Worker group 'reward' names pool 'actr' (a typo of 'actor'): it would silently get a pool of its own."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"score": T.float32()}, group="reward")
def judge(prompt: T.str()):
    return 1.0


@rlgraph.op(outputs={"update_metrics": T.json().metric()}, group="actor", granularity="batch")
def update(score: T.float32()):
    return {}


pipeline = Pipeline("pool_unknown", DataSource({"prompt": T.str()}), [judge, update],
                    [WorkerGroup("actor"), WorkerGroup("reward", pool="actr")])
