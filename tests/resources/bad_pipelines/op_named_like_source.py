"""Op 'data' has the name of the data source's node ('data'), so the two would be one node."""

import rlgraph
from rlgraph import DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"cleaned": T.str()}, group="workers")
def data(prompt: T.str()):
    return prompt.strip()


pipeline = Pipeline("op_named_like_source", DataSource({"prompt": T.str()}), [data], [WorkerGroup("workers")],
                    outputs=["cleaned"])
