"""Worker group 'workers' is declared twice (with different dp)."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"score": T.float32().metric()}, group="workers")
def judge(prompt: T.str()):
    return 1.0


pipeline = Pipeline("duplicate_group", DataSource({"prompt": T.str()}), [judge],
                    [WorkerGroup("workers"), WorkerGroup("workers", dp=2)])
