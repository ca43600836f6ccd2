"""`WorkerGroup(num_cpus="one")`: a word where a number belongs."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup
from rlgraph.ops import stages

@rlgraph.op(outputs={"score": T.float32().metric()}, group="w")
def judge(prompt: T.str()):
    return 1.0
pipeline = Pipeline("num_cpus_str", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("w", num_cpus="one")])
