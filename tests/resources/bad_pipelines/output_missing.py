"""The pipeline lists output 'scores' (a typo of 'score'), which nothing produces."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"score": T.float32()}, group="workers")
def judge(prompt: T.str()):
    return 1.0


pipeline = Pipeline("output_missing", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("workers")],
                    outputs=["scores"])
