"""The settings of each config section as typed models: the one home of every key's type, default,
bounds and doc.

A section of the config (``trainer.*``, ``dataplane.*``, ``cluster.*``, ``groups.<name>.*``, the
data source's ``batch_size``; the built-in ops' sections are in `rlgraph.ops.settings`) is a frozen
pydantic model whose fields are its keys: a field's annotation is its type (``Literal[...]`` for
choices, ``X | None`` when null is allowed), ``Field(default, ge=...)`` its default and lower
bound, the docstring under it its doc. Two things are made from a model:

- the `Param` of each key (`params_of`), from which the config is resolved, overrides are parsed
  and checked, unknown keys get "did you mean", `rlgraph describe --config` prints its table and
  verl's key names are translated (a section's ``verl`` table names the verl keys of its fields);
- typed access to a resolved config (`Section.of`): ``TrainerSettings.of(plan).seed``, with an op
  context, a plan, a built graph or the config itself.

So a default is written once, here, and code reads the model: never ``config.get("seed", 0)``
(tests/graph/test_settings.py checks every module for that).

A field without a default is set by the declaration (a worker group's pool is its name,
``advantage("grpo")`` sets ``algorithm.estimator``): `params_of` must be given its value. A field
marked `FIXED` takes no other value than the declared one (``overlong.score_column``, set by
``overlong_penalty(score_column=...)``).
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Mapping, Union, get_args, get_origin

from annotated_types import Ge
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic_core import PydanticUndefined

from rlgraph.errors import ConfigError, DeclarationError
from rlgraph.graph.config import Param

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "SETUP",
    "FIXED",
    "Section",
    "params_of",
    "default_of",
    "verl_aliases",
    "TrainerSettings",
    "DataplaneSettings",
    "ClusterSettings",
    "GroupSettings",
    "SourceSettings",
    "PLACEMENTS",
]

# json_schema_extra of a field: a worker class reads it once in its setup (`Param.setup`)
SETUP: dict[str, Any] = {"setup": True}
# json_schema_extra of a field the declaration sets: its only allowed value is the declared one
FIXED: dict[str, Any] = {"fixed": True}

PLACEMENTS = ("pack", "spread", "strict_spread")  # least to most spread


class Section(BaseModel):
    """A config section: one field per key. ``namespace`` is where its keys live (``trainer`` in
    ``trainer.seed``); ``verl`` maps a field to the verl keys that stand for it."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False,
                              use_attribute_docstrings=True)

    namespace: ClassVar[str] = ""
    verl: ClassVar[Mapping[str, tuple[str, ...]]] = {}

    @classmethod
    def read(cls, values: Mapping[str, Any], namespace: str | None = None) -> Self:
        """The settings in a section's `values`: keys this model does not have (params a pipeline
        added to the op) are left out; a missing key takes the model's default. Raises `ConfigError`
        naming each bad key."""
        ns = namespace or cls.namespace
        known = {k: v for k, v in values.items() if k in cls.model_fields}
        try:
            return cls(**known)
        except ValidationError as e:
            bad = "; ".join(f"{ns}.{'.'.join(map(str, err['loc']))}: {err['msg']} (got {err['input']!r})"
                            if err["type"] != "missing" else f"{ns}.{err['loc'][0]} is not set"
                            for err in e.errors())
            raise ConfigError(f"config section {ns!r}: {bad}") from None

    @classmethod
    def _raw(cls, where: Any, ns: str) -> Mapping[str, Any] | None:
        config = where if isinstance(where, Mapping) or where is None else where.config
        config = config or {}
        node: Any = config
        for part in ns.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if isinstance(node, Mapping):
            return node
        prefix = ns + "."
        flat = {k[len(prefix):]: v for k, v in config.items() if k.startswith(prefix) and "." not in k[len(prefix):]}
        return flat or None

    @classmethod
    def find(cls, where: Any, namespace: str | None = None) -> Self | None:
        """This section of a resolved config, or None if it has none (a pipeline without the op).
        `where` is an op context, a `Plan` or a built graph (anything with a ``config``), or the
        config itself, nested (``{"trainer": {"seed": 0}}``) or flat (``{"trainer.seed": 0}``)."""
        ns = namespace or cls.namespace
        raw = cls._raw(where, ns)
        return None if raw is None else cls.read(raw, ns)

    @classmethod
    def value(cls, where: Any, key: str, namespace: str | None = None) -> Any:
        """One key of this section (see `find` for `where`), checked against its own field only;
        the field's default where the config lacks it. For a body reading one key of another op's
        section (a reward worker reading ``data.tokenizer``): that section's other keys may be a
        custom op's or source's, declared otherwise, and must not fail it."""
        ns = namespace or cls.namespace
        field = cls.model_fields[key]
        raw = cls._raw(where, ns) or {}
        if key not in raw:
            return field.default
        try:
            return TypeAdapter(Annotated[field.annotation, field], config=ConfigDict(strict=True)).validate_python(raw[key])
        except ValidationError as e:
            raise ConfigError(f"config key {ns}.{key}: {e.errors()[0]['msg']} (got {raw[key]!r})") from None

    @classmethod
    def of(cls, where: Any, namespace: str | None = None) -> Self:
        """This section of a resolved config (see `find`); a config without it gives the defaults."""
        found = cls.find(where, namespace)
        return cls.read({}, namespace) if found is None else found


