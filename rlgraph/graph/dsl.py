"""The declaration layer: operators, worker groups, the cluster, the data source, the pipeline.

Everything here is immutable data. Declaring never runs anything: `@op` only attaches an
`OpSpec` to the function (it returns the function unchanged, so it can still be called and
tested directly), and `Pipeline(...)` only records what was declared. Checking happens in the
compiler passes (`rlgraph.graph.check`), which collect every problem at once.

An operator's signature is its declaration, Hamilton-style: positional parameters are input
columns (named like the columns, typed by their annotations), keyword-only parameters are its
config parameters (typed by their annotations, with their defaults), and a parameter called
``ctx`` receives the `OpContext` at run time (rank, step, seed).
"""

from __future__ import annotations

import difflib
import inspect
import sys
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Callable, Iterable, Literal, Mapping

from rlgraph.errors import DeclarationError, Problem
from rlgraph.graph.columns import ColumnType, T
from rlgraph.graph.config import Param
from rlgraph.graph.settings import (PLACEMENTS, ClusterSettings, DataplaneSettings, GroupSettings, SourceSettings,
                                    TrainerSettings, default_of, params_of)

__all__ = [
    "Granularity",
    "Batching",
    "OpSpec",
    "op",
    "op_spec",
    "WorkerGroup",
    "Cluster",
    "DataSource",
    "Pipeline",
    "TRAINER_PARAMS",
    "LOGGERS",
    "parse_loggers",
    "DATAPLANE_PARAMS",
    "SYSTEM_COLUMNS",
]

Granularity = Literal["sample", "group", "batch"]
GRANULARITIES = ("sample", "group", "batch")
_CTX = "ctx"  # reserved parameter name: receives the OpContext

# Columns every data source provides: the group id of a sample (all n samples of a prompt
# share it; padding rows get fresh ones) and the padding tag.
SYSTEM_COLUMNS: Mapping[str, ColumnType] = MappingProxyType(
    {
        "uid": T.int64(doc="group id: the n samples of one prompt share it; each padding row has its own"),
        "is_padding": T.bool(doc="True for rows added to reach the padding multiple"),
    }
)

# the trainer's and the data plane's keys, made from their settings models (`rlgraph.graph.settings`)
TRAINER_PARAMS: Mapping[str, Param] = MappingProxyType(params_of(TrainerSettings))
DATAPLANE_PARAMS: Mapping[str, Param] = MappingProxyType(params_of(DataplaneSettings))

# what trainer.logger may name; jsonl (metrics.jsonl) is written whether named or not
LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")


def parse_loggers(text: str) -> tuple[str, ...]:
    """The loggers a ``trainer.logger`` value names, in order: ``[console,wandb]``, ``console,wandb`` and
    ``["console", "wandb"]`` all give ``("console", "wandb")``. Raises ValueError naming each unknown one."""
    inner = text.strip().removeprefix("[").removesuffix("]")
    names = [part.strip().strip("'\"").strip().lower() for part in inner.split(",")]
    names = list(dict.fromkeys(n for n in names if n))
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        close = {n: difflib.get_close_matches(n, LOGGERS, n=1) for n in unknown}
        said = ", ".join(f"{n!r}" + (f" (did you mean {close[n][0]!r}?)" if close[n] else "")
                         for n in unknown)
        raise ValueError(f"unknown logger{'s' if len(unknown) > 1 else ''} {said}; the loggers are "
                         f"{', '.join(LOGGERS)}")
    return tuple(names)


def _shown(value: Any) -> str:
    """A value as a message shows it: its type and a short repr."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _uncalled_type(value: Any) -> str | None:
    """``T.float32`` (given without its call): the text to call it, else None."""
    if callable(value) and getattr(value, "__qualname__", "").startswith("_TypeFactory."):
        return f"T.{value.__name__}()"
    return None


_PLAIN_TYPES = {str: "T.str()", float: "T.float32()", int: "T.int64()", bool: "T.bool()", dict: "T.json()",
                list: "T.json()"}


def _column_type_problem(where: str, what: str, ctype: Any) -> str:
    """The message for `what` (``output column 'score'``) of `where` typed `ctype`, not a ColumnType."""
    call = _uncalled_type(ctype)
    if call is not None:
        return f"{where}: {what} is typed {call[:-2]} without its call; write {call}"
    if ctype in _PLAIN_TYPES:
        return (f"{where}: {what} is typed with the Python type {ctype.__name__}; column types come from T, e.g. "
                f"{_PLAIN_TYPES[ctype]}")
    return f"{where}: {what} is typed {ctype!r}; give a column type such as T.int64('response_len')"


def _columns_arg(where: str, arg: str, value: Any) -> dict[str, ColumnType]:
    """`value` of argument `arg` (outputs=, inputs=): a dict of column name -> column type."""
    if not isinstance(value, Mapping):
        example = "{'score': T.float32()}"
        listed = ""
        if isinstance(value, (list, tuple, set)) and all(isinstance(v, str) for v in value):
            listed = f" ({', '.join(repr(v) + ': T.float32()' for v in list(value)[:2])}, say)"
        raise DeclarationError(f"{where}: {arg}= must be a dict of column name -> column type, e.g. {arg}={example}; "
                               f"got {_shown(value)}; give each column its type{listed}")
    for col, ctype in value.items():
        if not isinstance(col, str) or not col.isidentifier():
            raise DeclarationError(f"{where}: {arg}= has column name {col!r}; column names are Python identifiers")
        if not isinstance(ctype, ColumnType):
            raise DeclarationError(_column_type_problem(where, f"{arg[:-1]} column {col!r}", ctype))
    return dict(value)


def _names_arg(where: str, arg: str, value: Any) -> tuple[str, ...]:
    """`value` of argument `arg`: names, as a list or tuple of strings (a lone string is one name)."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Mapping) or not isinstance(value, Iterable):
        raise DeclarationError(f"{where}: {arg}= must be a list of names, e.g. {arg}=['name']; got {_shown(value)}")
    names = tuple(value)
    for v in names:
        if not isinstance(v, str):
            raise DeclarationError(f"{where}: {arg}= must be a list of names (strings); it holds {_shown(v)}")
    return names


