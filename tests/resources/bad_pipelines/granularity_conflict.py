"""Per-sample op 'penalize' reads 'kl_coef', which op 'controller' produces once per batch."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"kl_coef": T.float32().per_batch()}, group="workers", granularity="batch")
def controller(score: T.float32()):
    return 0.1


@rlgraph.op(outputs={"reward": T.float32().metric()}, group="workers", granularity="sample")
def penalize(score: T.float32(), kl_coef: T.float32()):
    return score - kl_coef


pipeline = Pipeline("granularity_conflict", DataSource({"score": T.float32()}), [controller, penalize],
                    [WorkerGroup("workers")])