def default_of(model: type[Section], field: str) -> Any:
    """The default of `model`'s `field` (for a declaration's argument that defaults to it)."""
    return model.model_fields[field].default


def _type_and_choices(annotation: Any) -> tuple[type, tuple[Any, ...] | None, bool]:
    optional = False
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        optional = len(args) < len(get_args(annotation))
        annotation, = args
    if get_origin(annotation) is Literal:
        choices = get_args(annotation)
        return type(choices[0]), choices, optional
    return annotation, None, optional


def params_of(model: type[Section], **defaults: Any) -> dict[str, Param]:
    """The `Param` of each field of `model`, in field order. `defaults` replace the model's (a
    declaration's arguments, such as ``WorkerGroup("actor", dp=2)``) and give the fields the model
    leaves to the declaration."""
    unknown = set(defaults) - set(model.model_fields)
    if unknown:
        raise DeclarationError(f"{model.__name__} has no fields {sorted(unknown)}")
    out: dict[str, Param] = {}
    for name, f in model.model_fields.items():
        typ, choices, optional = _type_and_choices(f.annotation)
        extra = f.json_schema_extra if isinstance(f.json_schema_extra, Mapping) else {}
        default = defaults.get(name, f.default)
        if default is PydanticUndefined:
            raise DeclarationError(f"{model.__name__}.{name} is set by the declaration; give its value")
        if extra.get("fixed"):
            choices = (default,)
        minimum = next((m.ge for m in f.metadata if isinstance(m, Ge)), None)
        out[name] = Param(typ, default, " ".join((f.description or "").split()), choices=choices, optional=optional,
                          minimum=minimum, setup=bool(extra.get("setup")), verl=tuple(model.verl.get(name, ())))
    return out


def verl_aliases(models: tuple[type[Section], ...]) -> dict[str, str]:
    """verl key -> rlgraph key, from the ``verl`` tables of `models`."""
    return {verl: f"{m.namespace}.{name}" for m in models for name in m.model_fields for verl in m.verl.get(name, ())}


class TrainerSettings(Section):
    """The training loop: steps, seed, checkpoints, validation, schedule, metrics (``trainer.*``)."""

    namespace: ClassVar[str] = "trainer"
    verl: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "steps": ("trainer.total_training_steps",),
        "save_every": ("trainer.save_freq",),
        "keep_checkpoints": ("trainer.max_actor_ckpt_to_keep",),
        "val_every": ("trainer.test_freq",),
        "project": ("trainer.project_name",),
        "run_name": ("trainer.experiment_name",),
    }

    steps: int = Field(10, ge=1)
    """training steps to run"""
    seed: int = 0
    """global seed; data order, sampling and shuffles derive from it"""
    critic_warmup: int = Field(0, ge=0)
    """steps that update only the critic; ops gated on it are skipped"""
    val_every: int = Field(0, ge=0)
    """run validation every k steps (0: never)"""
    save_every: int = Field(0, ge=0)
    """checkpoint every k steps (0: never); a failure that needs a restore replays the steps since the
    latest checkpoint"""
    keep_checkpoints: int = Field(0, ge=0)
    """the newest k checkpoints are kept, older ones deleted as a new one is written (0: keep all); keep 2 or
    more for `rlgraph run --resume --fallback` to have a good one behind a damaged one"""
    max_retries: int = Field(2, ge=0)
    """failures (an op raised, a worker died) tolerated per step before the run fails; each one re-runs
    the lost work"""
    schedule: Literal["stream", "sync"] = "stream"
    """stream: ops start on partial data; sync: a barrier after each stage"""
    max_staleness: int = Field(0, ge=0)
    """asynchronous training: the rollout (ops declared stale_ok, i.e. generate) may run up to k steps
    ahead of the update, with a policy at most k versions older than the one it is trained against; k+1
    steps are in flight. 0: on-policy"""
    reuse_forward: bool = True
    """leave out a forward pass whose result the update's own forward gives: with one epoch and one mini-batch
    per step, old_logprob (the update then takes old log-probs from its first forward, as TRL does); rlgraph
    describe lists what was left out"""
    fuse_ops: bool = True
    """run a worker group's ops that follow each other (generate -> old_logprob -> ref on the actor) as one
    dispatched call per chunk: the followers run inside the leader's call on its rows, reading its outputs from
    the worker's memory; rlgraph describe lists the fused chains"""
    malloc_keep_mb: int = Field(256, ge=0)
    """memory (MiB) a worker's process keeps for reuse once its tensors free it, instead of giving it back to
    the kernel, with blocks under 32 MiB served from it: each forward pass then reuses the pages of the last
    rather than faulting in new ones (on a VM a page fault costs more than writing the page). 0: glibc's
    defaults. Only where the C library is glibc"""
    logger: str = "[console,jsonl,tensorboard]"
    """where metrics go, a list of: console (progress lines), jsonl (DIR/metrics.jsonl, always written),
    tensorboard (DIR/tensorboard), wandb (offline in DIR/wandb unless wandb is set up; pip install
    'rlgraph[wandb]'), mlflow (DIR/mlruns unless MLFLOW_TRACKING_URI is set; pip install 'rlgraph[mlflow]');
    written [console,wandb] or console,wandb"""
    project: str | None = None
    """wandb project and mlflow experiment [default: $WANDB_PROJECT or $MLFLOW_EXPERIMENT_NAME, else
    rlgraph]"""
    run_name: str | None = None
    """the run's name in wandb and mlflow [default: the run directory's name]"""


