"""The pipeline's Python config sets 'judge.scael', a typo of the op's param 'judge.scale'."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"score": T.float32().metric()}, group="workers")
def judge(prompt: T.str(), *, scale: float = 1.0):
    return scale


pipeline = Pipeline("unknown_config_key", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("workers")],
                    config={"judge": {"scael": 2.0}})
