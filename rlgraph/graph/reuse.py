"""Pass 2b, reuse: leave out a forward pass whose result the update computes anyway.

PPO's old log-probs are the current policy's log-probs of the sampled tokens, taken before the
update changes the policy. When the update makes exactly one optimizer step per training step
(one epoch, one mini-batch: ``OpBatching.updates_per_step == 1``), its own first forward runs
with those weights on those tokens, so a separate ``old_logprob`` pass computes what the update
computes anyway: the update takes them from its forward, detached (TRL's GRPOTrainer does the
same with ``num_iterations=1``; the ratio is 1 and the gradient is verl's).

An op declares what it can compute itself with ``OpSpec(recomputes=...)``, a function of its
params (the actor's update: ``old_log_probs``). Truncated importance sampling then weighs each
micro-batch's tokens by that forward's log-probs; decoupled PPO's proximal log-probs, whose cap
drops tokens and so changes the loss's normaliser, come from the forward when it sees every row
of the update (one rank, one micro-batch), else from a no-grad pass the update makes in its own
call (no dispatch, no data plane). A producer P of such a column is left out of the plan
when all of these hold:

- ``trainer.reuse_forward`` is true (the default);
- the reading op U makes one optimizer step per training step;
- P runs on U's worker group (the same model) and reads no state U does not write (its weights
  are the ones U starts from) and no stale state (``stale_ok``);
- every data column P writes is read by U alone, or by nobody, and none is a summary or a
  validation column; P drops no rows and is not a dynamic-sampling filter.

The plan lists the ops left out and why (``Plan.reused``), and ``rlgraph describe`` and the SVG
show them. The compiled graph is then built again without them (`build`'s ``leave_out``), so
every later pass sees the smaller graph while their config keys stay valid.
"""

from __future__ import annotations

from rlgraph.graph.batching import batch, op_batching
from rlgraph.graph.build import BuiltGraph
from rlgraph.graph.settings import TrainerSettings

__all__ = ["reused_forwards"]


def reused_forwards(g: BuiltGraph) -> dict[str, str]:
    """Op -> why the plan leaves it out (its result is another op's own forward); {} if none."""
    if not TrainerSettings.of(g.config).reuse_forward:
        return {}
    plan = None
    out: dict[str, str] = {}
    kept = set(g.pipeline.summaries) | set(g.pipeline.validation) | set(g.pipeline.outputs)
    for u in g.pipeline.ops:
        if u.recomputes is None:
            continue
        params = {k: g.param(u, k) for k in u.params}
        for col in sorted(set(u.recomputes(params)) & set(g.connected(u))):
            producer = g.producers[col][0]
            if producer == g.source or producer in out:
                continue
            p = g.spec(producer)
            plan = plan or batch(g)
            b = op_batching(g, u, plan)
            if b.updates_per_step != 1 or p.group != u.group or p.stale_ok or g.drops(p) or p.refill:
                continue
            if any(t.kind == "state" and c not in u.outputs for c, t in p.inputs.items()):
                continue
            readers = {dst for _, dst, a in g.dag.out_edges(producer, data=True) if a["kind"] == "data"}
            if readers - {u.name} or set(p.outputs) & kept:
                continue
            metrics = [c for c, t in p.outputs.items() if t.kind == "metric"]
            out[producer] = (f"its {col!r} is {u.name}'s own first forward: {u.name} makes one optimizer step per "
                             f"training step ({b.mini_batches} mini-batch x {b.epochs} epoch) on group {u.group!r}"
                             + (f"; its metrics ({', '.join(metrics)}) are not reported" if metrics else "")
                             + "; trainer.reuse_forward=false keeps it")
    return out
