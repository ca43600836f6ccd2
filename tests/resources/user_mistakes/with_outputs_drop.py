"""`with_outputs(drop=["scroe"])` names an output the pipeline does not keep."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup
from rlgraph.ops import stages

@rlgraph.op(outputs={"score": T.float32().metric()}, group="w")
def judge(prompt: T.str()):
    return 1.0
pipeline = Pipeline("with_outputs_drop", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("w")]).with_outputs(drop=["scroe"])
