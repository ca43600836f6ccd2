"""Data sources at run time: read a batch of prompts, repeat each n times, pad to the multiple.

A data source body is a class referenced by ``DataSource(impl="module:Class")``:

    class MySource:
        def __init__(self, config: dict, seed: int): ...        # config: the data.* params
        def next_batch(self, batch_size: int) -> dict[str, list]: ...   # one entry per prompt
        def state_dict(self) -> dict: ...                       # JSON-able position, for resume
        def load_state_dict(self, state: dict) -> None: ...

Padding rows (BRIEF section 2) are minimal: every ragged column one zero element (one prompt
token), fixed-shape columns zeros, strings empty, JSON empty; each row gets a fresh group id of
its own and ``is_padding = True``. Real samples are never copied as padding.
"""

from __future__ import annotations

import inspect

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from rlgraph.errors import RLGraphError
from rlgraph.graph.loader import resolve_impl
from rlgraph.graph.plan import ColumnPlan, Plan
from rlgraph.graph.settings import TrainerSettings
from rlgraph.runtime.invoke import TORCH_DTYPES

__all__ = ["SourceError", "StepRows", "padding_value", "expand_and_pad", "preflight"]


class SourceError(RLGraphError):
    """The data source returned a batch that does not match its declared columns."""


@dataclass(frozen=True)
class StepRows:
    """The step's table as the source lays it out: column values per row (``uid`` and ``is_padding``
    as one tensor [rows] each), plus metadata."""

    columns: dict[str, list[Any] | torch.Tensor]
    uids: list[int]
    is_padding: list[bool]

    @property
    def num_rows(self) -> int:
        return len(self.uids)


def padding_value(col: ColumnPlan) -> Any:
    """The minimal value of `col` for a padding row."""
    if col.dtype == "str":
        return ""
    if col.dtype in ("json", "opaque"):
        return {}
    shape = [1 if isinstance(d, str) else d for d in col.shape]
    return torch.zeros(shape, dtype=TORCH_DTYPES[col.dtype])


def expand_and_pad(batch: Mapping[str, list[Any]], columns: Mapping[str, ColumnPlan], n: int,
                   padded_rows: int, uid_start: int) -> StepRows:
    """Repeat each prompt's row `n` times (contiguously) and append padding rows up to `padded_rows`."""
    declared = [c for c in columns if c not in ("uid", "is_padding")]
    missing = [c for c in declared if c not in batch]
    if missing:
        raise SourceError(f"the data source's batch lacks declared columns {missing}; it returned {sorted(batch)}")
    sizes = {c: len(batch[c]) for c in declared}
    if len(set(sizes.values())) > 1:
        raise SourceError(f"the data source returned columns of different lengths: {sizes}")
    prompts = next(iter(sizes.values()), 0)
    real = prompts * n
    if real > padded_rows:
        raise SourceError(f"{prompts} prompts x n={n} = {real} samples exceed the padded batch of {padded_rows}")
    out: dict[str, list[Any]] = {}
    for c in declared:
        rows = [v for v in batch[c] for _ in range(n)]
        pad = padding_value(columns[c])
        rows += [pad.clone() if isinstance(pad, torch.Tensor) else type(pad)() for _ in range(padded_rows - real)]
        out[c] = rows
    uids = [uid_start + p for p in range(prompts) for _ in range(n)]
    uids += [uid_start + prompts + i for i in range(padded_rows - real)]
    is_padding = [False] * real + [True] * (padded_rows - real)
    # one tensor each, not one per row (what a put stacks them into): 8,192 torch.tensor calls took
    # 20 ms of the source's 46 ms for 4,096 rows
    out["uid"] = torch.tensor(uids, dtype=torch.int64)
    out["is_padding"] = torch.tensor(is_padding, dtype=torch.bool)
    return StepRows(out, uids, is_padding)


