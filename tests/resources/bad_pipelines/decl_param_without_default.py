"""Op 'judge' has a config parameter 'scale' (keyword-only) without a default (caught at import)."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"score": T.float32()}, group="workers")
def judge(prompt: T.str(), *, scale: float):
    return scale


pipeline = Pipeline("decl_param_without_default", DataSource({"prompt": T.str()}), [judge],
                    [WorkerGroup("workers")])
