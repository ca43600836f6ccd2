"""Pass 4, batch: the padding multiple, the padded batch, and mini/micro-batch counts per op.

The rule (BRIEF section 2): pad the global batch of ``batch_size * n`` samples up to a multiple
of ``m = lcm(dp of every consuming worker group, mini_batch * n of every op that splits the
batch into mini-batches)``. Ops gated by a warm-up (``skip_before``, e.g. the actor update
during ``critic_warmup``) contribute their terms only once they run, so the plan carries two
multiples: during warm-up and after.

A dp size that does not divide a mini-batch is not an error: ranks get shares that differ by at
most one sample and losses are normalised by global token counts, so the update is unchanged.
The plan records the smallest and largest share.
"""

from __future__ import annotations

import math

from rlgraph.graph.build import BuiltGraph
from rlgraph.graph.dsl import OpSpec
from rlgraph.graph.plan import BatchPlan, OpBatching, PaddingTerm

__all__ = ["group_size", "gated", "batch", "op_batching"]


def group_size(g: BuiltGraph) -> int:
    """n, the samples per prompt: the value of the generator's group-size param (1 if none)."""
    for o in g.pipeline.ops:
        if o.group_size_param:
            return int(g.param(o, o.group_size_param))
    return 1


def gated(g: BuiltGraph, o: OpSpec) -> int:
    """The step from which `o` runs (0: always)."""
    return int(g.config.get(o.skip_before, 0) or 0) if o.skip_before else 0


def _reads_samples(g: BuiltGraph, o: OpSpec) -> bool:
    return any(
        c in g.column_types and g.column_types[c].level == "sample" and g.column_types[c].kind == "data"
        for c in o.inputs
    )


def _pad(total: int, multiple: int) -> int:
    return -(-total // multiple) * multiple


def batch(g: BuiltGraph) -> BatchPlan:
    n = group_size(g)
    batch_size = int(g.config[f"{g.source}.batch_size"])
    global_batch = batch_size * n
    dp = {gr.name: gr.dp for gr in g.groups}
    terms: list[PaddingTerm] = []
    by_group: dict[str, list[OpSpec]] = {}
    for o in g.pipeline.ops:
        if _reads_samples(g, o) and o.group in dp:
            by_group.setdefault(o.group, []).append(o)
    for group, ops in by_group.items():
        terms.append(PaddingTerm(source=f"dp of worker group {group!r}", value=dp[group],
                                 gated_by_warmup=all(gated(g, o) > 0 for o in ops)))
    for o in g.pipeline.ops:
        if o.batching and o.batching.mini_batch:
            mb = int(g.param(o, o.batching.mini_batch))
            terms.append(PaddingTerm(
                source=f"{o.name}: {o.namespace}.{o.batching.mini_batch}={mb} x n={n}",
                value=mb * n, gated_by_warmup=gated(g, o) > 0))
    warmup = max([gated(g, o) for o in g.pipeline.ops] + [0])
    multiple = math.lcm(1, *(t.value for t in terms))
    multiple_warmup = math.lcm(1, *(t.value for t in terms if not t.gated_by_warmup))
    padded, padded_w = _pad(global_batch, multiple), _pad(global_batch, multiple_warmup)
    return BatchPlan(
        batch_size=batch_size,
        n=n,
        global_batch=global_batch,
        terms=terms,
        multiple=multiple,
        padded_batch=padded,
        pad_rows=padded - global_batch,
        multiple_warmup=multiple_warmup,
        padded_batch_warmup=padded_w,
        pad_rows_warmup=padded_w - global_batch,
        critic_warmup=warmup,
    )


def op_batching(g: BuiltGraph, o: OpSpec, plan: BatchPlan) -> OpBatching:
    """How `o` splits the (steady-state) padded batch over its group's ranks."""
    dp = {gr.name: gr.dp for gr in g.groups}.get(o.group or "", 1)
    padded = plan.padded_batch
    per_rank = -(-padded // dp)
    b = o.batching
    micro = int(g.param(o, b.micro_batch)) if b and b.micro_batch else None
    if b and b.mini_batch:
        mb_samples = int(g.param(o, b.mini_batch)) * plan.n
        epochs = int(g.param(o, b.epochs)) if b.epochs else 1
        mini_batches = padded // mb_samples
        share = [mb_samples // dp, -(-mb_samples // dp)]
        return OpBatching(
            dp=dp, samples_per_rank=per_rank, mini_batch_samples=mb_samples, mini_batches=mini_batches,
            epochs=epochs, rank_mini_batch=share, micro_batch_size=micro,
            micro_batches=-(-share[1] // micro) if micro else 1,
            updates_per_step=mini_batches * epochs,
        )
    per = bool(b and b.per_rank)
    if o.granularity == "group":
        # a group op's micro-batch counts groups (prompts); each padding row is a group of its own
        groups_per_rank = -(-(plan.batch_size + plan.pad_rows) // dp)
        return OpBatching(dp=dp, samples_per_rank=per_rank, micro_batch_size=micro, per_rank=per,
                          micro_batches=-(-groups_per_rank // micro) if micro else None if micro == 0 else groups_per_rank)
    return OpBatching(dp=dp, samples_per_rank=per_rank, micro_batch_size=micro, per_rank=per,
                      micro_batches=-(-per_rank // micro) if micro else None)
