"""An output typed `T.float32` without its call."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup
from rlgraph.ops import stages

@rlgraph.op(outputs={"score": T.float32}, group="w")
def judge(prompt: T.str()):
    return 1.0
pipeline = Pipeline("t_uncalled", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("w")])
