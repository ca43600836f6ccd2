"""The compiled plan: a frozen, versioned, JSON-serialisable model of everything `rlgraph run` needs.

A plan holds no code and no pickles: operator bodies are referenced by import path
(``module:qualname``, plus the source file for pipelines loaded from a path), so loading a plan
never executes anything. Loading validates the file against this schema and its format version.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlgraph.errors import PlanError

__all__ = [
    "PLAN_FORMAT",
    "PLAN_VERSION",
    "ColumnPlan",
    "EdgePlan",
    "OpPlan",
    "GroupPlan",
    "BundlePlan",
    "PoolPlan",
    "PaddingTerm",
    "OpBatching",
    "BatchPlan",
    "SchedulePlan",
    "ClusterPlan",
    "ValidationPlan",
    "Plan",
    "load_plan",
]

PLAN_FORMAT = "rlgraph.plan"
PLAN_VERSION = 2


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ColumnPlan(_Frozen):
    """A column of the step table."""

    name: str = Field(description="column name")
    dtype: str = Field(description="element dtype")
    shape: list[int | str] = Field(description="per-sample shape; names are ragged sizes")
    level: Literal["sample", "batch"] = Field(description="one value per sample or per batch")
    kind: Literal["data", "state", "metric"] = Field(description="data, cross-step state or metric")
    producer: str = Field(description="the op (or the data source) that writes it")
    consumers: list[str] = Field(description="ops that read it")
    stored: bool = Field(description="kept in the data plane (false: pruned, nobody reads it)")
    replicated: bool = Field(False, description="state written alike by every rank of its producer's group: "
                             "the group's ranks are not given rank 0's copy")


class EdgePlan(_Frozen):
    """One edge per column from its producer to a consumer."""

    src: str
    dst: str
    column: str
    kind: Literal["data", "state"] = Field(description="state edges cross steps and are not cycles")


class OpBatching(_Frozen):
    """How an op splits the padded batch over its group's ranks."""

    dp: int = Field(description="data-parallel ranks of the op's worker group")
    samples_per_rank: int = Field(description="padded samples each rank handles per pass (the largest share)")
    mini_batch_samples: int | None = Field(None, description="samples per mini-batch (mini_batch_size * n)")
    mini_batches: int | None = Field(None, description="mini-batches per epoch over the padded batch")
    epochs: int = Field(1, description="passes over the batch")
    rank_mini_batch: list[int] | None = Field(
        None, description="[smallest, largest] share of one mini-batch on a rank (equal when dp divides it)"
    )
    micro_batch_size: int | None = Field(
        None, description="per call on a rank: samples, or groups (prompts) for per-group ops; with per_rank, the "
        "body's own batches inside its call"
    )
    per_rank: bool = Field(False, description="one call per rank holding its whole share of the step")
    micro_batches: int | None = Field(
        None, description="micro-batches per rank per mini-batch (per pass for forward-only ops)"
    )
    updates_per_step: int | None = Field(None, description="optimizer steps per training step")


class OpPlan(_Frozen):
    """An operator, resolved: its columns, group, params, schedule and batching."""

    name: str
    impl: str | None = Field(description="'module:qualname' of the body")
    impl_file: str | None = Field(None, description="source file of the body's module, if not importable")
    group: str
    granularity: Literal["sample", "group", "batch"]
    inputs: list[str] = Field(description="connected data input columns")
    state_inputs: list[str] = Field(description="cross-step state columns read (from the previous step)")
    outputs: list[str]
    params: dict[str, Any] = Field(description="resolved config params of the op")
    config_key: str = Field(description="namespace of its params in the config")
    mode: Literal["stream", "group", "barrier"] = Field(
        description="stream: starts on micro-batches of ready rows; group: on complete groups; "
        "barrier: waits for the whole padded batch"
    )
    stage: int = Field(description="topological generation (0 runs first)")
    concurrent_with: list[str] = Field(description="ops it may overlap with (no dependency, different group)")
    skip_before_step: int = Field(0, description="the op is skipped while step < this")
    drops: bool = Field(False, description="the body may drop rows from training (ctx.drop)")
    lag: int = Field(0, description="steps by which its state inputs may trail: at step t it reads the state "
                     "written at step t-1-lag (trainer.max_staleness for a stale_ok op, else 0)")
    streams: bool = Field(False, description="the body yields its rows in parts as they finish; ops downstream "
                          "start on each part")
    vectorised: bool = Field(False, description="the body runs once on all the chunks of a call (each computed from "
                             "its own rows), not once per chunk; ctx.chunks gives their sizes")
    as_rows: list[str] = Field(default_factory=list, description="inputs the body is given as their rows "
                               "(rlgraph.rows.Rows, one tensor a row), not padded into one tensor")
    downstream: list[str] = Field(
        description="for an op that drops rows: the ops that read its outputs, directly or through other ops (its "
        "drops are padding for them); empty otherwise")
    fused_into: str | None = Field(None, description="the leader of the fused chain this op follows: it runs "
                                   "inside that op's calls, right after it on the same rows (rlgraph.graph.fuse)")
    runtime_params: list[str] = Field(
        description="params the runtime consumes: batching sizes (the body finds them in ctx.batching), the group "
        "size (ctx.group_size) and setup-time params (read by the worker class's setup); the body receives them "
        "as keywords only if it names them")
    batching: OpBatching
    torch_threads: int = Field(0, description="torch threads its workers compute with while it runs (0: their "
                               "group's); more than the group's when it runs alone on its node and may use the "
                               "CPUs of the groups idle meanwhile (pass 6, `rlgraph.graph.place.lent_threads`)")
    cost: float = 1.0
    doc: str = ""


