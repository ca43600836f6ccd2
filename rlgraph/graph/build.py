"""Pass 1, build: resolve the config and turn a `Pipeline` into a networkx DAG.

One node per op plus one for the data source; one edge per column from its producer to each
consumer. Edges of state columns (policy weights from update back to generate) are kept with
``kind="state"``: they cross from step t to step t+1, so the cycle check ignores them.
Building never raises on a bad pipeline: it records what it sees (several producers, missing
producers) and the check pass turns that into problems.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Iterable, Mapping

import networkx as nx

from rlgraph.errors import Problem
from rlgraph.graph.columns import ColumnType
from rlgraph.graph.config import Param, flatten, parse_overrides, resolve_config
from rlgraph.graph.dsl import DATAPLANE_PARAMS, TRAINER_PARAMS, OpSpec, Pipeline
from rlgraph.graph.packing import Packing, Slot, dataplane_actors, pack, pool_placement
from rlgraph.graph.settings import ClusterSettings, DataplaneSettings
from rlgraph.graph.verl import translate_verl_keys

__all__ = ["BuiltGraph", "ResolvedGroup", "config_schema", "build"]


@dataclass(frozen=True)
class ResolvedGroup:
    """A worker group with its config applied (``groups.<name>.*``)."""

    name: str
    dp: int
    num_cpus: float
    num_gpus: float
    pool: str
    placement: str = "pack"
    torch_threads: int = 0  # 0: the bundle's whole CPUs


@dataclass(frozen=True)
class BuiltGraph:
    """The output of `build`: the pipeline, its resolved config and its graph."""

    pipeline: Pipeline
    config: Mapping[str, Any]  # flat, dotted keys, every schema key present
    overrides: Mapping[str, str]
    schema: Mapping[str, Param]
    dag: nx.MultiDiGraph  # nodes: source name and op names; edges keyed by column
    producers: Mapping[str, tuple[str, ...]]  # column -> every node that outputs it
    unused_inputs: Mapping[str, frozenset[str]]  # op -> optional inputs its config does not use
    column_types: Mapping[str, ColumnType]  # column -> type declared by its (first) producer
    problems: tuple[Problem, ...] = field(default=())  # found while resolving config

    @property
    def source(self) -> str:
        return self.pipeline.source.name

    def spec(self, name: str) -> OpSpec:
        return self.dag.nodes[name]["spec"]

    def param(self, spec: OpSpec, key: str) -> Any:
        return self.config[f"{spec.namespace}.{key}"]

    def drops(self, spec: OpSpec) -> bool:
        """Whether the op may drop rows under this config (`OpSpec.drops`, narrowed by its ``drops_if``)."""
        return spec.drops and (spec.drops_if is None or bool(spec.drops_if({k: self.param(spec, k) for k in spec.params})))

    def connected(self, spec: OpSpec) -> list[str]:
        """The op's inputs that are edges of the graph: produced, and used under its config."""
        return [c for c in spec.inputs if c in self.producers and c not in self.unused_inputs.get(spec.name, ())]

    # Facts every later pass needs, computed once per graph (cached on first use).
    @cached_property
    def groups(self) -> tuple[ResolvedGroup, ...]:
        """The worker groups with their ``groups.<name>.*`` config, first declaration of a name only."""
        out: dict[str, ResolvedGroup] = {}
        for gr in self.pipeline.groups:
            if gr.name in out:
                continue  # a duplicate: reported by the check pass
            c = {k: self.config[f"groups.{gr.name}.{k}"]
                 for k in ("dp", "num_cpus", "num_gpus", "pool", "placement", "torch_threads")}
            out[gr.name] = ResolvedGroup(gr.name, int(c["dp"]), float(c["num_cpus"]), float(c["num_gpus"]),
                                         str(c["pool"]), str(c["placement"]), int(c["torch_threads"]))
        return tuple(out.values())

    @cached_property
    def pools(self) -> dict[str, list[ResolvedGroup]]:
        """Pool name -> the groups placed on it (colocated groups share one pool)."""
        pools: dict[str, list[ResolvedGroup]] = {}
        for gr in self.groups:
            pools.setdefault(gr.pool, []).append(gr)
        return pools

    @cached_property
    def data_dag(self) -> nx.DiGraph:
        """The DAG of data edges only (state edges removed), collapsed to one edge per op pair."""
        d = nx.DiGraph()
        d.add_nodes_from(self.dag.nodes)
        for u, v, attrs in self.dag.edges(data=True):
            if attrs["kind"] == "data":
                d.add_edge(u, v)
        return d

    @cached_property
    def downstream(self) -> dict[str, frozenset[str]]:
        """Op -> every op that reads its outputs, directly or through other ops (data edges)."""
        ops = {o.name for o in self.pipeline.ops}
        return {name: frozenset(nx.descendants(self.data_dag, name) & ops) for name in ops}

    @cached_property
    def upstream(self) -> dict[str, frozenset[str]]:
        """Op -> every op whose outputs it reads, directly or through other ops (data edges)."""
        ops = {o.name for o in self.pipeline.ops}
        return {name: frozenset(nx.ancestors(self.data_dag, name) & ops) for name in ops}

    @cached_property
    def slots(self) -> tuple[Slot, ...]:
        """One slot per bundle of each pool: ``max(dp)`` bundles, each as large as its largest group's worker."""
        out: list[Slot] = []
        for pool, members in self.pools.items():
            cpus, gpus = max(m.num_cpus for m in members), max(m.num_gpus for m in members)
            placement = pool_placement(m.placement for m in members)
            out += [Slot(pool, i, cpus, gpus, placement) for i in range(max(m.dp for m in members))]
        return tuple(out)

    @cached_property
    def packing(self) -> Packing:
        """The slots packed onto the declared cluster's nodes, after the data plane's reservation."""
        n = int(self.config["cluster.num_nodes"])
        nodes = [(float(self.config["cluster.cpus_per_node"]), float(self.config["cluster.gpus_per_node"]))] * n
        return pack(nodes, self.slots, dataplane_actors(self.config))


