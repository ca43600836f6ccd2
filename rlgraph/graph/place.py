"""Pass 6, place: worker groups onto resource pools, pools onto the cluster's nodes.

A pool is a list of bundles, one per worker slot. Groups naming the same pool are colocated:
they time-share its bundles, so the pool has ``max(dp)`` bundles, each as large as the largest
per-worker demand among its groups. Bundles go onto nodes by the one packing rule
(`rlgraph.graph.packing`: first-fit, largest first, after the data plane's reservation), which
the run's resource check applies to the real cluster too. The built graph packs once
(``BuiltGraph.packing``); the check pass and this pass read the result.

**Lent CPUs** (`lent_threads`): a worker computes with its group's torch threads (its bundle's
CPUs). An op during which no op of another group can run leaves the other groups' bundles on its
node idle: a barrier op that does not stream, with nothing in its ``concurrent_with``, in a plan
with ``trainer.max_staleness=0`` (the update in GRPO), on a one-node plan, when every op of the other pools waits for it
at the next step (they read a state column it writes, or follow one that does: the next step is
admitted while this one runs). Its workers then compute with the other pools' CPUs too, shared
among its ranks. A group whose ``torch_threads`` is set keeps exactly that.
"""

from __future__ import annotations

from rlgraph.errors import Problem
from rlgraph.graph.build import BuiltGraph
from rlgraph.graph.packing import dataplane_cpus, pool_placement
from rlgraph.graph.plan import BundlePlan, ClusterPlan, GroupPlan, OpPlan, PoolPlan

__all__ = ["lent_threads", "place", "resource_problems"]

_EPS = 1e-9


def resource_problems(g: BuiltGraph) -> list[Problem]:
    """Groups that exceed the cluster, and pools that do not fit on its nodes."""
    problems: list[Problem] = []
    n = int(g.config["cluster.num_nodes"])
    node_cpus = float(g.config["cluster.cpus_per_node"])
    node_gpus = float(g.config["cluster.gpus_per_node"])
    total_cpus, total_gpus = n * node_cpus, n * node_gpus
    dp_cpus = dataplane_cpus(g.config)
    if dp_cpus > total_cpus + _EPS:
        problems.append(Problem(
            "resources",
            f"the data plane reserves {dp_cpus:g} CPUs (dataplane.cpus_per_unit="
            f"{float(g.config['dataplane.cpus_per_unit']):g} x (1 controller + "
            f"{int(g.config['dataplane.storage_units'])} storage unit(s))) but the cluster has {total_cpus:g} "
            f"({n} node(s) x {node_cpus:g}); TransferQueue would hang at start-up",
            "lower dataplane.storage_units or dataplane.cpus_per_unit, raise cluster.num_nodes / "
            "cluster.cpus_per_node, or set dataplane.backend=ray"))
    for gr in g.groups:
        need_c, need_g = gr.dp * gr.num_cpus, gr.dp * gr.num_gpus
        for what, need, have, per, per_node, key in (
            ("CPUs", need_c, total_cpus, gr.num_cpus, node_cpus, "cpus_per_node"),
            ("GPUs", need_g, total_gpus, gr.num_gpus, node_gpus, "gpus_per_node"),
        ):
            if need > have + _EPS:
                problems.append(Problem(
                    "resources",
                    f"worker group {gr.name!r} needs {need:g} {what} (dp={gr.dp} x {per:g}) but the cluster "
                    f"has {have:g} ({n} node(s) x {per_node:g})",
                    f"lower groups.{gr.name}.dp or groups.{gr.name}.num_{what.lower()}, or raise "
                    f"cluster.num_nodes / cluster.{key}"))
            elif per > per_node + _EPS:
                problems.append(Problem(
                    "resources",
                    f"worker group {gr.name!r} needs {per:g} {what} per worker but a node has {per_node:g}",
                    f"lower groups.{gr.name}.num_{what.lower()} to at most {per_node:g} or raise "
                    f"cluster.{key}"))
    if problems:
        return problems
    unplaced = [slot.describe() for slot in g.packing.unplaced]
    if unplaced:
        problems.append(Problem(
            "placement",
            f"{len(unplaced)} worker slot(s) do not fit on the cluster's {n} node(s) of {node_cpus:g} CPU / "
            f"{node_gpus:g} GPU (data plane reserves {dp_cpus:g} CPU): {', '.join(unplaced[:6])}"
            + (" ..." if len(unplaced) > 6 else ""),
            "raise cluster.num_nodes or cluster.cpus_per_node/gpus_per_node, lower some groups' dp or "
            "per-worker resources, or colocate groups on one pool (groups.<name>.pool=...)"))
    return problems


