"""The pipeline's Python config gives 'data.batch_size' as the string "8" instead of an int."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"score": T.float32().metric()}, group="workers")
def judge(prompt: T.str()):
    return 1.0


pipeline = Pipeline("mistyped_config", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("workers")],
                    config={"data": {"batch_size": "8"}})
