"""Validation names 'scores' (a typo of 'score') and 'prompt', which only the data source writes."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"score": T.float32()}, group="workers")
def judge(prompt: T.str()):
    return {"score": 1.0}


pipeline = Pipeline("validation_unproduced", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("workers")],
                    outputs=["score"], validation=["scores", "prompt"])
