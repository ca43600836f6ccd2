"""Print a compiled plan as tables: ops, columns, worker groups, padding, schedule, config.

Everything shown is read from the `Plan` (or, for `config_schema_table`, from the pipeline's
config schema, whose params are made from the settings models of `rlgraph.graph.settings` and
`rlgraph.ops.settings`), so ``rlgraph describe`` prints exactly what ``rlgraph run`` would use. Cells are
`rich.text.Text`, never markup, so values such as ``[response_len]`` print as they are.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Mapping

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from rlgraph.graph.config import Param, flatten
from rlgraph.graph.plan import OpBatching, OpPlan, Plan
from rlgraph.graph.settings import TrainerSettings

__all__ = [
    "describe",
    "sections",
    "ops_table",
    "columns_table",
    "groups_table",
    "padding_section",
    "schedule_section",
    "config_table",
    "config_schema_table",
    "format_value",
]


def format_value(value: Any) -> str:
    """A config value as it would be written on the command line (``true``, ``null``, ``1e-06``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    return repr(value)


def _table(title: str, *columns: str) -> Table:
    t = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD,
              header_style="bold", pad_edge=False)
    for c in columns:
        t.add_column(c, overflow="fold", min_width=len(c))
    return t


def _row(t: Table, *cells: Any) -> None:
    t.add_row(*(Text(str(c)) for c in cells))


def _batching(b: OpBatching, granularity: str = "sample") -> str:
    """How an op splits the padded batch: mini-batches, then each rank's share in micro-batches."""
    unit = " groups" if granularity == "group" else ""
    plural = "" if b.micro_batches == 1 else "es"
    micro = (f" in {b.micro_batches} micro-batch{plural} of <={b.micro_batch_size}{unit}"
             if b.micro_batch_size else "")
    if b.per_rank:  # one call per rank; the body batches inside it
        inside = (f", inside it batches of <={b.micro_batch_size}{unit}" if b.micro_batch_size
                  else ", inside it batches sized by a token budget" if b.micro_batch_size == 0 else "")
        return f"one call per rank of {b.samples_per_rank}{inside}"
    if b.mini_batch_samples is None:
        return f"per rank {b.samples_per_rank}{micro}"
    lo, hi = b.rank_mini_batch or [b.mini_batch_samples, b.mini_batch_samples]
    share = f"{lo}" if lo == hi else f"{lo}-{hi}"
    epochs = f"{b.epochs} epoch{'s' if b.epochs != 1 else ''}"
    minis = f"{b.mini_batches} mini-batch{'es' if b.mini_batches != 1 else ''}"
    updates = f"{b.updates_per_step} update{'s' if b.updates_per_step != 1 else ''}"
    return f"{minis} of {b.mini_batch_samples} x {epochs} = {updates}; per rank {share}{micro}"


def _mode(o: OpPlan) -> str:
    return o.mode + (f", from step {o.skip_before_step}" if o.skip_before_step else "")


def _inputs(o: OpPlan) -> str:
    stale = f", up to {o.lag} step(s) stale" if o.lag else ""
    return ", ".join([*o.inputs, *(f"{c} (state{stale})" for c in o.state_inputs)])


def ops_table(plan: Plan) -> Table:
    """One row per op, in declaration order."""
    t = _table("ops", "op", "group", "dp", "granularity", "mode", "stage", "inputs", "outputs",
               "concurrent with", "batching")
    for o in plan.ops:
        _row(t, o.name, o.group, o.batching.dp, o.granularity, _mode(o), o.stage, _inputs(o),
             ", ".join(o.outputs), ", ".join(o.concurrent_with) or "-",
             _batching(o.batching, o.granularity) + ("; streams its rows in parts" if o.streams else "")
             + ("; one body call for all the chunks of a call" if o.vectorised else "")
             + (f"; fused: runs inside {o.fused_into}'s calls, on its rows" if o.fused_into else ""))
    return t