class DataplaneSettings(Section):
    """Where columns live between ops (``dataplane.*``)."""

    namespace: ClassVar[str] = "dataplane"

    backend: Literal["transferqueue", "ray"] = "transferqueue"
    """where columns live between ops"""
    storage_units: int | None = Field(None, ge=1)
    """TransferQueue storage units, placed one per node round-robin (each reserves dataplane.cpus_per_unit
    CPUs) [default: one per node, cluster.num_nodes]"""
    locality: Literal["node", "hash"] = "node"
    """where TransferQueue stores a row: node (on a unit of the node of the worker that handles it, and
    calls go to workers near their rows) or hash (TransferQueue's own rule, row index modulo units)"""
    cpus_per_unit: float = Field(1.0, ge=0.0)
    """logical CPUs reserved by the controller and by each storage unit"""
    shared_memory: bool = True
    """on a one-node cluster, tensor columns of at least 64 KiB per put go through shared memory (/dev/shm)
    and TransferQueue keeps only their descriptors; off on several nodes whatever this says"""
    host_unit: bool = True
    """with one storage unit (one node), it runs in TransferQueue's controller process, not in a process of
    its own (one Ray actor less to start)"""
    host_source: bool = True
    """the data source runs in TransferQueue's controller process, not in a process of its own (one Ray
    actor less to start: about 1 s of start-up on 2 cores); the Ray backend always gives it its own"""


class ClusterSettings(Section):
    """The cluster a plan is compiled for (``cluster.*``); `rlgraph.Cluster` declares other defaults."""

    namespace: ClassVar[str] = "cluster"
    verl: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "num_nodes": ("trainer.nnodes",),
        "gpus_per_node": ("trainer.n_gpus_per_node",),
    }

    num_nodes: int = Field(1, ge=1)
    """nodes in the cluster"""
    cpus_per_node: float = Field(8.0, ge=0.0)
    """logical CPUs per node"""
    gpus_per_node: float = Field(0.0, ge=0.0)
    """GPUs per node"""


class GroupSettings(Section):
    """A worker group's resources (``groups.<name>.*``); `rlgraph.WorkerGroup` declares other
    defaults, and its pool defaults to its name."""

    namespace: ClassVar[str] = "groups"

    dp: int = Field(1, ge=1)
    """data-parallel size: workers (Ray actors) in the group"""
    num_cpus: float = Field(1.0, ge=0.0)
    """logical CPUs per worker"""
    num_gpus: float = Field(0.0, ge=0.0)
    """GPUs per worker"""
    torch_threads: int = Field(0, ge=0)
    """torch threads of each worker; 0: the whole CPUs of its pool's bundle (colocated groups take turns on it),
    at least 1, and never more than the cores the worker's process may use"""
    pool: str
    """resource pool; groups sharing one are colocated"""
    placement: Literal[PLACEMENTS] = "pack"  # type: ignore[valid-type]
    """pack the pool's workers onto as few nodes as possible, spread them over the nodes round-robin (e.g.
    reward workers), or strict_spread: each on a node of its own (fails when there are fewer nodes than
    workers)"""


class SourceSettings(Section):
    """What every data source has (``data.*``): a source declares its other params beside it."""

    namespace: ClassVar[str] = "data"
    verl: ClassVar[Mapping[str, tuple[str, ...]]] = {"batch_size": ("data.train_batch_size",)}

    batch_size: int = Field(8, ge=1)
    """prompts per step"""
