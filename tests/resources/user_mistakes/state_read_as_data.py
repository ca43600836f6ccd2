"""Op 'judge' reads the update's cross-step state column 'w' as this step's data."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup
from rlgraph.ops import stages

@rlgraph.op(outputs={"w": T.float32().state(), "m": T.json().metric()}, group="g", granularity="batch")
def update(score: T.float32(), w: T.float32().state()):
    return {"w": 1.0, "m": {}}
@rlgraph.op(outputs={"score": T.float32()}, group="g")
def judge(prompt: T.str(), w: T.float32()):
    return 1.0
pipeline = Pipeline("state_read_as_data", DataSource({"prompt": T.str()}), [judge, update], [WorkerGroup("g")])
