"""Op 'judge' outputs 'score', but no op reads it and the pipeline does not keep it: dead work."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"score": T.float32()}, group="workers")
def judge(prompt: T.str()):
    return 1.0


@rlgraph.op(outputs={"length": T.int64()}, group="workers")
def measure(prompt: T.str()):
    return len(prompt)


pipeline = Pipeline("op_unused", DataSource({"prompt": T.str()}), [judge, measure], [WorkerGroup("workers")],
                    outputs=["length"])
