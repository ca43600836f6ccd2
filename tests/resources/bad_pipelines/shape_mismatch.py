"""Op 'judge' writes 'token_scores' per response token, op 'update' reads it per prompt token."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"token_scores": T.float32("response_len")}, group="workers")
def judge(prompt: T.str()):
    return [1.0]


@rlgraph.op(outputs={"update_metrics": T.json().metric()}, group="workers", granularity="batch")
def update(token_scores: T.float32("prompt_len")):
    return {}


pipeline = Pipeline("shape_mismatch", DataSource({"prompt": T.str()}), [judge, update], [WorkerGroup("workers")])
