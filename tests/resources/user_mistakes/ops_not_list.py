"""ops= given one op instead of a list."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup
from rlgraph.ops import stages

@rlgraph.op(outputs={"score": T.float32().metric()}, group="w")
def judge(prompt: T.str()):
    return 1.0
pipeline = Pipeline("ops_not_list", DataSource({"prompt": T.str()}), judge, [WorkerGroup("w")])
