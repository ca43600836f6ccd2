"""`@rlgraph.op` used without its call and outputs=."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup
from rlgraph.ops import stages

@rlgraph.op
def judge(prompt: T.str()):
    return 1.0
pipeline = Pipeline("op_decorator_uncalled", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("w")])
