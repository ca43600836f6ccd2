"""Op 'judge' writes column 'score' as float32 but op 'update' reads it as int64."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"score": T.float32()}, group="workers")
def judge(prompt: T.str()):
    return 1.0


@rlgraph.op(outputs={"update_metrics": T.json().metric()}, group="workers", granularity="batch")
def update(score: T.int64()):
    return {}


pipeline = Pipeline("dtype_mismatch", DataSource({"prompt": T.str()}), [judge, update], [WorkerGroup("workers")])
