"""Column 'token_scores' has shape dimension 1.5, neither a fixed int nor a named size."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"token_scores": T.float32(1.5)}, group="workers")
def judge(prompt: T.str()):
    return [1.0]


pipeline = Pipeline("decl_bad_shape", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("workers")])
