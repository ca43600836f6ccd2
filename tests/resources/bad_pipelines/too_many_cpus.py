"""Worker group 'rollout' needs dp=3 x 4 CPUs = 12 CPUs; the cluster has 1 node x 8 CPUs."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"response": T.str()}, group="rollout")
def generate(prompt: T.str()):
    return prompt


pipeline = Pipeline("too_many_cpus", DataSource({"prompt": T.str()}), [generate],
                    [WorkerGroup("rollout", dp=3, num_cpus=4)], Cluster(num_nodes=1, cpus_per_node=8),
                    outputs=["response"])
