"""Op 'judge' takes *columns instead of naming each input column."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"score": T.float32()}, group="workers")
def judge(*columns):
    return 1.0


pipeline = Pipeline("decl_varargs", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("workers")])
