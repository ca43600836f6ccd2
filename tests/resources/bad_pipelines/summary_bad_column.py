"""The pipeline summarises 'scores' (a typo of 'score') and a string column, and names two summaries 'score'."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"score": T.float32(), "verdict": T.str()}, group="workers")
def judge(prompt: T.str()):
    return {"score": 1.0, "verdict": "ok"}


pipeline = Pipeline("summary_bad_column", DataSource({"prompt": T.str()}), [judge], [WorkerGroup("workers")],
                    outputs=["score", "verdict"], summaries={"scores": "score", "verdict": "score"})
