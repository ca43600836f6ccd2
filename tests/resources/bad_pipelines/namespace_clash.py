"""Ops 'judge_length' and 'judge_format' both put their params under config namespace 'judge'."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"length_score": T.float32().metric()}, group="workers", config_key="judge")
def judge_length(prompt: T.str(), *, scale: float = 1.0):
    return scale * len(prompt)


@rlgraph.op(outputs={"format_score": T.float32().metric()}, group="workers", config_key="judge")
def judge_format(prompt: T.str(), *, bonus: float = 0.5):
    return bonus


pipeline = Pipeline("namespace_clash", DataSource({"prompt": T.str()}), [judge_length, judge_format],
                    [WorkerGroup("workers")])
