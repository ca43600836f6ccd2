"""Op 'update' takes mini-batches of 16 prompts, but a step has only data.batch_size=8 prompts."""

import rlgraph
from rlgraph import Batching, DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"update_metrics": T.json().metric()}, group="workers", granularity="batch",
            batching=Batching(mini_batch="mini_batch_size"))
def update(score: T.float32(), *, mini_batch_size: int = 16):
    return {}


pipeline = Pipeline("minibatch_too_large", DataSource({"score": T.float32()}), [update], [WorkerGroup("workers")],
                    config={"data": {"batch_size": 8}})
