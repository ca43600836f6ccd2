"""Two different functions are both declared as op 'judge' (op names must be unique)."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(name="judge", outputs={"length_score": T.float32().metric()}, group="workers")
def judge_length(prompt: T.str()):
    return float(len(prompt))


@rlgraph.op(name="judge", outputs={"format_score": T.float32().metric()}, group="workers")
def judge_format(prompt: T.str()):
    return 0.0


pipeline = Pipeline("duplicate_op", DataSource({"prompt": T.str()}), [judge_length, judge_format],
                    [WorkerGroup("workers")])
