"""The worker actor as the driver sees it, importable without torch: its Ray class, the results its
calls return, and what the driver asks of it ahead of a call.

The worker itself (`rlgraph.runtime.worker.GroupWorker`) imports torch, the data plane and the op
runtime, 1.5 CPU-seconds on this machine's cores. The driver needs none of it to start the actors:
`actor_class` is a Ray class whose constructor builds the worker in the actor's own process and
whose methods hand each call to it, so `rlgraph run` submits the actors before it imports torch
(for the data plane it starts beside them), and start-up on a small machine, bound by the CPU,
does not wait for the driver's imports (docs/performance.md, start-up). The class keeps the
worker's name, so the actor's process is ``ray::GroupWorker`` as before.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Iterator

from rlgraph.graph.plan import Plan
from rlgraph.runtime.trace import Compact, Span

__all__ = ["CallResult", "PartResult", "READ_AHEAD", "STREAMS", "WORKERS", "WORKER_METHODS", "actor_class",
           "read_ahead_ops"]

READ_AHEAD = "read_ahead"  # the worker actors' concurrency group for reads ahead of a call (`GroupWorker.read_ahead`)

# What the driver calls on a worker actor: `GroupWorker`'s public methods (tests/runtime/test_actor.py
# keeps the two lists equal). `STREAMS` are Ray streaming generators.
WORKER_METHODS = (
    "connect", "rendezvous", "setup", "run_chunk", "run_chunk_stream", "run_chunk_whole", "read_ahead", "forget",
    "export_state", "import_state", "state_columns", "load_state_columns", "instance_states",
    "load_instance_states", "has_instance_state", "ping", "close",
)
STREAMS = ("run_chunk_stream",)
WORKERS = ("GroupWorker", "FaultInjectingWorker")  # the worker classes of `rlgraph.runtime.worker` an actor runs


@dataclass
class PartResult:
    """What a streaming call reports for each part as soon as it is in the data plane."""

    rows: tuple[int, ...]  # the step's row ids whose outputs were just put
    summaries: dict[str, dict[int, float]] = field(default_factory=dict)


@dataclass
class CallResult(Compact):
    """What a worker returns for one call: small by construction."""

    span: Span
    metrics: list[dict[str, Any]] = field(default_factory=list)  # metric columns the op produced, per chunk
    # the pipeline's summarised columns: column -> row -> the row's sum (real rows only; a float per row)
    summaries: dict[str, dict[int, float]] = field(default_factory=dict)
    batch_values: dict[str, Any] = field(default_factory=dict)  # batch-level data outputs
    dropped: dict[int, tuple[str, bool]] = field(default_factory=dict)  # row -> (reason, whole group?)
    fused: list[CallResult] = field(default_factory=list)  # the results of the ops fused into this call, in order


def read_ahead_ops(plan: Plan) -> dict[str, tuple[str, ...]]:
    """The ops whose first call of a step the driver has their worker read ahead for, with the
    columns it reads (`GroupWorker.read_ahead`): an op that reads only the data source's columns
    (so its inputs exist once the step is admitted) and leads its calls, on a group of one rank (so
    the rank is known before the call is made); the columns are the source's that it and the ops
    fused into it read. None with dynamic sampling (its batches are assembled from rounds)."""
    if plan.refill is not None:
        return {}
    source = set(plan.source_columns)
    out: dict[str, tuple[str, ...]] = {}
    for op in plan.ops:
        sample = [c for c in op.inputs if plan.columns[c].level == "sample"]
        if op.fused_into or plan.group(op.group).dp != 1 or not sample or not set(sample) <= source:
            continue
        cols = [c for name in (op.name, *plan.followers(op.name)) for c in plan.op(name).inputs
                if c in source and plan.columns[c].level == "sample" and plan.columns[c].stored]
        out[op.name] = tuple(dict.fromkeys(cols))
    return out


class _Actor:
    """The body of a worker actor: builds its worker (`_impl`, "module:Class") in the actor's
    process and hands it each call (the methods `actor_class` adds)."""

    _impl = ""

    def __init__(self, *args: Any) -> None:
        from importlib import import_module

        module, _, name = self._impl.partition(":")
        self.worker = getattr(import_module(module), name)(*args)


def _call(name: str) -> Any:
    def method(self: _Actor, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


def _stream(name: str) -> Any:
    def method(self: _Actor, *args: Any, **kwargs: Any) -> Iterator[Any]:
        yield from getattr(self.worker, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


for _name in WORKER_METHODS:
    setattr(_Actor, _name, (_stream if _name in STREAMS else _call)(_name))


@functools.cache  # one class per name
def actor_class(name: str = "GroupWorker") -> type:
    """The class to give ``ray.remote`` for worker class `name` (one of `WORKERS`: ``GroupWorker``, or
    ``FaultInjectingWorker`` for runs given faults): named as it, so its process is ``ray::<name>``."""
    if name not in WORKERS:
        raise ValueError(f"no worker class {name!r}; one of {WORKERS}")
    return type(name, (_Actor,), {"_impl": f"rlgraph.runtime.worker:{name}", "__module__": __name__,
                                  "__qualname__": name})
