"""Worker group 'critic' runs no op, so it would hold a CPU for nothing."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"score": T.float32().metric()}, group="workers")
def judge(prompt: T.str()):
    return 1.0


pipeline = Pipeline("unused_group", DataSource({"prompt": T.str()}), [judge],
                    [WorkerGroup("workers"), WorkerGroup("critic")])
