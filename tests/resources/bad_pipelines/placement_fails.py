"""Group 'rollout' needs 3 x 2.5 = 7.5 CPUs of the 2 x 4 = 8 in the cluster (the data plane is
Ray, reserving none), so it fits in total; but a node holds one 2.5-CPU worker (2 x 2.5 = 5 > 4),
so only 2 of the 3 workers can be placed."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup


@rlgraph.op(outputs={"response": T.str()}, group="rollout")
def generate(prompt: T.str()):
    return prompt


pipeline = Pipeline("placement_fails", DataSource({"prompt": T.str()}), [generate],
                    [WorkerGroup("rollout", dp=3, num_cpus=2.5)], Cluster(num_nodes=2, cpus_per_node=4),
                    config={"dataplane": {"backend": "ray"}}, outputs=["response"])
