"""`outputs=["score"]`: a list of names where a dict of name -> column type belongs."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup
from rlgraph.ops import stages

@rlgraph.op(outputs=["score"], group="w")
def judge(prompt: T.str()):
    return 1.0
pipeline = Pipeline("outputs_list", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("w")])
