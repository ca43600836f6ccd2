"""Op 'judge' declares config parameter 'top_k' as int but gives it the default 0.5."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"score": T.float32()}, group="workers")
def judge(prompt: T.str(), *, top_k: int = 0.5):
    return 1.0


pipeline = Pipeline("decl_param_bad_default", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("workers")])
