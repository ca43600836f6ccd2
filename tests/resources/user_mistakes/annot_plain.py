"""An op's input annotated with the Python type `str` instead of a column type `T.str()`."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup
from rlgraph.ops import stages

@rlgraph.op(outputs={"score": T.float32().metric()}, group="w")
def judge(prompt: str):
    return 1.0
pipeline = Pipeline("annot_plain", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("w")])
