"""Op 'judge' has an input parameter 'prompt' without a column type (caught at import)."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"score": T.float32()}, group="workers")
def judge(prompt):
    return 1.0


pipeline = Pipeline("decl_untyped_input", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("workers")])
