"""Pass 6, place: worker groups onto resource pools, pools onto the cluster's nodes.

A pool is a list of bundles, one per worker slot. Groups naming the same pool are colocated:
they time-share its bundles, so the pool has ``max(dp)`` bundles, each as large as the largest
per-worker demand among its groups. Bundles are packed onto nodes first-fit, largest first
(what a Ray ``PACK`` placement group does); the data plane's own reservation (TransferQueue's
controller and storage units each hold CPUs) is taken from node 0 first, because peers hang
silently at start-up when it is forgotten.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlgraph.errors import Problem
from rlgraph.graph.build import BuiltGraph
from rlgraph.graph.plan import BundlePlan, ClusterPlan, GroupPlan, PoolPlan

__all__ = ["resolved_groups", "dataplane_cpus", "place", "resource_problems"]

_EPS = 1e-9


@dataclass(frozen=True)
class _Group:
    name: str
    dp: int
    num_cpus: float
    num_gpus: float
    pool: str
    placement: str = "pack"


def resolved_groups(g: BuiltGraph) -> list[_Group]:
    out, seen = [], set()
    for gr in g.pipeline.groups:
        if gr.name in seen:
            continue
        seen.add(gr.name)
        c = {k: g.config[f"groups.{gr.name}.{k}"] for k in ("dp", "num_cpus", "num_gpus", "pool", "placement")}
        out.append(_Group(gr.name, int(c["dp"]), float(c["num_cpus"]), float(c["num_gpus"]), str(c["pool"]),
                          str(c["placement"])))
    return out


def dataplane_cpus(config: dict[str, Any] | Any) -> float:
    """CPUs the data plane reserves: TransferQueue's controller plus each storage unit."""
    if config["dataplane.backend"] != "transferqueue":
        return 0.0
    return float(config["dataplane.cpus_per_unit"]) * (1 + int(config["dataplane.storage_units"]))


def _pools(groups: list[_Group]) -> dict[str, list[_Group]]:
    pools: dict[str, list[_Group]] = {}
    for gr in groups:
        pools.setdefault(gr.pool, []).append(gr)
    return pools


def _pack(g: BuiltGraph) -> tuple[dict[str, list[BundlePlan]], list[str], list[float], list[float]]:
    """First-fit-decreasing packing. Returns bundles per pool, unplaced bundle descriptions,
    and the CPUs and GPUs left on each node."""
    n = int(g.config["cluster.num_nodes"])
    cpus = [float(g.config["cluster.cpus_per_node"])] * n
    gpus = [float(g.config["cluster.gpus_per_node"])] * n
    reserve = dataplane_cpus(g.config)
    for i in range(n):  # the data plane's actors go where there is room, node 0 first
        take = min(reserve, cpus[i])
        cpus[i] -= take
        reserve -= take
    demands: list[tuple[str, int, float, float]] = []
    spread: set[str] = set()
    for pool, members in _pools(resolved_groups(g)).items():
        size = max(m.dp for m in members)
        c = max(m.num_cpus for m in members)
        gp = max(m.num_gpus for m in members)
        demands += [(pool, i, c, gp) for i in range(size)]
        if any(m.placement == "spread" for m in members):
            spread.add(pool)
    placed: dict[str, list[BundlePlan]] = {}
    unplaced: list[str] = []
    for pool, i, c, gp in sorted(demands, key=lambda d: (-d[3], -d[2], d[0], d[1])):
        # a spread pool's slot i tries node i mod n first (round-robin), a packed one node 0 first
        first = i % n if pool in spread else 0
        for node in [*range(first, n), *range(first)]:
            if cpus[node] + _EPS >= c and gpus[node] + _EPS >= gp:
                cpus[node] -= c
                gpus[node] -= gp
                placed.setdefault(pool, []).append(BundlePlan(index=i, node=node, num_cpus=c, num_gpus=gp))
                break
        else:
            unplaced.append(f"pool {pool!r} slot {i} ({c:g} CPU, {gp:g} GPU)")
    return placed, unplaced, cpus, gpus


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
    groups = resolved_groups(g)
    for gr in groups:
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
    _, unplaced, _, _ = _pack(g)
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
    groups = resolved_groups(g)
    placed, unplaced, _, _ = _pack(g)
    assert not unplaced, "place() called on a graph that failed the resource check"
    ops_of: dict[str, list[str]] = {}
    for o in g.pipeline.ops:
        ops_of.setdefault(o.group or "", []).append(o.name)
    group_plans = [
        GroupPlan(name=gr.name, dp=gr.dp, num_cpus=gr.num_cpus, num_gpus=gr.num_gpus, pool=gr.pool,
                  ops=ops_of.get(gr.name, []))
        for gr in groups
    ]
    pool_plans = [
        PoolPlan(name=pool, groups=[m.name for m in members],
                 bundles=sorted(placed.get(pool, []), key=lambda b: b.index))
        for pool, members in _pools(groups).items()
    ]
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
