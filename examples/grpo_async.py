"""Asynchronous GRPO: the rollout runs one step ahead of the update (``trainer.max_staleness=1``).

``grpo.py``'s task, model and algorithm, derived from it with the DSL's ``with_*`` methods:
generation moves to a worker group of its own (``rollout``, its own copy of the weights, synced
from ``update_actor``), so step t+1's prompts are generated while step t is scored and trained,
by a policy one update older than the one trained. The reward, the reference pass and the
advantage run beside generation, in the same call (the frozen reference model is the rollout
worker's to hold), so the actor's core only trains. The update corrects for the older behaviour policy with decoupled PPO
(``actor.decoupled_cap``): its proximal log-probs are the current policy's, which the update's
own forward gives (one optimizer step per step: the compiler leaves ``old_logprob`` out).
``trainer.max_staleness=0`` runs the same graph on-policy.

    rlgraph run examples/grpo_async.py -o runs/grpo_async
    rlgraph run examples/grpo_async.py -o runs/grpo_k0 trainer.max_staleness=0   # on-policy, same graph
    rlgraph compile examples/grpo_async.py -o build/grpo_async
"""

import sys
from dataclasses import replace
from pathlib import Path

from rlgraph import WorkerGroup
from rlgraph.ops import stages

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo import pipeline as grpo  # noqa: E402  (its prepare hook builds and warm-starts the model)

pipeline = replace(
    grpo.with_ops(stages.generate(group="rollout"), stages.reward(group="rollout"), stages.ref(group="rollout"),
                  stages.advantage("grpo", group="rollout"))
    .with_groups(WorkerGroup("rollout", dp=1, num_cpus=1, doc="generation with its own copy of the policy; "
                             "the reward, the reference log-probs, the advantage"),
                 WorkerGroup("actor", dp=1, num_cpus=1, doc="policy: the update (its forward gives the proximal "
                             "log-probs)"))
    .with_config(actor={"decoupled_cap": 5.0}, trainer={"max_staleness": 1}),
    name="grpo_async",
)
