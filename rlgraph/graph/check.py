"""Pass 2, check: find every problem of a built graph, then raise one `PipelineError` with all.

Each problem has a stable code (tests and docs refer to it), names the op or column, states
both numbers when sizes conflict, and says the fix. The checks:

==========================  ===============================================================
code                        what it catches
==========================  ===============================================================
config-unknown-key          an override or config value for a key nobody declares
config-type                 a config value of the wrong type, or outside its choices
config-namespace            two ops (or an op and a built-in section) share a namespace
op-duplicate                two ops with the same name, or an op named like the data source
op-no-group                 an op that names no worker group
op-unknown-group            an op naming a worker group that is not declared
group-duplicate             two worker groups with the same name
group-unused                a worker group that runs no op (it would hold resources idle)
column-missing              an input column that no op and not the data source produces
column-duplicate-producer   a column produced by two ops (or an op and the data source)
column-type-mismatch        producer and consumer disagree on dtype, shape or kind
column-kind-mismatch        a state column read as this step's data, or data read as state
pool-unknown                a group's pool names no group and is shared with none (a typo)
output-missing              a declared pipeline output that nothing produces
summary-column              a summary that names a column nothing produces, or one that is
                            not a per-sample numeric data column
validation-column           a validation column that no op produces
staleness-unused            trainer.max_staleness > 0 but no op may run ahead (stale_ok and reading state)
staleness-colocated         a stale_ok op shares a group with the op writing its state (one copy, changed in place)
staleness-mixed             a stale_ok op and an op reading the latest state share a group (one copy)
partial-unused              <op>.partial (partial rollout) on without trainer.max_staleness >= 1
op-unused                   an op none of whose outputs is read, kept or a metric
cycle                       a dependency cycle through data columns
granularity                 a per-sample or per-group op reads a column that exists only
                            for the whole batch
batching-granularity        an op with mini-batches that is not whole-batch
group-size-conflict         more than one op defines the group size n
mini-batch-too-large        mini-batch (prompts) larger than the batch
resources                   a worker group needs more CPUs/GPUs than the cluster has
placement                   pools do not fit on the cluster's nodes
op-config                   an op's own validation of its params (e.g. GAE needs values)
==========================  ===============================================================
"""

from __future__ import annotations

import difflib
import inspect
from collections import Counter
from typing import Any

import networkx as nx

from rlgraph.errors import PipelineError, Problem
from rlgraph.graph.build import BuiltGraph
from rlgraph.graph.dsl import LOGGERS, parse_loggers
from rlgraph.graph.settings import TrainerSettings

__all__ = ["check", "find_problems"]


def _close(name: str, options: list[str]) -> str:
    m = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    return f" (did you mean {m[0]!r}?)" if m else ""


