"""`with_groups(drop=["ww"])` names a group the pipeline does not have."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup
from rlgraph.ops import stages

@rlgraph.op(outputs={"score": T.float32().metric()}, group="w")
def judge(prompt: T.str()):
    return 1.0
pipeline = Pipeline("with_groups_drop", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("w")]).with_groups(drop=["ww"])
