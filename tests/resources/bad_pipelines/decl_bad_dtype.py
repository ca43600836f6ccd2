"""Column 'score' is declared with dtype 'fp32', which is not a dtype (caught at import)."""

import rlgraph
from rlgraph import ColumnType, DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"score": ColumnType(dtype="fp32")}, group="workers")
def judge(prompt: T.str()):
    return 1.0


pipeline = Pipeline("decl_bad_dtype", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("workers")])
