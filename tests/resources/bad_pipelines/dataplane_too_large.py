"""The data plane reserves 1 CPU x (1 controller + 3 storage units) = 4 CPUs on a 1 x 2 CPU
cluster whose only worker needs no CPU; TransferQueue would hang at start-up."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"response": T.str()}, group="rollout")
def generate(prompt: T.str()):
    return prompt


pipeline = Pipeline("dataplane_too_large", DataSource({"prompt": T.str()}), [generate],
                    [WorkerGroup("rollout", num_cpus=0)], Cluster(num_nodes=1, cpus_per_node=2),
                    config={"dataplane": {"storage_units": 3}}, outputs=["response"])
