"""Op 'update' reads this step's per-sample column 'score' as cross-step state."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup
from rlgraph.ops import stages

@rlgraph.op(outputs={"m": T.json().metric()}, group="g", granularity="batch")
def update(score: T.float32().state()):
    return {"m": {}}
@rlgraph.op(outputs={"score": T.float32()}, group="g")
def judge(prompt: T.str()):
    return 1.0
pipeline = Pipeline("data_read_as_state", DataSource({"prompt": T.str()}), [judge, update], [WorkerGroup("g")])
