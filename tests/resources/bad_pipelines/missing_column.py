"""Op 'update' reads column 'scroe' (a typo of 'score'), which nothing produces."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"score": T.float32()}, group="workers")
def judge(prompt: T.str()):
    return 1.0


@rlgraph.op(outputs={"loss": T.float32().metric()}, group="workers")
def update(scroe: T.float32()):
    return scroe


pipeline = Pipeline("missing_column", DataSource({"prompt": T.str()}), [judge, update], [WorkerGroup("workers")])
