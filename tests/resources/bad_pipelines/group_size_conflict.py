"""Ops 'sample_short' and 'sample_long' each declare the group size n (only the generator may)."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"short": T.str()}, group="workers", granularity="group", group_size_param="n")
def sample_short(prompt: T.str(), *, n: int = 4):
    return prompt


@rlgraph.op(outputs={"long": T.str()}, group="workers", granularity="group", group_size_param="n")
def sample_long(prompt: T.str(), *, n: int = 8):
    return prompt


pipeline = Pipeline("group_size_conflict", DataSource({"prompt": T.str()}), [sample_short, sample_long],
                    [WorkerGroup("workers")], outputs=["short", "long"])