class SourceWorker:
    """Body of the data-source actor: reads prompts, pads, writes the step's first columns.

    It runs next to the data plane, not in the driver, so prompt payload never passes through
    the driver; `produce` returns only the row metadata (group ids and padding tags).
    """

    def __init__(self, plan_json: str, handle: Any = None, freeze: bool = True) -> None:
        """`freeze`: move the process's heap into Python's permanent generation once set up (`heap`),
        as a process of its own does; not in a host's process, which froze its own and may host
        several sources in turn (a test session's data plane)."""
        self.plan = Plan.model_validate_json(plan_json)
        if not self.plan.source_impl:
            raise SourceError(f"the plan's data source {self.plan.source!r} has no implementation (impl); give "
                              f"DataSource(impl='module:Class')")
        cls, _ = resolve_impl(self.plan.source_impl, self.plan.source_impl_file)
        # the source's own section (a compiled plan has every key of it) and trainer.seed; a source
        # that takes `plan_config` also gets the whole config (the prompt source: actor.model_path's tokenizer)
        extra = {"plan_config": self.plan.config} if "plan_config" in inspect.signature(cls).parameters else {}
        self.source = cls(dict(self.plan.config[self.plan.source]), TrainerSettings.of(self.plan).seed, **extra)
        self.columns = {c: self.plan.columns[c] for c in self.plan.source_columns}
        self.client = handle.connect() if handle is not None else None  # else `connect`, once the plane is up
        if freeze:
            from rlgraph import heap

            heap.freeze()  # imports and the source's own data: out of the collector's full collections

    def connect(self, handle: Any) -> None:
        """Connect to the data plane (a source started before the plane was ready)."""
        self.client = handle.connect()

    def ping(self) -> bool:
        """Answered after every call sent before it (the source runs its calls one at a time)."""
        return True

    def forget(self, partition: str) -> None:
        """The driver cleared `partition`: drop what the client remembers of it."""
        if self.client is not None:
            self.client.forget(partition)

    def produce(self, partition: str, padded_rows: int, uid_start: int, validation: bool = False,
                addresses: Any = None, forget: Sequence[str] = ()) -> tuple[list[int], list[bool], dict[str, float]]:
        """Write a step's first columns; returns the rows' group ids, padding tags and the source's
        metrics of this batch (``batch_metrics()``, if it has one). `addresses`: where the
        partition's rows are in the data plane (`DataPlane.addresses`); `forget`: partitions cleared
        since the last call (`Fleet.clear`)."""
        for cleared in forget:
            self.forget(cleared)
        if addresses is not None:
            self.client.learn(partition, range(padded_rows), addresses)
        size = int(self.plan.batch.batch_size)
        if validation:
            fn = getattr(self.source, "next_val_batch", None)
            if fn is None:
                raise SourceError(f"data source {self.plan.source_impl!r} has no next_val_batch(); validation "
                                  f"needs one (or set trainer.val_every=0)")
            batch = fn(size)
        else:
            batch = self.source.next_batch(size)
        rows = expand_and_pad(batch, self.columns, self.plan.batch.n, padded_rows, uid_start)
        stored = {c: v for c, v in rows.columns.items() if self.plan.columns[c].stored}
        self.client.put(partition, list(range(rows.num_rows)), stored)
        metrics = getattr(self.source, "batch_metrics", None)
        return rows.uids, rows.is_padding, dict(metrics()) if callable(metrics) else {}

    def assemble(self, partition: str, picks: list[tuple[str, list[int]]], columns: list[str], padding: int,
                 pad_uid_start: int) -> None:
        """Write a batch refilled by dynamic sampling into `partition`: first the rows `picks` names,
        ``(round partition, rows)`` in order, with the `columns` they carry; then `padding` padding
        rows with this source's columns, as any step's padding (the rounds' ops then run on them)."""
        values: dict[str, list[Any]] = {c: [] for c in columns}
        for part, rows in picks:
            got = self.client.get(part, rows, columns)
            for c in columns:
                v = got[c]
                values[c] += list(v.unbind(0)) if isinstance(v, torch.Tensor) else list(v)
        kept = sum(len(rows) for _, rows in picks)
        if kept and columns:
            self.client.put(partition, list(range(kept)), values)
        if padding:
            empty = {c: [] for c in self.columns if c not in ("uid", "is_padding")}
            pad = expand_and_pad(empty, self.columns, self.plan.batch.n, padding, pad_uid_start)
            stored = {c: v for c, v in pad.columns.items() if self.plan.columns[c].stored}
            self.client.put(partition, list(range(kept, kept + padding)), stored)

    def state_dict(self) -> dict:
        fn = getattr(self.source, "state_dict", None)
        return fn() if callable(fn) else {}

    def load_state_dict(self, state: dict) -> None:
        fn = getattr(self.source, "load_state_dict", None)
        if callable(fn):
            fn(state)

    def close(self) -> None:
        self.client.close()


def preflight(plan: Plan) -> list[str]:
    """The data source's checks that need no Ray (its class's ``preflight(config, seed, plan_config)``,
    if it has one: the prompt source reads the head of its files and checks the tokenizer), run by
    `rlgraph validate`, and by `rlgraph run` while the workers' processes start, before it waits for
    anything. Returns its notes."""
    if not plan.source_impl:
        return []
    cls, _ = resolve_impl(plan.source_impl, plan.source_impl_file)
    check = getattr(cls, "preflight", None)
    if not callable(check):
        return []
    return list(check(dict(plan.config[plan.source]), TrainerSettings.of(plan).seed, plan.config))
