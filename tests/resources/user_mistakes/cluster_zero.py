"""`Cluster(num_nodes=0)`: a cluster has at least one node."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup
from rlgraph.ops import stages

@rlgraph.op(outputs={"score": T.float32().metric()}, group="w")
def judge(prompt: T.str()):
    return 1.0
pipeline = Pipeline("cluster_zero", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("w")], cluster=Cluster(num_nodes=0))
