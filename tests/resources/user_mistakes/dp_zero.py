"""`WorkerGroup(dp=0)`: a group has at least one worker."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup
from rlgraph.ops import stages

@rlgraph.op(outputs={"score": T.float32().metric()}, group="w")
def judge(prompt: T.str()):
    return 1.0
pipeline = Pipeline("dp_zero", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("w", dp=0)])
