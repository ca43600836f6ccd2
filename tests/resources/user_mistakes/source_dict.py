"""source= given the dict of columns instead of a DataSource."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup
from rlgraph.ops import stages

@rlgraph.op(outputs={"score": T.float32().metric()}, group="w")
def judge(prompt: T.str()):
    return 1.0
pipeline = Pipeline("source_dict", {"prompt": T.str()}, [judge], [WorkerGroup("w")])