class GroupPlan(_Frozen):
    """A worker group: dp identical actors, colocated ops."""

    name: str
    dp: int
    num_cpus: float
    num_gpus: float
    pool: str
    ops: list[str]
    torch_threads: int = Field(1, description="torch threads of each worker (groups.<name>.torch_threads, else the "
                               "bundle's whole CPUs); the worker caps it at the cores its process may use")


class BundlePlan(_Frozen):
    """One worker slot of a pool, placed on a node."""

    index: int
    node: int
    num_cpus: float
    num_gpus: float


class PoolPlan(_Frozen):
    """A resource pool: bundles shared (time-sliced) by the groups placed on it."""

    name: str
    groups: list[str]
    placement: Literal["pack", "spread", "strict_spread"] = Field(
        description="pack the bundles onto few nodes, spread them round-robin over the nodes, or strict_spread: "
                    "one node each")
    bundles: list[BundlePlan]


class PaddingTerm(_Frozen):
    """One term of the padding multiple and where it comes from."""

    source: str
    value: int
    gated_by_warmup: bool = False


class BatchPlan(_Frozen):
    """Batch sizes and padding (BRIEF section 2)."""

    batch_size: int = Field(description="prompts per step")
    n: int = Field(description="samples per prompt")
    global_batch: int = Field(description="samples per step before padding (batch_size * n)")
    terms: list[PaddingTerm]
    multiple: int = Field(description="padding multiple once every op runs (step >= critic_warmup)")
    padded_batch: int = Field(description="samples per step after padding")
    pad_rows: int
    multiple_warmup: int = Field(description="padding multiple while step < critic_warmup")
    padded_batch_warmup: int
    pad_rows_warmup: int
    critic_warmup: int


class SchedulePlan(_Frozen):
    """Where stages may overlap."""

    stages: list[list[str]] = Field(description="topological generations of ops")
    streaming: list[str]
    group_wise: list[str]
    barriers: list[str]
    critical_path: list[str] = Field(description="the longest chain by cost, source first")
    critical_path_cost: float


class ClusterPlan(_Frozen):
    num_nodes: int
    cpus_per_node: float
    gpus_per_node: float
    dataplane_cpus: float = Field(description="CPUs the data plane reserves (TransferQueue controller and units)")
    required_cpus: float
    required_gpus: float


class ValidationPlan(_Frozen):
    """What validation runs: the ops that produce the pipeline's validation columns."""

    columns: list[str] = Field(description="columns validation produces (the pipeline's `validation`)")
    ops: list[str] = Field(description="the ops needed to produce them, in plan order")


class RefillPlan(_Frozen):
    """Dynamic sampling: each step runs rounds of the ops up to a group filter (fresh prompts each
    round) until the groups it kept fill the batch, then trains on those groups only."""

    op: str = Field(description="the filter (an op declared refill=True) whose kept groups fill the batch")
    round_ops: list[str] = Field(description="the filter and every op upstream of it, in plan order: run once per "
                                 "round, on the round's own rows")
    carried: list[str] = Field(description="columns the kept rows bring from their round into the training batch "
                               "(written by the source or a round op, read by a later op)")
    max_rounds: int = Field(description="rounds per step at most, the first included (verl's max_num_gen_batches)")
    on_exhaust: Literal["train", "fail"] = Field(
        description="when the rounds run out before the batch is full: train on the kept groups, or fail")


