"""Pass 5, schedule: which ops stream, which wait for groups or the whole batch, what overlaps.

- ``stream``: a per-sample op starts on micro-batches of rows whose inputs exist;
- ``group``: a per-group op starts on each complete group of ``n`` samples;
- ``barrier``: a whole-batch op waits for every row of the padded batch.

Two ops may run concurrently when neither depends on the other (no path of data edges either
way) and they sit on different resource pools (ops of one group share its actors; groups on one
pool time-share its devices). The critical path is the longest chain of ops weighted by their
``cost`` hints; it is the lower bound on step time that the streaming schedule tries to reach.
"""

from __future__ import annotations

import networkx as nx

from rlgraph.graph.build import BuiltGraph
from rlgraph.graph.dsl import OpSpec
from rlgraph.graph.plan import SchedulePlan
from rlgraph.graph.settings import TrainerSettings

__all__ = ["MODES", "mode_of", "schedule", "concurrency", "staleness"]

MODES = {"sample": "stream", "group": "group", "batch": "barrier"}


def mode_of(granularity: str) -> str:
    return MODES[granularity]


def _order(d: nx.DiGraph) -> list[str]:
    return list(nx.lexicographical_topological_sort(d))


def staleness(g: BuiltGraph, o: OpSpec) -> int:
    """Steps by which `o`'s state inputs may trail (``OpPlan.lag``): ``trainer.max_staleness`` for an
    op declared ``stale_ok`` that reads state, else 0. At step t the op reads the state written at
    step t-1-lag, so the next steps' rollout runs while this one trains (`rlgraph.runtime.window`)."""
    reads_state = any(t.kind == "state" for t in o.inputs.values())
    return TrainerSettings.of(g).max_staleness if o.stale_ok and reads_state else 0


def concurrency(g: BuiltGraph) -> dict[str, list[str]]:
    """Op -> the ops it may overlap with, sorted."""
    ops = [o.name for o in g.pipeline.ops]
    pool_of_group = {gr.name: gr.pool for gr in g.groups}
    pool = {o.name: pool_of_group.get(o.group or "", o.group) for o in g.pipeline.ops}
    related = {a: g.upstream[a] | g.downstream[a] for a in ops}
    return {
        a: sorted(b for b in ops if b != a and b not in related[a] and pool[a] != pool[b])
        for a in ops
    }


def schedule(g: BuiltGraph) -> tuple[SchedulePlan, dict[str, int], dict[str, list[str]]]:
    """The schedule, each op's stage index, and each op's concurrent ops. Call after `check`."""
    d = g.data_dag
    src = g.source
    stages: list[list[str]] = []
    for gen in nx.topological_generations(d):
        names = sorted(x for x in gen if x != src)
        if names:
            stages.append(names)
    stage_of = {name: i for i, names in enumerate(stages) for name in names}

    cost = {o.name: float(o.cost) for o in g.pipeline.ops}
    w = nx.DiGraph()
    w.add_nodes_from(d.nodes)
    for u, v in d.edges:
        w.add_edge(u, v, weight=cost.get(v, 0.0))
    # roots other than the source start the path with their own cost: a virtual start node
    start = "\x00start"
    for node in d.nodes:
        w.add_edge(start, node, weight=cost.get(node, 0.0))
    path = nx.dag_longest_path(w, weight="weight", topo_order=_order(w))
    path = [x for x in path if x != start]
    if path and path[0] != src and d.has_edge(src, path[0]):
        path = [src] + path
    path_cost = sum(cost.get(x, 0.0) for x in path)

    by_mode = {m: sorted(o.name for o in g.pipeline.ops if mode_of(o.granularity) == m) for m in MODES.values()}
    plan = SchedulePlan(
        stages=stages,
        streaming=by_mode["stream"],
        group_wise=by_mode["group"],
        barriers=by_mode["barrier"],
        critical_path=path,
        critical_path_cost=path_cost,
    )
    return plan, stage_of, concurrency(g)
