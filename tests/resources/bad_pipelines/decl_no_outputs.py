"""Op 'judge' declares no output columns (an op must produce something)."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={}, group="workers")
def judge(prompt: T.str()):
    return None


pipeline = Pipeline("decl_no_outputs", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("workers")])
