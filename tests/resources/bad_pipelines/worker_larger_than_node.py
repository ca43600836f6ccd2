"""A worker of group 'rollout' needs 6 CPUs but a node has 4 (the 2 x 4 = 8 in total would do)."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"response": T.str()}, group="rollout")
def generate(prompt: T.str()):
    return prompt


pipeline = Pipeline("worker_larger_than_node", DataSource({"prompt": T.str()}), [generate],
                    [WorkerGroup("rollout", num_cpus=6)], Cluster(num_nodes=2, cpus_per_node=4),
                    config={"dataplane": {"backend": "ray"}}, outputs=["response"])
