"""The pipeline's config given as a list of override strings instead of a dict."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup
from rlgraph.ops import stages

@rlgraph.op(outputs={"score": T.float32().metric()}, group="w")
def judge(prompt: T.str()):
    return 1.0
pipeline = Pipeline("config_list", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("w")], config=["data.batch_size=4"])