class Plan(_Frozen):
    """A compiled pipeline. Write with `save`, read with `load_plan`."""

    format: Literal["rlgraph.plan"] = PLAN_FORMAT
    version: int = PLAN_VERSION
    rlgraph_version: str
    pipeline: str = Field(description="pipeline name")
    pipeline_ref: str | None = Field(None, description="how to load the pipeline again (file or module:attr)")
    prepare: str | None = Field(None, description="'module:function' that `rlgraph run` calls first")
    prepare_file: str | None = Field(None, description="source file of the prepare function's module")
    source: str = Field("data", description="name of the data source node (and of its config namespace)")
    source_impl: str | None = Field(None, description="'module:qualname' of the data source")
    source_impl_file: str | None = Field(None, description="source file of the data source's module")
    source_columns: list[str] = Field(description="columns the data source writes (system columns included)")
    config: dict[str, Any] = Field(description="the resolved config, nested")
    overrides: dict[str, str] = Field(description="the key=value overrides given at compile time")
    columns: dict[str, ColumnPlan]
    ops: list[OpPlan]
    edges: list[EdgePlan]
    groups: list[GroupPlan]
    pools: list[PoolPlan]
    batch: BatchPlan
    schedule: SchedulePlan
    cluster: ClusterPlan
    summaries: dict[str, str] = Field(
        description="per-sample column -> metric name: the mean/max/min over real rows of each row's sum; the "
        "first is the headline metric")
    validation: ValidationPlan
    refill: RefillPlan | None = Field(None, description="dynamic sampling's rounds, if an op refills the batch")
    reused: dict[str, str] = Field(default_factory=dict, description="ops left out because another op's own forward "
                                   "gives their result (rlgraph.graph.reuse): op -> why")

    def op(self, name: str) -> OpPlan:
        for o in self.ops:
            if o.name == name:
                return o
        raise KeyError(f"plan has no op {name!r}")

    def state_ops(self) -> set[str]:
        """The ops that read or write a state column: their groups keep state beyond a call."""
        return {o.name for o in self.ops
                if o.state_inputs or any(self.columns[c].kind == "state" for c in o.outputs)}

    def batches_calls(self, name: str) -> bool:
        """Whether the runtime sends ready chunks of op `name` together, one call per rank
        (`rlgraph.runtime.scheduler`): not a barrier, a per-rank or a streaming op, and either cheap
        (``cost`` below 1) or read by nothing on another pool, so batching delays no other pool."""
        o = self.op(name)
        if o.mode == "barrier" or o.batching.per_rank or o.streams or o.fused_into:
            return False
        pool = {g.name: g.pool for g in self.groups}
        readers = {r for c in o.outputs for r in self.columns[c].consumers}
        return o.cost < 1.0 or all(pool[self.op(r).group] == pool[o.group] for r in readers)

    def followers(self, name: str) -> list[str]:
        """The ops fused into `name`'s calls, in the order they run (`OpPlan.fused_into`)."""
        return [o.name for o in sorted(self.ops, key=lambda o: o.stage) if o.fused_into == name]

    def group(self, name: str) -> GroupPlan:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"plan has no worker group {name!r}")

    def to_json(self) -> str:
        return self.model_dump_json(indent=2) + "\n"

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())
        return path


def _what_it_is(raw: Any) -> str:
    """A few words on what a JSON document that is not a plan looks like, for the error message."""
    if not isinstance(raw, dict):
        return f"it holds a JSON {type(raw).__name__}, not an object"
    fmt = raw.get("format")
    if isinstance(fmt, str) and fmt.startswith("rlgraph.checkpoint"):
        return "it is a checkpoint's meta.json"
    if fmt is not None:
        return f"its format is {fmt!r}"
    keys = sorted(str(k) for k in raw)
    shown = ", ".join(repr(k) for k in keys[:6]) + (", ..." if len(keys) > 6 else "")
    return f"it has no \"format\" key; its keys are {shown}" if keys else "it is an empty JSON object"


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file; raises `PlanError` saying what is wrong and what to do.

    Only JSON is parsed (no pickles, no code): the file must be UTF-8 JSON with
    ``"format": "rlgraph.plan"`` and ``"version"`` equal to `PLAN_VERSION`, and match the schema.
    """
    path = Path(path)
    recompile = "recompile it with `rlgraph compile PIPELINE -o DIR`"
    try:
        data = path.read_bytes()
    except OSError as e:
        raise PlanError(f"cannot read plan file {str(path)!r}: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PlanError(
            f"{str(path)!r} is not a text file (byte {e.start} is not UTF-8), so not a plan.json; "
            f"pass the plan.json written by `rlgraph compile`, or {recompile}"
        ) from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        what = " (the file is empty)" if not text.strip() else ""
        raise PlanError(
            f"{str(path)!r} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}){what}; "
            f"{recompile}"
        ) from None
    except RecursionError:
        raise PlanError(f"{str(path)!r} nests JSON too deeply to be a plan; {recompile}") from None
    if not isinstance(raw, dict) or raw.get("format") != PLAN_FORMAT:
        raise PlanError(
            f"{str(path)!r} is not an rlgraph plan (no \"format\": \"{PLAN_FORMAT}\"); "
            f"pass a plan.json written by `rlgraph compile` ({_what_it_is(raw)})"
        )
    version = raw.get("version")
    if version != PLAN_VERSION or isinstance(version, bool):
        written_by = raw.get("rlgraph_version")
        by = f" (the file was written by rlgraph {written_by})" if isinstance(written_by, str) else ""
        what = "has no plan format version" if version is None else f"is plan format version {version!r}"
        raise PlanError(
            f"{str(path)!r} {what}, but this rlgraph reads version {PLAN_VERSION}; recompile the pipeline "
            f"with this rlgraph (`rlgraph compile PIPELINE -o DIR`){by}"
        )
    try:
        return Plan.model_validate(raw)
    except ValidationError as e:
        details = "; ".join(
            f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()[:8]
        )
        more = f" (and {e.error_count() - 8} more)" if e.error_count() > 8 else ""
        raise PlanError(
            f"{str(path)!r} is a malformed plan: {details}{more}; recompile it with `rlgraph compile`"
        ) from None