def find_problems(g: BuiltGraph) -> list[Problem]:
    """Every problem of the built graph (config problems found while building included)."""
    p = g.pipeline
    problems: list[Problem] = list(g.problems)
    add = problems.append
    src = g.source

    # Ops and groups --------------------------------------------------------------------------
    for name, count in Counter(o.name for o in p.ops).items():
        if count > 1:
            add(Problem("op-duplicate", f"{count} ops are named {name!r}",
                        "give each op a unique name, e.g. spec.with_(name='ref2')", op=name))
    for o in p.ops:
        if o.name == src:
            add(Problem("op-duplicate", f"op {o.name!r} has the same name as the data source",
                        f"rename op {o.name!r} (e.g. spec.with_(name={o.name + '_op'!r}), or name=... in @op)",
                        op=o.name))
    for name, count in Counter(gr.name for gr in p.groups).items():
        if count > 1:
            add(Problem("group-duplicate", f"worker group {name!r} is declared {count} times",
                        "declare each worker group once and refer to it by name from several ops"))
    group_names = [gr.name for gr in p.groups]
    for o in p.ops:
        if o.group is None:
            add(Problem("op-no-group", f"op {o.name!r} has no worker group",
                        f"pass group=... to op {o.name!r} naming one of: {', '.join(group_names) or '(none declared)'}",
                        op=o.name))
        elif o.group not in group_names:
            add(Problem("op-unknown-group", f"op {o.name!r} names worker group {o.group!r}, which is not declared"
                        + _close(o.group, group_names),
                        f"add WorkerGroup({o.group!r}, ...) to the pipeline's groups, or use one of: "
                        f"{', '.join(group_names) or '(none declared)'}", op=o.name))
    if not any(pr.code == "config-type" for pr in problems):
        for pool, members in g.pools.items():  # a pool names a group (colocation) or is shared by several
            if len(members) == 1 and pool != members[0].name and pool not in group_names:
                gr = members[0].name
                add(Problem("pool-unknown", f"worker group {gr!r} names pool {pool!r}, which is no worker group's "
                            f"name and no other group's pool" + _close(pool, group_names),
                            f"to share another group's devices name that group (groups.{gr}.pool=<group>, one of: "
                            f"{', '.join(n for n in group_names if n != gr)}), or leave pool unset for a pool of "
                            f"its own"))
    used = {o.group for o in p.ops}
    for gr in dict.fromkeys(group_names):
        if gr not in used:
            add(Problem("group-unused", f"worker group {gr!r} runs no op but would hold its resources",
                        f"remove worker group {gr!r} or assign an op to it"))

    # Columns ---------------------------------------------------------------------------------
    produced = list(g.producers)
    missing: list[str] = []
    for o in p.ops:
        for col, want in o.inputs.items():
            prods = g.producers.get(col, ())
            if not prods:
                if col in _recomputed_only_once(g, o):
                    add(Problem("column-missing",
                                f"op {o.name!r} reads column {col!r}, which no op produces; {o.name} can take it from "
                                f"its own forward only when it makes one optimizer step per training step, and it "
                                f"makes several (mini-batches x epochs)",
                                f"add the op that outputs {col!r} (stages.old_logprob() for old_log_probs), or make "
                                f"one mini-batch of one epoch per step", op=o.name, column=col))
                    continue
                if col in o.optional_inputs:
                    continue
                missing.append(col)
                kind = "state column" if want.kind == "state" else "column"
                add(Problem("column-missing",
                            f"op {o.name!r} reads {kind} {col!r}, which no op and not the data source produces"
                            + (" (it would read None at every step)" if want.kind == "state" else "")
                            + _close(col, produced),
                            f"add an op that outputs {col!r}, add it to the data source's columns, or rename "
                            f"the input" + (" (or declare it optional)" if want.kind == "state" else ""),
                            op=o.name, column=col))
                continue
            have = g.column_types[col]
            why = have.compatible_with(want)
            if why and why.startswith("kind ") and "metric" not in (have.kind, want.kind):
                if have.kind == "state":  # written as cross-step state, read as this step's data
                    add(Problem("column-kind-mismatch",
                                f"op {o.name!r} reads column {col!r} as this step's data, but {prods[0]!r} writes it "
                                f"as cross-step state (read in the next step)",
                                f"declare the input {col!r} of {o.name!r} as state, `{col}: T.{want.dtype}(...).state()` "
                                f"(the value written in the previous step), or have {prods[0]!r} output it as data",
                                op=o.name, column=col))
                else:
                    add(Problem("column-kind-mismatch",
                                f"op {o.name!r} reads column {col!r} as cross-step state, but {prods[0]!r} writes it "
                                f"as this step's data",
                                f"drop .state() from the input {col!r} of {o.name!r} to read this step's values, or have "
                                f"{prods[0]!r} output it with .state()", op=o.name, column=col))
            elif why:
                add(Problem("column-type-mismatch",
                            f"column {col!r}: {prods[0]!r} writes {have.describe()} but {o.name!r} reads "
                            f"{want.describe()} ({why})",
                            "declare the same dtype and shape on both sides (use '*' for a dimension the "
                            "consumer does not care about)", op=o.name, column=col))
            elif o.granularity in ("sample", "group") and have.level == "batch" and have.kind == "data":
                add(Problem("granularity",
                            f"op {o.name!r} runs per {o.granularity} but reads column {col!r}, which "
                            f"{prods[0]!r} produces once for the whole batch",
                            f"make {o.name!r} granularity='batch', or have {prods[0]!r} emit {col!r} per sample",
                            op=o.name, column=col))
    for col, prods in g.producers.items():
        if len(prods) > 1:
            add(Problem("column-duplicate-producer",
                        f"column {col!r} is produced by {len(prods)} nodes: {', '.join(repr(x) for x in prods)}",
                        "rename one of the outputs (each column has exactly one producer)", column=col))
    for col in p.outputs:
        if col not in g.producers:
            missing.append(col)
            add(Problem("output-missing", f"pipeline output {col!r} is produced by nothing" + _close(col, produced),
                        f"remove {col!r} from outputs= or add an op that produces it", column=col))

    for col, metric in p.summaries.items():
        ct = g.column_types.get(col)
        if ct is None:
            add(Problem("summary-column", f"summaries names column {col!r} (metric {metric!r}), which nothing "
                        f"produces" + _close(col, produced),
                        f"name a column an op produces, or remove {col!r} from summaries=", column=col))
        elif ct.level != "sample" or ct.kind != "data" or ct.dtype in ("str", "json", "opaque"):
            add(Problem("summary-column", f"summaries names column {col!r} (metric {metric!r}), which is "
                        f"{ct.describe()}; a summary sums each row's numbers",
                        "summarise a per-sample numeric data column (e.g. token_level_scores)", column=col))
    for metric, count in Counter(p.summaries.values()).items():
        if count > 1:
            add(Problem("summary-column", f"{count} summaries are named {metric!r}",
                        "give each summarised column its own metric name"))
    for col in p.validation:
        prods = g.producers.get(col, ())
        if not prods or prods[0] == src:
            add(Problem("validation-column", f"validation names column {col!r}, which no op produces"
                        + _close(col, produced),
                        f"name the columns validation should produce (e.g. token_level_scores), or remove "
                        f"{col!r} from validation=", column=col))

    # Ops whose every output goes nowhere ----------------------------------------------------
    consumed = {attrs["column"] for _, _, attrs in g.dag.edges(data=True)}
    for o in p.ops:
        typo = any(difflib.get_close_matches(c, missing, n=1, cutoff=0.6) for c in o.outputs)
        if o.outputs and not typo and not any(c in consumed or c in p.outputs or o.outputs[c].kind == "metric"
                                              for c in o.outputs):
            add(Problem("op-unused",
                        f"op {o.name!r} produces only columns nobody reads ({', '.join(repr(c) for c in o.outputs)})",
                        f"remove op {o.name!r}, list a column in the pipeline's outputs=, or enable its consumer "
                        f"(e.g. a config switch such as algorithm.use_kl_in_reward or actor.use_kl_loss)",
                        op=o.name))

    # Cycles (data edges only: state edges cross steps) -----------------------------------------
    d = g.data_dag
    # the source reads nothing, so a cycle through it only comes from an op named like it
    # (reported above as op-duplicate)
    cycles = [c for c in nx.simple_cycles(d) if src not in c]
    for cyc in sorted(cycles, key=lambda c: (len(c), c))[:5]:
        cols = []
        for a, b in zip(cyc, cyc[1:] + cyc[:1]):
            cols += [k for k, attrs in g.dag.get_edge_data(a, b).items() if attrs["kind"] == "data"][:1]
        path = " -> ".join(repr(x) for x in cyc + cyc[:1])
        add(Problem("cycle", f"dependency cycle {path} (through columns {', '.join(repr(c) for c in cols)})",
                    "break the cycle: an op cannot depend on its own output within a step; if the value "
                    "comes from the previous step, declare the column as state (T....state())",
                    op=cyc[0]))

    # Batching --------------------------------------------------------------------------------
    sizers = [o for o in p.ops if o.group_size_param]
    if len(sizers) > 1:
        add(Problem("group-size-conflict",
                    f"ops {', '.join(repr(o.name) for o in sizers)} each define the group size n",
                    "let exactly one op (the generator) declare group_size_param"))
    batch_size = g.config.get(f"{src}.batch_size")
    for o in p.ops:
        if o.batching and o.batching.mini_batch and o.granularity != "batch":
            add(Problem("batching-granularity",
                        f"op {o.name!r} splits the batch into mini-batches but runs per {o.granularity}",
                        f"declare {o.name!r} with granularity='batch'", op=o.name))
        if o.batching and o.batching.mini_batch and isinstance(batch_size, int):
            mb = g.config.get(f"{o.namespace}.{o.batching.mini_batch}")
            if isinstance(mb, int) and mb > batch_size:
                add(Problem("mini-batch-too-large",
                            f"op {o.name!r}: {o.namespace}.{o.batching.mini_batch}={mb} prompts is larger than "
                            f"{src}.batch_size={batch_size}",
                            f"set {o.namespace}.{o.batching.mini_batch} to at most {batch_size} "
                            f"(or raise {src}.batch_size)", op=o.name))

    # Asynchronous training: who may run ahead, on which weights --------------------------------
    trainer = TrainerSettings.of(g)
    k = trainer.max_staleness
    if k > 0:
        state_reads = {o.name: [c for c, t in o.inputs.items() if t.kind == "state" and c in g.producers]
                       for o in p.ops}
        ahead = [o for o in p.ops if o.stale_ok and state_reads[o.name]]
        if not ahead:
            add(Problem("staleness-unused", f"trainer.max_staleness={k}, but no op may run ahead: none is declared "
                        "stale_ok and reads a state column (the rollout, stages.generate, is)",
                        "set trainer.max_staleness=0, or add the rollout op (stages.generate) reading policy_weights"))
        by_name = {o.name: o for o in p.ops}
        for o in ahead:
            for c in state_reads[o.name]:
                producer = g.producers[c][0]
                if by_name.get(producer) is not None and by_name[producer].group == o.group:
                    add(Problem("staleness-colocated",
                                f"trainer.max_staleness={k}: op {o.name!r} would generate with weights up to {k} "
                                f"step(s) old, but it runs in worker group {o.group!r} with {producer!r}, which "
                                f"changes those weights ({c!r}) in place",
                                f"run {o.name!r} in a worker group of its own, e.g. stages.generate(group='rollout') "
                                f"with WorkerGroup('rollout', ...) (its weights are synced from {producer!r}), or "
                                f"set trainer.max_staleness=0", op=o.name, column=c))
                    continue
                same = [x.name for x in p.ops if x is not o and x.group == o.group and c in state_reads[x.name]
                        and not x.stale_ok]
                if same:
                    add(Problem("staleness-mixed",
                                f"trainer.max_staleness={k}: ops {o.name!r} and {same[0]!r} share worker group "
                                f"{o.group!r} and read {c!r}, but {o.name!r} may read it {k} step(s) old and "
                                f"{same[0]!r} must read the latest; a group holds one copy",
                                f"give {o.name!r} a worker group of its own", op=o.name, column=c))

    for o in p.ops:  # partial rollout: newer weights mid-call exist only while the update runs alongside
        if o.stale_ok and "partial" in o.params and g.config.get(f"{o.namespace}.partial") is True and k == 0:
            add(Problem("partial-unused", f"{o.namespace}.partial=true, but trainer.max_staleness={k}: op {o.name!r} "
                        "then always has the newest weights, so none can arrive while it runs",
                        f"set trainer.max_staleness=1 (with {o.name!r} in a worker group of its own), or "
                        f"{o.namespace}.partial=false", op=o.name))

    # Op-specific validation ------------------------------------------------------------------
    for o in p.ops:
        if o.validate is None:
            continue
        params = {k: g.config.get(f"{o.namespace}.{k}") for k in o.params}
        connected = frozenset(g.connected(o))
        # validate(params, connected) sees its own op; validate(params, connected, config) the whole config
        takes_config = len(inspect.signature(o.validate).parameters) >= 3
        for prob in (o.validate(params, connected, g.config) if takes_config else o.validate(params, connected)):
            add(prob if prob.op else Problem(prob.code, f"op {o.name!r}: {prob.message}", prob.fix, op=o.name,
                                             column=prob.column))

    problems += _refill_problems(g)

    try:
        parse_loggers(trainer.logger)
    except ValueError as e:
        add(Problem("config-type", f"trainer.logger={trainer.logger}: {e}",
                    f"write trainer.logger=[{','.join(LOGGERS)}] or some of them, e.g. [console,wandb]"))

    # Resources -------------------------------------------------------------------------------
    if not any(x.code == "config-type" for x in problems):
        from rlgraph.graph.place import resource_problems

        problems += resource_problems(g)
    return problems


