"""`data.task = "addition"`: the built-in task is called 'add'."""

import rlgraph
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup
from rlgraph.ops import stages

pipeline = Pipeline("task_unknown", stages.prompt_source(), [
        stages.generate(group="actor"),
        stages.reward(group="actor"),
        stages.old_logprob(group="actor"),
        stages.advantage("grpo", group="actor"),
        stages.update_actor(group="actor"),
    ], [WorkerGroup("actor")], config={"data": {"task": "addition"}})
