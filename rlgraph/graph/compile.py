"""The compiler: a declared `Pipeline` plus overrides -> a checked, frozen `Plan`.

    build -> check -> reuse (build -> check again without the ops it leaves out)
          -> prune -> batch -> schedule -> place -> fuse -> Plan

Each pass is a pure function of the built graph (see its module); this one only runs them in
order and assembles their results. Nothing here starts Ray or imports operator bodies.
"""

from __future__ import annotations

import json
from typing import Iterable, Mapping

import networkx as nx

from rlgraph.graph.batching import batch, gated, op_batching
from rlgraph.graph.build import BuiltGraph, build
from rlgraph.graph.check import check
from rlgraph.graph.config import nest
from rlgraph.graph.dsl import Pipeline
from rlgraph.graph.fuse import fused_leaders
from rlgraph.graph.place import lent_threads, place
from rlgraph.graph.plan import ColumnPlan, EdgePlan, OpPlan, Plan, RefillPlan, ValidationPlan
from rlgraph.graph.prune import prune
from rlgraph.graph.reuse import reused_forwards
from rlgraph.graph.schedule import mode_of, schedule, staleness
from rlgraph.graph.settings import TrainerSettings
from rlgraph.version import __version__

__all__ = ["compile_pipeline", "plan_from_graph"]


def plan_from_graph(g: BuiltGraph, pipeline_ref: str | None = None, reused: Mapping[str, str] | None = None) -> Plan:
    """Run the passes after `check` on an already checked graph and assemble the plan. `reused`:
    the ops `rlgraph.graph.reuse` left out of `g`, and why."""
    stored = prune(g)
    batch_plan = batch(g)
    sched, stage_of, concurrent = schedule(g)
    groups, pools, cluster = place(g)

    consumers: dict[str, list[str]] = {}
    for _, dst, attrs in sorted(g.dag.edges(data=True), key=lambda e: (e[2]["column"], e[1])):
        consumers.setdefault(attrs["column"], []).append(dst)
    columns = {
        col: ColumnPlan(
            name=col, dtype=ct.dtype, shape=list(ct.shape), level=ct.level, kind=ct.kind,
            producer=g.producers[col][0], consumers=consumers.get(col, []), stored=stored[col],
            replicated=ct.replicated,
        )
        for col, ct in sorted(g.column_types.items())
    }
    edges = [
        EdgePlan(src=u, dst=v, column=attrs["column"], kind=attrs["kind"])
        for u, v, attrs in sorted(g.dag.edges(data=True), key=lambda e: (e[0], e[1], e[2]["column"]))
    ]
    ops = []
    for o in g.pipeline.ops:
        connected, drops = g.connected(o), g.drops(o)
        ops.append(OpPlan(
            name=o.name,
            impl=o.impl,
            impl_file=o.impl_file,
            group=o.group or "",
            granularity=o.granularity,
            inputs=[c for c in connected if g.column_types[c].kind != "state"],
            state_inputs=[c for c in o.inputs if o.inputs[c].kind == "state"],
            outputs=list(o.outputs),
            params={k: g.param(o, k) for k in o.params},
            config_key=o.namespace,
            mode=mode_of(o.granularity),
            stage=stage_of.get(o.name, 0),
            concurrent_with=concurrent[o.name],
            skip_before_step=gated(g, o),
            drops=drops,
            lag=staleness(g, o),
            streams=o.streams,
            vectorised=o.vectorised,
            as_rows=[c for c in connected if c in o.as_rows],
            downstream=[x.name for x in g.pipeline.ops if x.name in g.downstream[o.name]] if drops else [],
            runtime_params=list(o.runtime_params),
            batching=op_batching(g, o, batch_plan),
            cost=o.cost,
            doc=o.doc,
        ))
    refill = _refill(g, columns)
    fused = fused_leaders(ops, columns, g.pipeline.source.all_columns(), {gp.name: gp.pool for gp in groups},
                          refill.round_ops if refill else (), TrainerSettings.of(g.config).fuse_ops, batch_plan.n)
    ops = [o.model_copy(update={"fused_into": fused[o.name]}) if o.name in fused else o for o in ops]
    waits = {o.name: set().union(*({r, *nx.descendants(g.dag, r)} for r in
                                   {x.name for x in ops if set(x.state_inputs) & set(o.outputs)}))
             for o in ops}
    lent = lent_threads(ops, groups, pools, TrainerSettings.of(g.config).max_staleness, cluster.num_nodes,
                        fixed={gr.name for gr in g.groups if gr.torch_threads}, waits=waits)
    ops = [o.model_copy(update={"torch_threads": lent[o.name]}) if o.name in lent else o for o in ops]
    return Plan(
        rlgraph_version=__version__,
        pipeline=g.pipeline.name,
        pipeline_ref=pipeline_ref,
        prepare=g.pipeline.prepare,
        prepare_file=g.pipeline.prepare_file,
        source=g.pipeline.source.name,
        source_impl=g.pipeline.source.impl,
        source_impl_file=g.pipeline.source.impl_file,
        source_columns=sorted(g.pipeline.source.all_columns()),
        config=nest(g.config),
        overrides={k: v if isinstance(v, str) else json.dumps(v) for k, v in g.overrides.items()},
        columns=columns,
        ops=ops,
        edges=edges,
        groups=groups,
        pools=pools,
        batch=batch_plan,
        schedule=sched,
        cluster=cluster,
        summaries=dict(g.pipeline.summaries),
        validation=_validation(g),
        refill=refill,
        reused=dict(reused or {}),
    )


def _refill(g: BuiltGraph, columns: Mapping[str, ColumnPlan]) -> RefillPlan | None:
    """Dynamic sampling: the rounds' ops (the refilling filter and everything upstream) and the
    columns the kept rows carry into the training batch."""
    spec = next((o for o in g.pipeline.ops if o.refill), None)
    if spec is None:
        return None
    rounds = g.upstream[spec.name] | {spec.name}
    round_ops = [o.name for o in g.pipeline.ops if o.name in rounds]
    made = set(g.pipeline.source.all_columns()) | {c for o in g.pipeline.ops if o.name in rounds for c in o.outputs}
    carried = [c for c, col in columns.items()
               if c in made and col.stored and col.level == "sample" and col.kind == "data"
               and any(r not in rounds for r in col.consumers)]
    return RefillPlan(op=spec.name, round_ops=round_ops, carried=carried,
                      max_rounds=int(g.param(spec, "max_rounds")), on_exhaust=g.param(spec, "on_exhaust"))


def _validation(g: BuiltGraph) -> ValidationPlan:
    """The ops validation runs: the producers of the validation columns and everything upstream."""
    producers = {g.producers[c][0] for c in g.pipeline.validation}
    needed = set()
    for op in producers - {g.source}:
        needed |= {op} | g.upstream[op]
    return ValidationPlan(columns=list(g.pipeline.validation),
                          ops=[o.name for o in g.pipeline.ops if o.name in needed])

def compile_pipeline(
    pipeline: Pipeline,
    overrides: Iterable[str] | Mapping[str, str] = (),
    pipeline_ref: str | None = None,
) -> Plan:
    """Compile `pipeline` with ``key=value`` overrides into a `Plan`.

    Raises `PipelineError` listing every problem found, or `ConfigError` for a malformed
    override (one without ``=``).
    """
    g = check(build(pipeline, overrides))
    reused = reused_forwards(g)
    if reused:
        g = check(build(pipeline, overrides, leave_out=reused))
    return plan_from_graph(g, pipeline_ref, reused)
