"""Op 'judge' reads the update's cross-step state column 'w' as if it were this step's data."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"w": T.float32().state(), "update_metrics": T.json().metric()}, group="workers",
            granularity="batch")
def update(score: T.float32(), w: T.float32().state()):
    return {"w": 0.0, "update_metrics": {}}


@rlgraph.op(outputs={"score": T.float32()}, group="workers")
def judge(prompt: T.str(), w: T.float32()):
    return 1.0


pipeline = Pipeline("state_read_as_data", DataSource({"prompt": T.str()}), [judge, update], [WorkerGroup("workers")])