def _shape(shape: Iterable[int | str]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def columns_table(plan: Plan) -> Table:
    """One row per column, sorted by name; pruned columns are produced but never stored."""
    t = _table("columns", "column", "dtype", "shape", "level", "kind", "producer", "consumers", "stored")
    for c in plan.columns.values():
        _row(t, c.name, c.dtype, _shape(c.shape), c.level, c.kind, c.producer,
             ", ".join(c.consumers) or "-", "yes" if c.stored else "no (pruned)")
    return t


def _nodes(nodes: list[int]) -> str:
    return ", ".join(f"node {n} x{k}" for n, k in sorted(Counter(nodes).items())) or "-"


def groups_table(plan: Plan) -> Table:
    """Worker groups with their pool and where its workers land; groups sharing a pool are colocated."""
    bundles = {p.name: p.bundles for p in plan.pools}
    sharing = {p.name: p.groups for p in plan.pools}
    placement = {p.name: p.placement for p in plan.pools}
    t = _table("worker groups", "group", "dp", "cpus/worker", "gpus/worker", "torch threads", "pool", "placement",
               "colocated with", "nodes", "ops")
    for g in plan.groups:
        mine = [b.node for b in bundles.get(g.pool, [])[: g.dp]]
        others = [x for x in sharing.get(g.pool, []) if x != g.name]
        # an op that runs alone on its node computes on the idle groups' CPUs too (`place.lent_threads`)
        lent = [f"{o.name}: {o.torch_threads}" for o in plan.ops if o.group == g.name and o.torch_threads]
        threads = f"{g.torch_threads}" + (f" ({', '.join(lent)}, with idle groups' CPUs)" if lent else "")
        _row(t, g.name, g.dp, f"{g.num_cpus:g}", f"{g.num_gpus:g}", threads, g.pool, placement.get(g.pool, "pack"),
             ", ".join(others) or "-",
             _nodes(mine), ", ".join(g.ops))
    return t


def _cluster_line(plan: Plan) -> Text:
    c = plan.cluster
    return Text(
        f"cluster: {c.num_nodes} node(s) x {c.cpus_per_node:g} CPU / {c.gpus_per_node:g} GPU; "
        f"required {c.required_cpus:g} CPU (data plane {c.dataplane_cpus:g}) and {c.required_gpus:g} GPU"
    )


PAD_WARN_FRACTION = 0.10


def padding_warning(plan: Plan) -> str | None:
    """A warning when padding adds 10% or more rows: they cost compute and, with mini-batches,
    whole extra optimizer steps. Names the terms so the user can pick sizes that divide."""
    b = plan.batch
    if b.pad_rows < PAD_WARN_FRACTION * b.global_batch or b.pad_rows == 0:
        return None
    big = sorted({t.value for t in b.terms if t.value > 1}, reverse=True)
    return (f"warning: padding adds {b.pad_rows} rows to {b.global_batch} samples "
            f"({100 * b.pad_rows / b.global_batch:.0f}%): the multiple lcm({', '.join(map(str, big))}) = {b.multiple} "
            f"does not divide the batch; choose mini-batch sizes and dp that divide "
            f"{b.batch_size} prompts x n={b.n} (or a batch size that their lcm divides)")


def padding_section(plan: Plan) -> RenderableType:
    """The padding rule applied: each term and its source, the multiple, the padded batch."""
    b = plan.batch
    warmup = b.critic_warmup > 0
    terms = _table("padding terms", "term", "value", "counts")
    for term in b.terms:
        counts = f"from step {b.critic_warmup}" if (warmup and term.gated_by_warmup) else "always"
        _row(terms, term.source, term.value, counts)
    values = ", ".join(str(term.value) for term in b.terms) or "1"
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    _row(summary, "global batch", f"{b.batch_size} prompts x n={b.n} = {b.global_batch} samples")
    _row(summary, "multiple", f"lcm({values}) = {b.multiple}")
    _row(summary, "padded batch", f"{b.padded_batch} samples ({b.pad_rows} pad rows)")
    if warmup and (b.multiple_warmup, b.padded_batch_warmup) != (b.multiple, b.padded_batch):
        _row(summary, "during warm-up",
             f"steps < {b.critic_warmup}: multiple {b.multiple_warmup}, padded batch "
             f"{b.padded_batch_warmup} samples ({b.pad_rows_warmup} pad rows)")
    warning = padding_warning(plan)
    if warning:
        return Group(terms, summary, Text(warning, style="yellow"))
    return Group(terms, summary)


def schedule_section(plan: Plan) -> RenderableType:
    s = plan.schedule
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for i, names in enumerate(s.stages):
        _row(grid, f"stage {i}", ", ".join(names))
    _row(grid, "critical path", f"{' -> '.join(s.critical_path)} (cost {s.critical_path_cost:g})")
    rf = plan.refill
    if rf is not None:
        _row(grid, "dynamic sampling", f"rounds of {', '.join(rf.round_ops)} on fresh prompts until "
             f"{plan.batch.batch_size} groups are kept by {rf.op} (at most {rf.max_rounds}, then {rf.on_exhaust}); "
             f"carried into the batch: {', '.join(rf.carried)}")
    for op, why in plan.reused.items():
        _row(grid, "left out", f"{op}: {why}")
    chains = [(o.name, o.group, plan.followers(o.name)) for o in plan.ops if plan.followers(o.name)]
    _row(grid, "fused chains", "; ".join(
        f"{' -> '.join([lead, *f])} on {group}: one dispatched call per chunk; {', '.join(f)} "
        f"{'runs' if len(f) == 1 else 'run'} right after {lead} on its rows, reading its outputs from the worker's "
        f"memory" for lead, group, f in chains) if chains else "none" + (
        "" if TrainerSettings.of(plan).fuse_ops else " (trainer.fuse_ops=false)"))
    batched = [o.name for o in plan.ops if plan.batches_calls(o.name)]
    vectorised = [o for o in batched if plan.op(o).vectorised]
    _row(grid, "batched calls", (", ".join(batched) + ": ready chunks go out together, one call per rank (one get, "
                                 "one put; the body still runs once per chunk"
                                 + (f", except {', '.join(vectorised)}'s, vectorised: once per call" if vectorised
                                    else "") + ")") if batched else "none")
    return Group(Text("schedule", style="bold"), grid)


def config_table(plan: Plan) -> Table:
    """The resolved config, flat and sorted; keys set by an override are marked."""
    t = _table("config", "key", "value", "set by")
    for key, value in sorted(flatten(plan.config).items()):
        _row(t, key, format_value(value), "override" if key in plan.overrides else "")
    return t


def _doc(p: Param) -> str:
    extra = []
    if p.choices is not None:
        extra.append("one of " + ", ".join(format_value(c) for c in p.choices))
    if p.minimum is not None:
        extra.append(f">= {p.minimum:g}")
    return p.doc + (f" ({'; '.join(extra)})" if extra else "")


def config_schema_table(schema: Mapping[str, Param], config: Mapping[str, Any],
                        overrides: Mapping[str, str] | None = None) -> Table:
    """Every config key of a pipeline: type, default, current value and doc, in schema order."""
    t = _table("config keys", "key", "type", "default", "value", "verl alias", "doc")
    t.columns[0].min_width = max((len(k) for k in schema), default=3)  # a key is never folded: it is what you type
    for key, p in schema.items():
        value = format_value(config.get(key, p.default)) + (" (override)" if key in (overrides or {}) else "")
        _row(t, key, p.type_name, format_value(p.default), value, ", ".join(p.verl) or "-", _doc(p))
    return t


def _header(plan: Plan) -> Text:
    ref = f" ({plan.pipeline_ref})" if plan.pipeline_ref else ""
    overrides = " ".join(f"{k}={v}" for k, v in plan.overrides.items()) or "none"
    return Text(
        f"pipeline {plan.pipeline!r}{ref}, rlgraph {plan.rlgraph_version}\n"
        f"overrides: {overrides}\n"
        f"{len(plan.ops)} ops in {len(plan.schedule.stages)} stages, {len(plan.groups)} worker groups, "
        f"{len(plan.columns)} columns"
    )


def sections(plan: Plan) -> list[RenderableType]:
    """Every section of the description, in print order."""
    return [_header(plan), ops_table(plan), columns_table(plan), groups_table(plan), _cluster_line(plan),
            Text(), padding_section(plan), Text(), schedule_section(plan), Text(), config_table(plan)]


def describe(plan: Plan, console: Console | None = None) -> None:
    """Print every section of the plan to `console` (a new one by default)."""
    console = console or Console()
    for part in sections(plan):
        console.print(part)
