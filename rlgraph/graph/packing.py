"""Bundles onto nodes: the one packing rule, used by the compiler and by the run's resource check.

A worker slot (one bundle of a pool) needs some CPUs and GPUs on one node. Slots are placed
first-fit, largest first (GPUs, then CPUs), which is what a Ray ``PACK`` placement group does;
slot ``i`` of a ``spread`` pool tries node ``i mod n`` first (round-robin). The data plane's
own CPUs (TransferQueue's controller and storage units) are reserved before any slot, node 0
first, because peers hang silently at start-up when they are forgotten.

The compiler packs onto the nodes the pipeline declares (`rlgraph.graph.place`); a run packs the
plan's bundles onto the Ray cluster's real nodes (`rlgraph.runtime.cluster`). Same function, so
a plan that compiles for a cluster also passes the run's check on that cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

__all__ = ["Slot", "Packing", "pack", "dataplane_cpus"]

_EPS = 1e-9


@dataclass(frozen=True)
class Slot:
    """One worker slot of a pool: bundle `index`, its demand, and whether its pool spreads."""

    pool: str
    index: int
    cpus: float
    gpus: float
    spread: bool = False

    def describe(self) -> str:
        return f"pool {self.pool!r} slot {self.index} ({self.cpus:g} CPU, {self.gpus:g} GPU)"


@dataclass(frozen=True)
class Packing:
    """Where each slot landed (``node_of[(pool, index)]``), what did not fit, and what is left."""

    node_of: Mapping[tuple[str, int], int]
    unplaced: tuple[Slot, ...]
    free_cpus: tuple[float, ...] = field(default=())
    free_gpus: tuple[float, ...] = field(default=())


def dataplane_cpus(config: Mapping[str, Any]) -> float:
    """CPUs the data plane reserves: TransferQueue's controller plus each storage unit (flat config)."""
    if config["dataplane.backend"] != "transferqueue":
        return 0.0
    return float(config["dataplane.cpus_per_unit"]) * (1 + int(config["dataplane.storage_units"]))


def pack(nodes: Sequence[tuple[float, float]], slots: Sequence[Slot], reserve_cpus: float = 0.0) -> Packing:
    """Place `slots` on `nodes` (each node's (CPUs, GPUs)) after reserving `reserve_cpus`."""
    cpus = [float(c) for c, _ in nodes]
    gpus = [float(g) for _, g in nodes]
    n = len(nodes)
    reserve = reserve_cpus
    for i in range(n):  # the data plane's actors go where there is room, node 0 first
        take = min(reserve, cpus[i])
        cpus[i] -= take
        reserve -= take
    node_of: dict[tuple[str, int], int] = {}
    unplaced: list[Slot] = []
    for s in sorted(slots, key=lambda s: (-s.gpus, -s.cpus, s.pool, s.index)):
        first = s.index % n if (s.spread and n) else 0
        for node in [*range(first, n), *range(first)]:
            if cpus[node] + _EPS >= s.cpus and gpus[node] + _EPS >= s.gpus:
                cpus[node] -= s.cpus
                gpus[node] -= s.gpus
                node_of[(s.pool, s.index)] = node
                break
        else:
            unplaced.append(s)
    return Packing(node_of, tuple(unplaced), tuple(cpus), tuple(gpus))
