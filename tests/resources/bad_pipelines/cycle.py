"""Op 'draft' reads 'critique' and op 'critique' reads 'draft': a cycle within one step."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"draft": T.str()}, group="workers")
def draft(prompt: T.str(), critique: T.str()):
    return prompt + critique


@rlgraph.op(outputs={"critique": T.str()}, group="workers")
def critique(draft: T.str()):
    return draft


pipeline = Pipeline("cycle", DataSource({"prompt": T.str()}), [draft, critique], [WorkerGroup("workers")])
