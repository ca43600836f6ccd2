"""groups= given as names instead of WorkerGroup objects."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup
from rlgraph.ops import stages

@rlgraph.op(outputs={"score": T.float32().metric()}, group="w")
def judge(prompt: T.str()):
    return 1.0
pipeline = Pipeline("groups_strings", DataSource({"prompt": T.str()}), [judge], ["w"])