def config_schema(pipeline: Pipeline) -> tuple[dict[str, Param], list[Problem]]:
    """Every config key of the pipeline with its `Param`, and clashes between namespaces."""
    schema: dict[str, Param] = {}
    owner: dict[str, str] = {}
    problems: list[Problem] = []

    def add(ns: str, params: Mapping[str, Param], who: str) -> None:
        if ns in owner and owner[ns] != who:
            problems.append(
                Problem(
                    "config-namespace",
                    f"{who} and {owner[ns]} both put their params under config namespace {ns!r}",
                    f"give one of them another config_key (e.g. config_key={ns + '_2'!r})",
                    op=who.split("'")[1] if "'" in who else None,
                )
            )
            return
        owner[ns] = who
        for k, p in params.items():
            schema[f"{ns}.{k}"] = p

    add(pipeline.source.name, pipeline.source.params, "the data source")
    add("trainer", TRAINER_PARAMS, "the trainer")
    add("dataplane", DATAPLANE_PARAMS, "the data plane")
    add("cluster", pipeline.cluster.params(), "the cluster")
    seen_groups: set[str] = set()
    for g in pipeline.groups:
        if g.name in seen_groups:
            continue  # reported by the check pass
        seen_groups.add(g.name)
        add(f"groups.{g.name}", g.params(), f"worker group {g.name!r}")
    for spec in pipeline.ops:
        if spec.params:
            add(spec.namespace, spec.params, f"op {spec.name!r}")
    return schema, problems


def build(pipeline: Pipeline, overrides: Iterable[str] | Mapping[str, str] = (),
          leave_out: Iterable[str] = ()) -> BuiltGraph:
    """Resolve config (defaults < pipeline.config < overrides) and build the column graph.
    `leave_out`: ops the graph goes without (`rlgraph.graph.reuse`); their config keys stay valid."""
    if isinstance(overrides, str):  # one "key=value", not a sequence of characters
        overrides = [overrides]
    raw = dict(overrides) if isinstance(overrides, Mapping) else parse_overrides(list(overrides))
    schema, problems = config_schema(pipeline)
    raw, alias_problems = translate_verl_keys(raw, schema)  # verl's key names, with a notice each
    problems += alias_problems
    config, cfg_problems = resolve_config(schema, flatten(pipeline.config), raw)
    problems += cfg_problems
    if DataplaneSettings.of(config).storage_units is None:  # the one place it is resolved: one unit per node
        config["dataplane.storage_units"] = ClusterSettings.of(config).num_nodes
    leave_out = set(leave_out)
    if leave_out:
        pipeline = replace(pipeline, ops=tuple(s for s in pipeline.ops if s.name not in leave_out))

    dag = nx.MultiDiGraph()
    src = pipeline.source.name
    dag.add_node(src, kind="source", source=pipeline.source)
    for spec in pipeline.ops:
        if spec.name in dag:
            continue  # duplicate names: reported by the check pass
        dag.add_node(spec.name, kind="op", spec=spec)

    producers: dict[str, list[str]] = {}
    types: dict[str, ColumnType] = {}
    for col, ctype in pipeline.source.all_columns().items():
        producers.setdefault(col, []).append(src)
        types.setdefault(col, ctype)
    for spec in pipeline.ops:
        for col, ctype in spec.outputs.items():
            producers.setdefault(col, []).append(spec.name)
            types.setdefault(col, ctype)

    unused: dict[str, frozenset[str]] = {}
    for spec in pipeline.ops:
        unused[spec.name] = frozenset()
        if spec.uses is not None:
            params = {k: config.get(f"{spec.namespace}.{k}", p.default) for k, p in spec.params.items()}
            unused[spec.name] = spec.optional_inputs - set(spec.uses(params))
    for spec in pipeline.ops:
        for col in spec.inputs:
            if col in unused[spec.name]:
                continue
            for prod in dict.fromkeys(producers.get(col, ())):
                kind = "state" if types[col].kind == "state" else "data"
                dag.add_edge(prod, spec.name, key=col, column=col, kind=kind)
    return BuiltGraph(
        pipeline=pipeline,
        config=config,
        overrides=raw,
        schema=schema,
        dag=dag,
        producers={k: tuple(v) for k, v in producers.items()},
        unused_inputs=unused,
        column_types=types,
        problems=tuple(problems),
    )

