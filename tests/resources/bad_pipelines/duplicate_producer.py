"""Ops 'judge_length' and 'judge_format' both output column 'score' (a column has one producer)."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"score": T.float32()}, group="workers")
def judge_length(prompt: T.str()):
    return float(len(prompt))


@rlgraph.op(outputs={"score": T.float32()}, group="workers")
def judge_format(prompt: T.str()):
    return 0.0


pipeline = Pipeline("duplicate_producer", DataSource({"prompt": T.str()}), [judge_length, judge_format],
                    [WorkerGroup("workers")], outputs=["score"])
