"""Worker group 'rollout' needs dp=4 x 1 GPU = 4 GPUs; the cluster has 1 node x 2 GPUs."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"response": T.str()}, group="rollout")
def generate(prompt: T.str()):
    return prompt


pipeline = Pipeline("too_many_gpus", DataSource({"prompt": T.str()}), [generate],
                    [WorkerGroup("rollout", dp=4, num_gpus=1)], Cluster(num_nodes=1, cpus_per_node=8, gpus_per_node=2),
                    outputs=["response"])
