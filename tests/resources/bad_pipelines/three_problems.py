"""Three independent problems, all reported at once: op 'update' reads 'scroe' (nothing
produces it), op 'judge' names no worker group, and worker group 'critic' runs no op."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"score": T.float32()})
def judge(prompt: T.str()):
    return 1.0


@rlgraph.op(outputs={"update_metrics": T.json().metric()}, group="workers", granularity="batch")
def update(scroe: T.float32()):
    return {}


pipeline = Pipeline("three_problems", DataSource({"prompt": T.str()}), [judge, update],
                    [WorkerGroup("workers"), WorkerGroup("critic")])