def _check_setting(where: str, arg: str, value: Any, param: Param, key: str) -> None:
    """A declaration's argument checked against its config key's `param` (type, choices, minimum)."""
    err = param.check(value)
    if err:
        raise DeclarationError(f"{where}: {arg}={value!r}: {err}; {param.fix_for(arg, value)} "
                               f"(it is config key {key})")


def _unknown_names(where: str, arg: str, names: Iterable[str], have: list[str], what: str) -> None:
    """`names` given to `arg` must all be among `have` (the pipeline's ops, groups or outputs)."""
    for n in names:
        if n not in have:
            close = difflib.get_close_matches(n, have, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise DeclarationError(f"{where}: {arg}= names {what} {n!r}, which the pipeline does not have{hint}; "
                                   f"its {what}s are {', '.join(have) or '(none)'}")


@dataclass(frozen=True)
class Batching:
    """How an op splits the batch: names of its params giving the sizes.

    ``mini_batch`` names the param holding the mini-batch size in prompts (multiplied by ``n``
    to get samples); ``micro_batch`` the per-rank micro-batch size in samples (groups, for a
    per-group op); ``epochs`` the number of passes over the batch. By default each call of a
    per-sample or per-group op is one micro-batch. ``per_rank=True`` makes one call per rank
    instead, holding the rank's whole share of the step: the body batches inside it (a rollout
    engine with continuous batching), ``micro_batch`` then sizes the body's own batches, and a
    body that streams (yields its rows in parts) hands each part on as it finishes.
    """

    mini_batch: str | None = None
    micro_batch: str | None = None
    epochs: str | None = None
    per_rank: bool = False


@dataclass(frozen=True)
class OpSpec:
    """An operator's declaration: columns, granularity, worker group, params and batching."""

    name: str
    inputs: Mapping[str, ColumnType]
    outputs: Mapping[str, ColumnType]
    granularity: Granularity = "sample"
    group: str | None = None
    params: Mapping[str, Param] = field(default_factory=dict)
    config_key: str | None = None
    impl: str | None = None  # "module:qualname" of the body, imported only at run time
    impl_file: str | None = None  # source file, when the module is not importable by name
    optional_inputs: frozenset[str] = frozenset()
    batching: Batching | None = None
    group_size_param: str | None = None  # the param holding n (samples per prompt)
    skip_before: str | None = None  # config key: the op runs only once step >= its value
    validate: Callable[[Mapping[str, Any], frozenset[str]], list[Problem]] | None = None
    # which optional inputs the op reads under its params (default: every produced one); an
    # optional input it does not use is not connected, so the op does not wait for it
    uses: Callable[[Mapping[str, Any]], Iterable[str]] | None = None
    cost: float = 1.0  # relative cost hint for the critical path
    doc: str = ""
    drops: bool = False  # the body may drop rows from training (ctx.drop): the plan lists the ops its drops reach
    # with drops: whether the body may drop under the op's params (default: always); one that cannot (reward
    # with on_error=fail) is planned as an op that drops nothing, so it can be fused and its readers need not wait
    drops_if: Callable[[Mapping[str, Any]], bool] | None = None
    streams: bool = False  # the body is a generator that yields its rows in parts as they finish
    # the body computes each chunk (a micro-batch, or a group of a per-group op) on its own rows only, so
    # the runtime calls it once with every chunk of a call instead of once per chunk; ctx.chunks gives
    # the chunks' sizes, and a metric output may be a list with one record per chunk (see `op`)
    vectorised: bool = False
    # ragged 1-D inputs the body is given as their rows (`rlgraph.rows.Rows`: one tensor a row, each its
    # row's length, views into one flat tensor), not right-padded into one tensor: for a body that reads
    # each row as it is (decodes it, scores it), which then pays neither the padding nor a cut back
    as_rows: frozenset[str] = frozenset()
    # the op filters groups and the step refills its batch with more rounds of the ops up to it
    # (dynamic sampling): params ``max_rounds`` and ``on_exhaust`` say how many and what then
    refill: bool = False
    # the op may read its state inputs (weights) up to trainer.max_staleness steps old: the
    # behaviour policy of an asynchronous run (generate), which then runs ahead of the update
    stale_ok: bool = False
    # inputs the op computes from its own forward pass when it makes one optimizer step per training
    # step, given its params (the actor update: old_log_probs); the op producing them is then left
    # out of the plan (rlgraph.graph.reuse). Such inputs must be optional inputs
    recomputes: Callable[[Mapping[str, Any]], Iterable[str]] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise DeclarationError(f"op name {self.name!r} must be a Python identifier")
        where = f"op {self.name!r}"
        object.__setattr__(self, "inputs", MappingProxyType(_columns_arg(where, "inputs", self.inputs)))
        object.__setattr__(self, "outputs", MappingProxyType(_columns_arg(where, "outputs", self.outputs)))
        if not isinstance(self.params, Mapping):
            raise DeclarationError(f"{where}: params= must be a dict of name -> Param; got {_shown(self.params)}")
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        object.__setattr__(self, "optional_inputs",
                           frozenset(_names_arg(where, "optional_inputs", self.optional_inputs)))
        object.__setattr__(self, "as_rows", frozenset(_names_arg(where, "as_rows", self.as_rows)))
        if self.group is not None and (not isinstance(self.group, str) or not self.group.isidentifier()):
            hint = (f"; give its name, group={self.group.name!r}" if isinstance(self.group, WorkerGroup)
                    else "; give the name of a WorkerGroup of the pipeline, e.g. group='actor'")
            raise DeclarationError(f"{where}: group= must be a worker group's name; got {_shown(self.group)}{hint}")
        if self.batching is not None and not isinstance(self.batching, Batching):
            raise DeclarationError(f"{where}: batching= must be a Batching(...); got {_shown(self.batching)}")
        if not isinstance(self.cost, (int, float)) or isinstance(self.cost, bool) or not self.cost >= 0:
            raise DeclarationError(f"{where}: cost= must be a number >= 0; got {_shown(self.cost)}")
        if self.granularity not in GRANULARITIES:
            close = difflib.get_close_matches(str(self.granularity), GRANULARITIES, n=1, cutoff=0.4)
            raise DeclarationError(
                f"{where}: granularity {self.granularity!r} must be one of {', '.join(GRANULARITIES)}"
                + (f" (did you mean {close[0]!r}?)" if close else "")
            )
        if not self.outputs:
            raise DeclarationError(f"{where} declares no output columns; an op must produce something")
        unknown_opt = self.optional_inputs - set(self.inputs)
        if unknown_opt:
            raise DeclarationError(f"{where}: optional inputs {sorted(unknown_opt)} are not among its inputs")
        for col in sorted(self.as_rows):
            ctype = self.inputs.get(col)
            if ctype is None:
                raise DeclarationError(f"{where}: as_rows names {col!r}, which is not among its inputs "
                                       f"{sorted(self.inputs)}")
            if (len(ctype.shape) != 1 or not isinstance(ctype.shape[0], str) or ctype.level != "sample"
                    or ctype.kind != "data" or ctype.dtype in ("str", "json", "opaque")):
                raise DeclarationError(f"{where}: as_rows names {col!r} of type {ctype.describe()}; only a per-sample "
                                       f"numeric column of one ragged dimension (e.g. int64[response_len]) is given "
                                       f"as its rows: leave {col!r} out of as_rows to get it padded")
        for col, p in self.params.items():
            if not isinstance(p, Param):
                raise DeclarationError(f"{where}: param {col!r} must be a Param, got {p!r}")
        referenced = [self.group_size_param]
        if self.batching:
            referenced += [self.batching.mini_batch, self.batching.micro_batch, self.batching.epochs]
        for ref in referenced:
            if ref is not None and ref not in self.params:
                raise DeclarationError(f"{where}: batching refers to param {ref!r}, which it does not declare")
        if self.vectorised and (self.streams or self.granularity == "batch"):
            raise DeclarationError(f"{where}: vectorised=True is for per-sample and per-group ops that return their "
                                   f"outputs at once; a streaming op or a whole-batch op has one chunk per call already")
        if self.batching and self.batching.per_rank and (self.granularity == "batch" or self.batching.mini_batch):
            raise DeclarationError(f"{where}: Batching(per_rank=True) is for per-sample and per-group ops (one call "
                                   f"per rank); a whole-batch op already runs on every rank at once")

    @property
    def namespace(self) -> str:
        """The config namespace of this op's params (``actor`` in ``actor.lr``)."""
        return self.config_key or self.name

    @property
    def runtime_params(self) -> tuple[str, ...]:
        """Params the runtime consumes itself: the batching sizes (the body finds them in
        ``ctx.batching``), the group size (``ctx.group_size``) and setup-time params (read by the
        worker class's ``setup``). The body receives them as keywords only if it names them."""
        names = {self.group_size_param}
        if self.batching:
            names |= {self.batching.mini_batch, self.batching.micro_batch, self.batching.epochs}
        return tuple(k for k, p in self.params.items() if k in names or p.setup)

    def with_(self, **changes: Any) -> OpSpec:
        """A copy with some fields changed, e.g. ``spec.with_(group="actor", name="ref2")``. ``as_rows``
        says how the body takes its inputs, so a new body (``impl``) given without it takes them padded,
        and new ``inputs`` keep only the names of it they still hold."""
        if "as_rows" not in changes:
            if changes.get("impl", self.impl) != self.impl:
                changes["as_rows"] = frozenset()
            elif "inputs" in changes:
                changes["as_rows"] = frozenset(c for c in self.as_rows if c in changes["inputs"])
        return replace(self, **changes)


def _impl_ref(fn: Callable) -> tuple[str, str | None]:
    module = getattr(fn, "__module__", None) or "__main__"
    qualname = getattr(fn, "__qualname__", fn.__name__)
    if "<locals>" in qualname:
        raise DeclarationError(
            f"op {fn.__name__!r} is defined inside a function ({qualname}); define it at module level "
            f"so workers can import it"
        )
    mod = sys.modules.get(module)
    file = getattr(mod, "__file__", None) if mod is not None else None
    return f"{module}:{qualname}", file


def _param_from_signature(opname: str, p: inspect.Parameter, annotation: Any) -> Param:
    if isinstance(annotation, Param):
        return annotation
    if p.default is inspect.Parameter.empty:
        raise DeclarationError(
            f"op {opname!r}: config parameter {p.name!r} needs a default value (keyword-only parameters "
            f"are config)"
        )
    typ = annotation if annotation in (int, float, str, bool) else type(p.default)
    if typ not in (int, float, str, bool):
        raise DeclarationError(
            f"op {opname!r}: config parameter {p.name!r} must be int, float, str or bool; got "
            f"{annotation!r}"
        )
    try:
        return Param(typ, p.default)
    except DeclarationError as e:
        raise DeclarationError(f"op {opname!r}: config parameter {p.name!r}: {e}") from None


def op(
    fn: Callable | None = None,
    *,
    outputs: Mapping[str, ColumnType] | None = None,
    inputs: Mapping[str, ColumnType] | None = None,
    name: str | None = None,
    granularity: Granularity = "sample",
    group: str | None = None,
    params: Mapping[str, Param] | None = None,
    config_key: str | None = None,
    optional_inputs: Iterable[str] = (),
    batching: Batching | None = None,
    group_size_param: str | None = None,
    skip_before: str | None = None,
    cost: float = 1.0,
    drops: bool = False,
    vectorised: bool = False,
    as_rows: Iterable[str] = (),
) -> Callable:
    """Declare a function (or a worker-class method) as an operator.

    Positional parameters are input columns, typed by their annotations (or by ``inputs=``);
    keyword-only parameters are config params (or give ``params=``). A per-sample or per-group
    op with a ``micro_batch_size`` param is called on micro-batches of that size unless
    ``batching=`` says otherwise. A generator function streams: it yields ``(rows, outputs)``
    for parts of its call as they finish (``rows``: positions in the call, ``outputs``: its
    per-sample outputs for them), and may ``return`` its other outputs (metrics, state). The
    function is returned unchanged with its `OpSpec` attached; get it back with `op_spec(fn)`.

    ``vectorised=True`` says the body computes each chunk (micro-batch, or group of a per-group
    op) from that chunk's rows alone, as verl's group-wise estimators do: a call holding several
    ready chunks then runs the body once on all of them instead of once per chunk. The body
    finds the chunks' sizes in ``ctx.chunks`` (rows in order) and may give a metric output as a
    list with one record per chunk, so the step's metrics are what per-chunk calls would give;
    ``ctx.seed`` is the first chunk's, so a vectorised body should draw no random numbers.

    ``as_rows`` names ragged inputs of one dimension (``int64[response_len]``) that the body
    receives as their rows, a `rlgraph.rows.Rows` (a list of 1-D tensors, each its row's length,
    with the joined tensor in ``.flat`` and the lengths in ``.lengths``), instead of right-padded
    into one tensor. The rows are the runtime's own: read them; a body that changes one in
    place through torch fails its call (copy first: ``rows.flat.clone()``).

        @op(outputs={"token_level_scores": T.float32("response_len")}, group="reward")
        def length_reward(responses: T.int64("response_len"), *, coef: float = 0.01):
            ...
    """

    def declare(f: Callable) -> Callable:
        if not callable(f):
            raise DeclarationError(f"@rlgraph.op decorates a function or method; got {_shown(f)}")
        opname = name or f.__name__
        if outputs is None:
            raise DeclarationError(
                f"op {opname!r}: @rlgraph.op needs outputs=, the columns it produces; write "
                f"@rlgraph.op(outputs={{'score': T.float32()}}, group='...') above {f.__name__}()")
        if name is not None and not isinstance(name, str):
            raise DeclarationError(f"op {f.__name__!r}: name= must be a string; got {_shown(name)}")
        if inputs is not None:
            _columns_arg(f"op {opname!r}", "inputs", inputs)
        sig = inspect.signature(f)
        try:
            ann = inspect.get_annotations(f, eval_str=True)
        except Exception as e:  # a string annotation that does not evaluate
            raise DeclarationError(f"op {opname!r}: cannot evaluate its annotations: {e}") from e
        ins: dict[str, ColumnType] = {}
        prm: dict[str, Param] = dict(params or {})
        given = dict(inputs or {})
        for i, p in enumerate(sig.parameters.values()):
            if i == 0 and p.name in ("self", "cls"):
                continue
            if p.name == _CTX:
                continue
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise DeclarationError(
                    f"op {opname!r}: *{p.name} / **{p.name} are not allowed; name each input column"
                )
            if p.kind == p.KEYWORD_ONLY:
                if p.name not in prm:
                    prm[p.name] = _param_from_signature(opname, p, ann.get(p.name))
                continue
            ctype = given.pop(p.name, None) or ann.get(p.name)
            if ctype is not None and not isinstance(ctype, ColumnType) and (
                    _uncalled_type(ctype) or ctype in _PLAIN_TYPES):
                raise DeclarationError(_column_type_problem(f"op {opname!r}", f"input parameter {p.name!r}", ctype))
            if not isinstance(ctype, ColumnType):
                raise DeclarationError(
                    f"op {opname!r}: input parameter {p.name!r} has no column type; annotate it, e.g. "
                    f"`{p.name}: T.float32('response_len')`, or pass inputs={{{p.name!r}: ...}}"
                )
            ins[p.name] = ctype
        if given:
            raise DeclarationError(
                f"op {opname!r}: inputs= names {sorted(given)} which are not parameters of {f.__name__}()"
            )
        clash = set(ins) & set(prm)
        if clash:
            raise DeclarationError(f"op {opname!r}: {sorted(clash)} are both input columns and params")
        impl, impl_file = _impl_ref(f)
        micro = batching
        if micro is None and "micro_batch_size" in prm and granularity != "batch":
            micro = Batching(micro_batch="micro_batch_size")  # the conventional name means what it says
        spec = OpSpec(
            name=opname,
            inputs=ins,
            outputs=outputs,
            granularity=granularity,
            group=group,
            params=prm,
            config_key=config_key,
            impl=impl,
            impl_file=impl_file,
            optional_inputs=frozenset(optional_inputs),
            batching=micro,
            group_size_param=group_size_param,
            skip_before=skip_before,
            cost=cost,
            doc=inspect.getdoc(f) or "",
            drops=drops,
            streams=inspect.isgeneratorfunction(f),  # a generator body yields its rows in parts
            vectorised=vectorised,
            as_rows=as_rows,  # a lone name, or names: OpSpec checks and keeps them as a frozenset
        )
        f.__rlgraph_op__ = spec  # metadata only: the function itself is unchanged
        return f

    return declare(fn) if fn is not None else declare


def op_spec(obj: Any) -> OpSpec:
    """The `OpSpec` of an `@op` function or method, or `obj` itself if it is one."""
    if isinstance(obj, OpSpec):
        return obj
    spec = getattr(obj, "__rlgraph_op__", None)
    if isinstance(spec, OpSpec):
        return spec
    raise DeclarationError(_not_an_op(obj))


def _not_an_op(obj: Any, where: str = "") -> str:
    if inspect.isfunction(obj) and obj.__module__.startswith("rlgraph.ops"):
        return (f"{where}{obj.__module__.rsplit('.', 1)[-1]}.{obj.__name__} is a stage factory, not an op: call it, "
                f"e.g. {obj.__module__.rsplit('.', 1)[-1]}.{obj.__name__}(group='actor')")
    if inspect.isfunction(obj) or inspect.ismethod(obj):
        return (f"{where}function {obj.__qualname__!r} is not an operator; decorate it with "
                f"@rlgraph.op(outputs={{...}}), or call it if it is a factory that returns an op")
    if isinstance(obj, WorkerGroup):
        return f"{where}WorkerGroup({obj.name!r}) is a worker group, not an op; list it in groups="
    return f"{where}{_shown(obj)} is not an operator; decorate a function with @rlgraph.op(outputs=...) or pass an OpSpec"


@dataclass(frozen=True)
class WorkerGroup:
    """A set of `dp` identical workers (one Ray actor each); the ops in it share those actors.

    ``pool`` names the resource pool it is placed on; groups naming the same pool time-share
    its devices (like a reward model that wakes, scores and sleeps on the policy's GPUs).
    Each field can be overridden as ``groups.<name>.<field>=...``.
    """

    name: str
    dp: int = default_of(GroupSettings, "dp")
    num_cpus: float = default_of(GroupSettings, "num_cpus")
    num_gpus: float = default_of(GroupSettings, "num_gpus")
    pool: str | None = None  # None: a pool of its own, named after the group
    doc: str = ""
    placement: str = default_of(GroupSettings, "placement")
    torch_threads: int = default_of(GroupSettings, "torch_threads")

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise DeclarationError(f"worker group name {self.name!r} must be a Python identifier")
        where = f"worker group {self.name!r}"
        params = params_of(GroupSettings, pool=self.name)
        for arg in ("dp", "num_cpus", "num_gpus", "placement", "torch_threads"):
            _check_setting(where, arg, getattr(self, arg), params[arg], f"groups.{self.name}.{arg}")
        if self.pool is not None and (not isinstance(self.pool, str) or not self.pool.isidentifier()):
            raise DeclarationError(f"{where}: pool={self.pool!r} must be the name of a worker group whose devices it "
                                   f"shares (a Python identifier), or None for a pool of its own")
        if not isinstance(self.doc, str):
            raise DeclarationError(f"{where}: doc= must be a string; got {_shown(self.doc)}")

    def params(self) -> dict[str, Param]:
        """Its ``groups.<name>.*`` keys, defaulting to what it declares."""
        return params_of(GroupSettings, dp=self.dp, num_cpus=float(self.num_cpus), num_gpus=float(self.num_gpus),
                         pool=self.pool or self.name, placement=self.placement, torch_threads=self.torch_threads)


@dataclass(frozen=True)
class Cluster:
    """The cluster a plan is compiled for; override as ``cluster.num_nodes=2`` etc."""

    num_nodes: int = default_of(ClusterSettings, "num_nodes")
    cpus_per_node: float = default_of(ClusterSettings, "cpus_per_node")
    gpus_per_node: float = default_of(ClusterSettings, "gpus_per_node")

    def __post_init__(self) -> None:
        params = params_of(ClusterSettings)
        for arg in ("num_nodes", "cpus_per_node", "gpus_per_node"):
            _check_setting("Cluster", arg, getattr(self, arg), params[arg], f"cluster.{arg}")

    def params(self) -> dict[str, Param]:
        """Its ``cluster.*`` keys, defaulting to what it declares."""
        return params_of(ClusterSettings, num_nodes=self.num_nodes, cpus_per_node=float(self.cpus_per_node),
                         gpus_per_node=float(self.gpus_per_node))


@dataclass(frozen=True)
class DataSource:
    """Where prompts come from. Emits one row per sample (each prompt repeated ``n`` times).

    ``columns`` are the per-sample columns it provides, besides the system columns ``uid`` and
    ``is_padding``; ``params`` live under the ``data.`` namespace and must include
    ``batch_size`` (prompts per step).
    """

    columns: Mapping[str, ColumnType]
    params: Mapping[str, Param] = field(default_factory=dict)
    impl: Any = None  # "module:Class", or the class itself
    name: str = "data"
    doc: str = ""
    impl_file: str | None = None

    def __post_init__(self) -> None:
        if self.impl is not None and not isinstance(self.impl, str):
            ref, file = _impl_ref(self.impl)
            object.__setattr__(self, "impl", ref)
            object.__setattr__(self, "impl_file", file)
        if not isinstance(self.columns, Mapping):
            raise DeclarationError(f"data source {self.name!r}: columns must be a dict of column name -> column type, "
                                   f"e.g. DataSource({{'prompt': T.str()}}); got {_shown(self.columns)}")
        object.__setattr__(self, "columns", MappingProxyType(dict(self.columns)))
        prm = {**params_of(SourceSettings), **dict(self.params)}
        object.__setattr__(self, "params", MappingProxyType(prm))
        for col, ctype in self.columns.items():
            if not isinstance(ctype, ColumnType):
                raise DeclarationError(_column_type_problem(f"data source {self.name!r}", f"column {col!r}", ctype))
            if col in SYSTEM_COLUMNS:
                raise DeclarationError(f"data source column {col!r} is a system column; do not declare it")

    def all_columns(self) -> dict[str, ColumnType]:
        return {**self.columns, **SYSTEM_COLUMNS}


@dataclass(frozen=True)
class Pipeline:
    """A declared pipeline: a data source, operators, worker groups, the cluster and config.

    Edges are not declared: an op's input column is connected to the op that outputs a column
    of that name. ``outputs`` lists columns to keep even though no op reads them; metric
    columns are always kept. ``config`` holds nested default values (``{"actor": {"lr": 1e-6}}``)
    that command-line overrides replace. ``prepare`` is a function ``prepare(config)`` that
    `rlgraph run` calls (in the driver, before Ray starts) to create local assets the run needs,
    such as an example's data set and tiny model; it must be idempotent. Compiling never calls it.

    ``summaries`` maps a per-sample numeric column to a metric name: each step reports the mean,
    max and min over real rows of the column's per-row sum (``{"token_level_scores": "score"}``
    gives ``score/mean``; the first entry is the run's headline metric, plotted in
    ``reward_curve.svg``). ``validation`` names the columns validation produces: every
    ``trainer.val_every`` steps the ops they need run on the source's validation split and the
    summaries of what they produce are reported under ``val/``.
    """

    name: str
    source: DataSource
    ops: tuple[OpSpec, ...]
    groups: tuple[WorkerGroup, ...] = ()
    cluster: Cluster = Cluster()
    config: Mapping[str, Any] = field(default_factory=dict)
    outputs: tuple[str, ...] = ()
    doc: str = ""
    prepare: str | None = None  # "module:function" run by `rlgraph run` before anything starts
    prepare_file: str | None = None
    summaries: Mapping[str, str] = field(default_factory=dict)  # column -> metric name
    validation: tuple[str, ...] = ()  # columns validation produces

    def __init__(
        self,
        name: str,
        source: DataSource,
        ops: Iterable[Any],
        groups: Iterable[WorkerGroup] = (),
        cluster: Cluster | None = None,
        config: Mapping[str, Any] | None = None,
        outputs: Iterable[str] = (),
        doc: str = "",
        prepare: Any = None,
        prepare_file: str | None = None,
        summaries: Mapping[str, str] | None = None,
        validation: Iterable[str] = (),
    ) -> None:
        if not isinstance(name, str) or not name:
            raise DeclarationError(f"Pipeline(name=...) must be a non-empty string; got {_shown(name)}")
        where = f"pipeline {name!r}"
        if not isinstance(source, DataSource):
            if inspect.isfunction(source):
                raise DeclarationError(f"{where}: source= is the function {source.__name__!r}, not a DataSource: call "
                                       f"it, e.g. source={source.__name__}()")
            if isinstance(source, Mapping) and all(isinstance(v, ColumnType) for v in source.values()):
                raise DeclarationError(f"{where}: source= is a dict of columns; wrap it in a DataSource: "
                                       f"source=DataSource({{{', '.join(repr(k) + ': ...' for k in list(source)[:2])}}})")
            raise DeclarationError(f"{where}: source= must be a DataSource, e.g. DataSource({{'prompt': T.str()}}) or "
                                   f"stages.prompt_source(); got {_shown(source)}")
        if isinstance(getattr(ops, "__rlgraph_op__", ops), OpSpec):
            alone = getattr(ops, "__name__", None) or op_spec(ops).name
            raise DeclarationError(f"{where}: ops= is the op {op_spec(ops).name!r} alone; give a list: ops=[{alone}]")
        if isinstance(ops, (str, Mapping)) or not isinstance(ops, Iterable):
            raise DeclarationError(f"{where}: ops= must be a list of ops, e.g. ops=[judge, update]; got {_shown(ops)}")
        ops = list(ops)
        for i, o in enumerate(ops):
            if not isinstance(o, OpSpec) and not isinstance(getattr(o, "__rlgraph_op__", None), OpSpec):
                raise DeclarationError(_not_an_op(o, f"{where}: ops[{i}]: "))
        if isinstance(groups, (str, Mapping, WorkerGroup)) or not isinstance(groups, Iterable):
            raise DeclarationError(f"{where}: groups= must be a list of WorkerGroup objects, e.g. "
                                   f"groups=[WorkerGroup('actor')]; got {_shown(groups)}")
        groups = tuple(groups)
        for i, g in enumerate(groups):
            if not isinstance(g, WorkerGroup):
                hint = f"; write WorkerGroup({g!r})" if isinstance(g, str) else ""
                raise DeclarationError(f"{where}: groups[{i}] must be a WorkerGroup, got {_shown(g)}{hint}")
        if cluster is not None and not isinstance(cluster, Cluster):
            raise DeclarationError(f"{where}: cluster= must be a Cluster(...), e.g. Cluster(num_nodes=1, "
                                   f"cpus_per_node=8); got {_shown(cluster)}")
        if config is not None:
            if not isinstance(config, Mapping):
                raise DeclarationError(f"{where}: config= must be a dict of namespace -> {{key: value}}, e.g. "
                                       f"config={{'actor': {{'lr': 1e-6}}}}; got {_shown(config)} (key=value strings "
                                       f"are command-line overrides)")
            for ns, values in config.items():
                if not isinstance(ns, str):
                    raise DeclarationError(f"{where}: config= has key {ns!r}; namespaces are strings such as 'actor'")
                if "." not in ns and not isinstance(values, Mapping):
                    raise DeclarationError(f"{where}: config[{ns!r}] is {_shown(values)}; a namespace holds a dict of "
                                           f"its keys, e.g. config={{{ns!r}: {{'key': value}}}} (or write "
                                           f"config={{'{ns}.key': value}})")
        outputs = _names_arg(where, "outputs", outputs)
        if summaries is not None and not isinstance(summaries, Mapping):
            raise DeclarationError(f"{where}: summaries= must be a dict of column -> metric name, e.g. "
                                   f"{{'token_level_scores': 'score'}}; got {_shown(summaries)}")
        summaries = dict(summaries or {})
        for col, metric in summaries.items():
            if not isinstance(col, str) or not isinstance(metric, str) or not metric or "/" in metric:
                raise DeclarationError(f"pipeline {name!r}: summaries maps column names to metric names without "
                                       f"'/', e.g. {{'token_level_scores': 'score'}}; got {col!r}: {metric!r}")
        validation = _names_arg(where, "validation", validation)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "ops", tuple(op_spec(o) for o in ops))
        object.__setattr__(self, "groups", groups)
        object.__setattr__(self, "cluster", cluster or Cluster())
        object.__setattr__(self, "config", MappingProxyType(dict(config or {})))
        object.__setattr__(self, "outputs", tuple(outputs))
        object.__setattr__(self, "doc", doc)
        if prepare is not None and not isinstance(prepare, str):
            if not callable(prepare):
                raise DeclarationError(f"pipeline {name!r}: prepare must be a function or 'module:function'")
            prepare, prepare_file = _impl_ref(prepare)
        object.__setattr__(self, "prepare", prepare)
        object.__setattr__(self, "prepare_file", prepare_file)
        object.__setattr__(self, "summaries", MappingProxyType(summaries))
        object.__setattr__(self, "validation", tuple(validation))

    def op(self, name: str) -> OpSpec:
        for o in self.ops:
            if o.name == name:
                return o
        raise KeyError(f"no op {name!r} in pipeline {self.name!r}; ops are {[o.name for o in self.ops]}")

    def with_ops(self, *ops: Any, drop: Iterable[str] = ()) -> Pipeline:
        """A new pipeline with some ops added (or replacing ones of the same name) or dropped; each
        name in `drop` must be one of its ops."""
        where = f"pipeline {self.name!r}.with_ops()"
        drop = _names_arg(where, "drop", drop)
        _unknown_names(where, "drop", drop, [o.name for o in self.ops], "op")
        new = {o.name: o for o in self.ops if o.name not in set(drop)}
        for i, o in enumerate(ops):
            if not isinstance(o, OpSpec) and not isinstance(getattr(o, "__rlgraph_op__", None), OpSpec):
                raise DeclarationError(_not_an_op(o, f"{where}: argument {i + 1}: "))
            s = op_spec(o)
            new[s.name] = s
        return replace(self, ops=tuple(new.values()))

    def with_groups(self, *groups: WorkerGroup, drop: Iterable[str] = ()) -> Pipeline:
        """A new pipeline with worker groups added (or replacing ones of the same name) or dropped;
        each name in `drop` must be one of its groups."""
        where = f"pipeline {self.name!r}.with_groups()"
        drop = _names_arg(where, "drop", drop)
        _unknown_names(where, "drop", drop, [g.name for g in self.groups], "worker group")
        for i, g in enumerate(groups):
            if not isinstance(g, WorkerGroup):
                raise DeclarationError(f"{where}: argument {i + 1} must be a WorkerGroup, got {_shown(g)}")
        new = {g.name: g for g in self.groups if g.name not in set(drop)}
        new.update({g.name: g for g in groups})
        return replace(self, groups=tuple(new.values()))

    def with_outputs(self, *outputs: str, drop: Iterable[str] = ()) -> Pipeline:
        """A new pipeline keeping other columns: `outputs` added, `drop` removed (each must be one of
        its outputs)."""
        where = f"pipeline {self.name!r}.with_outputs()"
        drop = _names_arg(where, "drop", drop)
        _unknown_names(where, "drop", drop, list(self.outputs), "output")
        outputs = _names_arg(where, "outputs", outputs)
        keep = [c for c in self.outputs if c not in set(drop)] + [c for c in outputs if c not in self.outputs]
        return replace(self, outputs=tuple(keep))

    def with_config(self, **namespaces: Mapping[str, Any]) -> Pipeline:
        """A new pipeline with config defaults merged in, e.g. ``with_config(actor={"lr": 1e-6})``."""
        merged = {k: dict(v) if isinstance(v, Mapping) else v for k, v in self.config.items()}
        for ns, values in namespaces.items():
            merged.setdefault(ns, {}).update(values)
        return replace(self, config=merged)

    def __call__(self, *a: Any, **k: Any) -> Any:
        raise TypeError("a Pipeline is not run by calling it; use `rlgraph run` or rlgraph.compile(pipeline)")
