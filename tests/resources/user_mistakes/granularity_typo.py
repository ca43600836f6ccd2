"""`granularity="per_sample"`: the granularities are sample, group and batch."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup
from rlgraph.ops import stages

@rlgraph.op(outputs={"score": T.float32().metric()}, group="w", granularity="per_sample")
def judge(prompt: T.str()):
    return 1.0
pipeline = Pipeline("granularity_typo", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("w")])
