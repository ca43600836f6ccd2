"""stages.advantage() is given the unknown estimator 'ppo' (caught where it is declared)."""

from rlgraph import Pipeline, WorkerGroup
from rlgraph.ops import stages

pipeline = Pipeline("decl_unknown_estimator", stages.prompt_source(),
                    [stages.generate(), stages.advantage("ppo", group="actor")], [WorkerGroup("actor")])