def _refill_problems(g: BuiltGraph) -> list[Problem]:
    """Dynamic sampling's refill (an op declared ``refill=True``): one such op, a group filter, whose
    rounds (it and every op upstream) write no state, in an on-policy run."""
    refill = [o for o in g.pipeline.ops if o.refill]
    out: list[Problem] = []
    if len(refill) > 1:
        out.append(Problem("refill", f"ops {[o.name for o in refill]} all refill the batch; a step has one refill",
                           "keep refill=True on one filter (stages.filter_groups), drop it from the others"))
    for o in refill:
        missing = [k for k in ("max_rounds", "on_exhaust") if k not in o.params]
        if missing:
            out.append(Problem("refill", f"op {o.name!r} refills the batch but has no params {missing}",
                               "declare max_rounds (int) and on_exhaust ('train' or 'fail'), as "
                               "stages.filter_groups does", op=o.name))
        if o.granularity != "group" or not o.drops:
            out.append(Problem("refill", f"op {o.name!r} refills the batch but is not a group filter "
                               f"(granularity {o.granularity!r}, drops={o.drops})",
                               "declare it with granularity='group' and drops=True", op=o.name))
        staleness = TrainerSettings.of(g).max_staleness
        if staleness > 0:
            out.append(Problem("refill", f"op {o.name!r} refills the batch (dynamic sampling), which runs each step's "
                               f"generation rounds before its training; trainer.max_staleness={staleness} would run "
                               f"the rollout ahead of them", "set trainer.max_staleness=0 for dynamic sampling, or "
                               f"drop the filter", op=o.name))
        rounds = g.upstream.get(o.name, frozenset()) | {o.name}
        for r in g.pipeline.ops:
            if r.name in rounds:
                continue
            for c in r.inputs:
                t, made = g.column_types.get(c), g.producers.get(c, [None])[0]
                if t is not None and made in rounds and t.level == "batch" and t.kind == "data":
                    out.append(Problem("refill", f"op {r.name!r} reads batch-level column {c!r}, which {made!r} "
                                       f"writes once per refill round of {o.name!r}: which round's value it "
                                       f"would see is not defined", f"make {c!r} a per-sample column, or compute "
                                       f"it after {o.name!r}", op=r.name, column=c))
        for r in g.pipeline.ops:
            if r.name in rounds and any(t.kind == "state" for t in r.outputs.values()):
                out.append(Problem("refill", f"op {r.name!r} writes state but runs in every round of {o.name!r} "
                                   f"(it is upstream of the filter)", "move the filter before the ops that "
                                   "update state (the advantage and the update read its output)", op=r.name))
    return out


def check(g: BuiltGraph) -> BuiltGraph:
    """Return `g` unchanged if it has no problems, else raise `PipelineError` listing all of them."""
    problems = find_problems(g)
    if problems:
        raise PipelineError(problems, g.pipeline.name)
    return g


def _recomputed_only_once(g: BuiltGraph, o: Any) -> set[str]:
    """Inputs `o` could take from its own forward (``OpSpec.recomputes``) but may not: it makes more
    than one optimizer step per training step, so the first forward's values go stale."""
    if o.recomputes is None or not (o.batching and o.batching.mini_batch):
        return set()
    batch_size = g.config.get(f"{g.source}.batch_size")
    mb = g.config.get(f"{o.namespace}.{o.batching.mini_batch}")
    epochs = g.config.get(f"{o.namespace}.{o.batching.epochs}", 1) if o.batching.epochs else 1
    if not all(isinstance(v, int) and v > 0 for v in (batch_size, mb, epochs)) or (batch_size // mb) * epochs == 1:
        return set()
    return set(o.recomputes({k: g.config.get(f"{o.namespace}.{k}", p.default) for k, p in o.params.items()}))
