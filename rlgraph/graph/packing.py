"""Bundles onto nodes: the one packing rule, used by the compiler and by the run's resource check.

A worker slot (one bundle of a pool) needs some CPUs and GPUs on one node. Slots are placed
first-fit, largest first (GPUs, then CPUs), which is what a Ray ``PACK`` placement group does;
slot ``i`` of a ``spread`` pool tries node ``i mod n`` first (round-robin), and a
``strict_spread`` pool's slots each take a node no other slot of that pool is on (Ray's
``STRICT_SPREAD``; they are placed before all others, being the most constrained). The data plane's
own CPUs (TransferQueue's controller and storage units) are reserved before any slot, because
peers hang silently at start-up when they are forgotten: the controller on node 0 and storage
unit i on node i mod n, as TransferQueue places its units (one per node when there are as many
units as nodes).

The compiler packs onto the nodes the pipeline declares (`rlgraph.graph.place`); a run packs the
plan's bundles onto the Ray cluster's real nodes (`rlgraph.runtime.cluster`). Same function, so
a plan that compiles for a cluster also passes the run's check on that cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

__all__ = ["Slot", "Packing", "pack", "dataplane_actors", "dataplane_cpus", "pool_placement"]

_ORDER = ("pack", "spread", "strict_spread")

_EPS = 1e-9


@dataclass(frozen=True)
class Slot:
    """One worker slot of a pool: bundle `index`, its demand, and its pool's placement."""

    pool: str
    index: int
    cpus: float
    gpus: float
    placement: str = "pack"  # pack | spread | strict_spread

    @property
    def spread(self) -> bool:
        return self.placement != "pack"

    def describe(self) -> str:
        return f"pool {self.pool!r} slot {self.index} ({self.cpus:g} CPU, {self.gpus:g} GPU)"


@dataclass(frozen=True)
class Packing:
    """Where each slot landed (``node_of[(pool, index)]``), what did not fit, and what is left."""

    node_of: Mapping[tuple[str, int], int]
    unplaced: tuple[Slot, ...]
    free_cpus: tuple[float, ...] = field(default=())
    free_gpus: tuple[float, ...] = field(default=())


def pool_placement(placements: Any) -> str:
    """A pool's placement: the most spread of its groups' (a pool is one placement group)."""
    return max(placements, key=_ORDER.index, default="pack")


def dataplane_actors(config: Mapping[str, Any]) -> list[float]:
    """The CPUs of each data-plane actor (flat config): TransferQueue's controller, then each
    storage unit; none for the Ray store."""
    if config["dataplane.backend"] != "transferqueue":
        return []
    return [float(config["dataplane.cpus_per_unit"])] * (1 + int(config["dataplane.storage_units"]))


def dataplane_cpus(config: Mapping[str, Any]) -> float:
    """CPUs the data plane reserves in all (flat config)."""
    return float(sum(dataplane_actors(config)))


def pack(nodes: Sequence[tuple[float, float]], slots: Sequence[Slot], reserve: Sequence[float] = ()) -> Packing:
    """Place `slots` on `nodes` (each node's (CPUs, GPUs)) after reserving the data plane's actors'
    CPUs (`dataplane_actors`): the controller on node 0 and storage unit i on node i mod n, as
    TransferQueue places them; each spills over to the next node with room."""
    cpus = [float(c) for c, _ in nodes]
    gpus = [float(g) for _, g in nodes]
    n = len(nodes)
    for k, need in enumerate(reserve):
        first = (k - 1) % n if (k and n) else 0  # k = 0: the controller; k >= 1: unit k - 1
        for i in [*range(first, n), *range(first)]:
            if cpus[i] + _EPS >= need:
                cpus[i] -= need
                break
        else:  # no node has room for it whole: take it where there is some (the totals check reports it)
            for i in range(n):
                take = min(need, cpus[i])
                cpus[i] -= take
                need -= take
    node_of: dict[tuple[str, int], int] = {}
    unplaced: list[Slot] = []
    taken: dict[str, set[int]] = {}  # pool -> nodes its slots are on (strict_spread takes each once)
    # strict_spread pools first (the most constrained: one node each), then largest first
    for s in sorted(slots, key=lambda s: (s.placement != "strict_spread", -s.gpus, -s.cpus, s.pool, s.index)):
        first = s.index % n if (s.spread and n) else 0
        mine = taken.setdefault(s.pool, set())
        for node in [*range(first, n), *range(first)]:
            if s.placement == "strict_spread" and node in mine:
                continue
            if cpus[node] + _EPS >= s.cpus and gpus[node] + _EPS >= s.gpus:
                mine.add(node)
                cpus[node] -= s.cpus
                gpus[node] -= s.gpus
                node_of[(s.pool, s.index)] = node
                break
        else:
            unplaced.append(s)
    return Packing(node_of, tuple(unplaced), tuple(cpus), tuple(gpus))
