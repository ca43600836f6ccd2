"""T.float31 is not a dtype: T's attribute lookup fails, and the loader reports the file and line."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"score": T.float31()}, group="workers")
def judge(prompt: T.str()):
    return 1.0


pipeline = Pipeline("load_unknown_dtype_attr", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("workers")])
