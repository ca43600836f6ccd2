"""Op 'update' splits the batch into mini-batches but is declared per sample (it must be 'batch')."""

import rlgraph
from rlgraph import Batching, DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"update_metrics": T.json().metric()}, group="workers",
            batching=Batching(mini_batch="mini_batch_size"))
def update(score: T.float32(), *, mini_batch_size: int = 2):
    return {}


pipeline = Pipeline("batching_not_batch", DataSource({"score": T.float32()}), [update], [WorkerGroup("workers")])