def place(g: BuiltGraph) -> tuple[list[GroupPlan], list[PoolPlan], ClusterPlan]:
    """Groups, pools with node assignments, and the cluster summary. Call after `check`."""
    assert not g.packing.unplaced, "place() called on a graph that failed the resource check"
    ops_of: dict[str, list[str]] = {}
    for o in g.pipeline.ops:
        ops_of.setdefault(o.group or "", []).append(o.name)
    bundles: dict[str, list[BundlePlan]] = {}
    for slot in g.slots:
        bundles.setdefault(slot.pool, []).append(BundlePlan(
            index=slot.index, node=g.packing.node_of[(slot.pool, slot.index)], num_cpus=slot.cpus,
            num_gpus=slot.gpus))
    group_plans = [
        GroupPlan(name=gr.name, dp=gr.dp, num_cpus=gr.num_cpus, num_gpus=gr.num_gpus, pool=gr.pool,
                  ops=ops_of.get(gr.name, []),
                  # colocated groups take turns on a bundle, so a worker computing alone may use all of it
                  torch_threads=gr.torch_threads or max(1, int(max((b.num_cpus for b in bundles[gr.pool]),
                                                                   default=gr.num_cpus))))
        for gr in g.groups
    ]
    pool_plans = [PoolPlan(name=pool, groups=[m.name for m in members],
                           placement=pool_placement(m.placement for m in members),
                           bundles=bundles[pool])
                  for pool, members in g.pools.items()]
    dp_cpus = dataplane_cpus(g.config)
    cluster = ClusterPlan(
        num_nodes=int(g.config["cluster.num_nodes"]),
        cpus_per_node=float(g.config["cluster.cpus_per_node"]),
        gpus_per_node=float(g.config["cluster.gpus_per_node"]),
        dataplane_cpus=dp_cpus,
        required_cpus=dp_cpus + sum(b.num_cpus for p in pool_plans for b in p.bundles),
        required_gpus=sum(b.num_gpus for p in pool_plans for b in p.bundles),
    )
    return group_plans, pool_plans, cluster


def lent_threads(ops: list[OpPlan], groups: list[GroupPlan], pools: list[PoolPlan], max_staleness: int,
                 num_nodes: int, fixed: set[str], waits: dict[str, set[str]]) -> dict[str, int]:
    """Per op that runs alone on its node (the module doc's Lent CPUs), the torch threads its
    workers compute with: their group's plus, per rank, an equal share of the CPUs of the other
    pools' bundles on the node. `fixed`: groups whose torch_threads the user set (they keep them).
    `waits`: per op, the ops that cannot start at the next step before it finished (they read a
    state column it writes, or follow one that does); every op of a lending group must be among
    them, since with one step in flight the next step is admitted already. Only on one node (a
    cluster's placement of pools onto nodes is Ray's, best effort). Ops not listed keep their
    group's threads."""
    if max_staleness or num_nodes != 1:
        return {}
    group = {g.name: g for g in groups}
    pool_of = {p.name: p for p in pools}
    out: dict[str, int] = {}
    for o in ops:
        g = group.get(o.group)
        if (g is None or g.name in fixed or o.mode != "barrier" or o.streams or o.concurrent_with
                or o.fused_into):
            continue
        others = [p for p in pools if p.name != g.pool]  # a pool of its own: colocated groups may use the rest
        if any(x.name not in waits.get(o.name, set()) for x in ops
               if any(x.group in p.groups for p in others)):
            continue
        ranks = len(pool_of[g.pool].bundles[:g.dp])
        extra = int(sum(b.num_cpus for p in others for b in p.bundles) // ranks)
        if extra >= 1:
            out[o.name] = g.torch_threads + extra
    return out
