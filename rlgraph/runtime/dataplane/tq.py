"""`TransferQueueDataPlane`: the data plane on TransferQueue (PyPI ``transferqueue``, 0.1.x).

How our semantics map onto TransferQueue (TQ):

- TQ has one controller (a Ray actor tracking, per row and field, "produced" and, per task,
  "consumed") and ``num_storage_units`` storage actors holding the payload; clients talk to
  them over ZMQ, so payload goes worker -> storage unit -> worker. The controller and every
  storage unit are declared ``@ray.remote(num_cpus=1)`` inside TQ (not configurable), so
  starting TQ needs ``1 + num_storage_units`` free CPUs. With fewer, ``tq.init`` waits forever;
  `check_tq_resources` checks up front and ``start`` also runs ``tq.init`` under a timeout.
- Rows: ``create_partition(p, n)`` registers TQ keys ``"0".."n-1"`` (TQ's key-value API), which
  gives each row a TQ *global index* (unique across partitions, reused after a clear). ``put``
  and ``get`` look the global indexes of their rows up (``kv_retrieve_meta``, once per partition
  and row), then send their cells to the rows' storage units in TQ's own messages (`wire`).
  A partition whose every client is handed its rows' addresses (``create_partition(...,
  lookup=False)``, a step's) takes a cleared partition's rows instead: blocks of rows registered
  once under the plane's own names, freed by a clear that drops the rows from their units and
  asks the controller nothing.
- Where a row is stored: TQ's own SimpleStorage client sends global index ``g`` to unit
  ``g % units``, which scatters every worker's rows over every node. rlgraph's clients use
  `_HomedStorageManager` instead (TQ's storage manager, registered under its own name with TQ's
  ``StorageManagerFactory``), which sends a row to its *home* unit: the unit named by
  ``create_partition(..., homes=...)``, kept in the row's custom metadata on the controller, so
  every client (put, get, clear) routes a row the same way. The runtime picks homes on the nodes
  of the workers that handle the rows (`rlgraph.runtime.scheduler.row_homes`). Rows without a
  home keep TQ's ``g % units``.
- TQ returns jagged nested tensors for every non-scalar field, which we turn back into dense
  tensors or per-row lists (`assemble_rows`).
- TQ's own readiness tracking (``get_meta`` per task) is not used: the runtime's scheduler knows
  which rows are ready from the results of the calls it dispatched.
- Every call runs on this module's own event loop thread under ``asyncio.wait_for``, so each
  wait has a timeout whose error names what it waited for.

TQ allows one instance per Ray cluster (the controller is the named actor
``TransferQueueController`` in namespace ``transfer_queue``); ``start`` refuses to attach to
one it did not start. Networking: TQ binds its ZMQ sockets to ``ray.util.get_node_ip_address()``
(Ray's node IP). On Linux Ray turns ``_node_ip_address="127.0.0.1"`` into the external address
unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is set before ``ray.init``; with it, Ray and TQ
listen on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import operator
import os
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterator, Mapping, Sequence

# TQ reads TQ_NUM_THREADS at import; its default (8) exceeds small machines' cores and makes
# every put/get log a warning. An explicit setting by the user wins.
os.environ.setdefault("TQ_NUM_THREADS", "2")

from rlgraph.runtime.dataplane import lean  # noqa: E402, F401  # first: tensordict without torch._dynamo (`lean`)

import ray  # noqa: E402
import ray.exceptions  # noqa: E402
import transfer_queue as tq  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from transfer_queue import BatchMeta  # noqa: E402
from transfer_queue.client import AsyncTransferQueueClient  # noqa: E402
from transfer_queue.storage.managers.base import StorageManagerFactory  # noqa: E402
from transfer_queue.storage.managers.simple_storage_manager import (  # noqa: E402
    AsyncSimpleStorageManager,
    RoutingGroup,
)

from rlgraph.runtime.dataplane import cells, guard, shm  # noqa: E402
from rlgraph.runtime.dataplane.guest import GuestHost  # noqa: E402
from rlgraph.runtime.dataplane.unit import DirectUnit, UnitHost  # noqa: E402
from rlgraph.runtime.dataplane.wire import WATCH_S, Wire  # noqa: E402
from rlgraph.runtime.dataplane.base import (  # noqa: E402
    ColumnData,
    DataPlane,
    DataPlaneClient,
    DataPlaneDied,
    DataPlaneError,
    DataPlaneHandle,
    _Column,
    _nbytes,
    count_locality,
    dead_actors,
)

__all__ = [
    "TransferQueueConfig",
    "TransferQueueDataPlane",
    "TransferQueueHandle",
    "check_tq_resources",
    "tq_resource_problems",
]

CONTROLLER_NAME = "TransferQueueController"  # fixed by tq.init
CONTROLLER_NAMESPACE = "transfer_queue"
STORAGE_UNIT_NAME = "TransferQueueStorageUnit#{}"  # fixed by TQ's SimpleStorage bootstrap
CPUS_PER_TQ_ACTOR = 1  # @ray.remote(num_cpus=1) on TQ's controller and SimpleStorageUnit
HOMED_MANAGER = "RLGraphHomedSimpleStorage"  # our storage manager's name in TQ's factory


@dataclass(frozen=True)
class TransferQueueConfig:
    """What ``TransferQueueDataPlane.start`` starts and how long it waits."""

    num_storage_units: int = 2
    """SimpleStorage units (Ray actors, 1 CPU each, round-robin over alive nodes)."""
    total_storage_size: int | None = None
    """Max rows held over all units; None = unlimited."""
    start_timeout_s: float = 120.0
    """Limit for ``tq.init`` (7-10 s on a 2-core machine)."""
    op_timeout_s: float = 60.0
    """Limit for each put/get/create/clear round trip."""
    shared_memory: bool = True
    """Large tensor columns through shared memory (`rlgraph.runtime.dataplane.shm`) when the Ray
    cluster has one node and this process is on it."""
    host_unit: bool = False
    """With one storage unit: run it in the controller's process (`unit.UnitHost`), not an actor of its own."""

    @property
    def unit_hosted(self) -> bool:
        return self.host_unit and self.num_storage_units == 1


# --------------------------------------------------------------------------- resources
def tq_resource_problems(
    num_storage_units: int, available_cpus: float, node_cpus: Mapping[str, float]
) -> list[str]:
    """Why TQ would not start, or []. Pure (tested without Ray).

    ``node_cpus``: total CPUs of each alive node. TQ pins storage unit ``i`` to the ``i % n``-th
    alive node (sorted by id) with a hard node affinity, so each node must fit its share too.
    """
    problems = []
    if num_storage_units < 1:
        problems.append(f"num_storage_units must be >= 1, got {num_storage_units}")
        return problems
    need = CPUS_PER_TQ_ACTOR * (1 + num_storage_units)
    if available_cpus < need:
        problems.append(
            f"TransferQueue needs {need} free CPUs (1 for its controller + 1 per storage unit x "
            f"{num_storage_units}; TQ hard-codes num_cpus=1 per actor) but the Ray cluster has "
            f"{available_cpus:g} free: missing {need - available_cpus:g} CPU. Fix: start Ray with "
            f"more num_cpus (logical CPUs may exceed cores), lower num_storage_units, or free "
            f"CPUs held by other actors"
        )
    nodes = sorted(node_cpus)
    if not nodes:
        problems.append("the Ray cluster has no alive nodes")
        return problems
    for k, node in enumerate(nodes):
        units = len(range(k, num_storage_units, len(nodes)))
        if units * CPUS_PER_TQ_ACTOR > node_cpus[node]:
            problems.append(
                f"node {node[:12]} gets {units} TransferQueue storage units (TQ pins them "
                f"round-robin) but has {node_cpus[node]:g} CPUs in total: missing "
                f"{units * CPUS_PER_TQ_ACTOR - node_cpus[node]:g} CPU there"
            )
    return problems


def check_tq_resources(num_storage_units: int) -> None:
    """Raise `DataPlaneError` listing every missing resource if TQ cannot start in the
    connected Ray cluster; starting it anyway would hang."""
    if not ray.is_initialized():
        raise DataPlaneError("TransferQueue needs Ray: call ray.init() first")
    nodes = {n["NodeID"]: float(n.get("Resources", {}).get("CPU", 0)) for n in ray.nodes() if n.get("Alive")}
    problems = tq_resource_problems(num_storage_units, float(ray.available_resources().get("CPU", 0)), nodes)
    if problems:
        raise DataPlaneError("cannot start TransferQueue:\n" + "\n".join(f"  - {p}" for p in problems))


# --------------------------------------------------------------------------- routing
@StorageManagerFactory.register(HOMED_MANAGER)
class _HomedStorageManager(AsyncSimpleStorageManager):
    """TQ's SimpleStorage manager, routing each row to its home unit instead of ``g % units``.

    A row's home (a unit rank: ``TransferQueueStorageUnit#<rank>``) is written by the driver into
    the row's custom metadata when it creates the partition; every put, get and clear carries
    that metadata, and the manager learns ``global index -> home`` from it before routing. A
    global index is unique among live rows and gets its new home before its first use after a
    reuse, so the table is always right for the batch at hand. Rows with no home keep TQ's rule.
    """

    def __init__(self, controller_info: Any, config: Any, zmq_context: Any = None) -> None:
        super().__init__(controller_info, config, zmq_context=zmq_context)
        infos = config.get("zmq_info", None) or {}
        by_name = {str(name): info.id for name, info in infos.items()} if hasattr(infos, "items") else {}
        ranked = [by_name.get(STORAGE_UNIT_NAME.format(i)) for i in range(len(self.storage_unit_infos))]
        # unit rank -> its storage id (TQ's bootstrap names units by rank; fall back to its order)
        self.unit_ids: list[str] = ranked if all(ranked) else list(self.storage_unit_infos)
        self._home: dict[int, int] = {}
        self._wire_: Wire | None = None  # put and get requests, sent from the calling thread
        self._wire_lock = threading.Lock()

    def learn(self, global_indexes: list[int], custom_meta: list[dict[str, Any]]) -> None:
        """Remember the home unit of each row whose custom metadata names one."""
        for g, m in zip(global_indexes, custom_meta):
            unit = m.get("unit") if m else None
            if unit is None:
                self._home.pop(g, None)
            else:
                self._home[g] = int(unit)

    def unit_of(self, global_index: int) -> int:
        """The rank of the unit that stores `global_index`."""
        return self._home.get(global_index, global_index % len(self.unit_ids))

    def _learn(self, metadata: "BatchMeta | _Rows") -> None:
        if len(self.unit_ids) == 1:  # one unit: nothing to route
            return
        custom = list(getattr(metadata, "custom_meta", None) or [])
        if len(custom) == len(metadata.global_indexes):
            self.learn(list(metadata.global_indexes), custom)

    async def put_data(self, data: TensorDict, metadata: BatchMeta, data_parser: Any = None) -> None:
        self._learn(metadata)
        await super().put_data(data, metadata, data_parser)

    async def get_data(self, metadata: BatchMeta) -> TensorDict:
        self._learn(metadata)
        return await super().get_data(metadata)

    async def clear_data(self, metadata: "BatchMeta | _Rows") -> None:
        self._learn(metadata)
        await super().clear_data(metadata)

    def put_cells(self, metadata: "BatchMeta | _Rows", cells: dict[str, list[bytes]], timeout_s: float, what: str,
                  watch: Callable[[], list[str]] | None = None, during: Callable[[], None] | None = None) -> None:
        """Store encoded cells (`rlgraph.runtime.dataplane.cells`), each row on its home unit,
        from the calling thread (`wire`).

        TQ's own ``put_data`` takes a TensorDict and then tells the controller which fields each
        row now has (a round trip per put). rlgraph does not read the controller's production
        status (its scheduler knows what is ready), and a clear takes every row of the partition
        from the controller's key table whatever was written, so only the units are sent to.
        `during` runs while the units store the cells (`Wire.put`)."""
        self._learn(metadata)
        routing = self._group_by_hash(metadata.global_indexes)
        self._wire().put({unit: (group.global_indexes, cells if len(routing) == 1 else
                                 {f: [v[p] for p in group.batch_positions] for f, v in cells.items()})
                          for unit, group in routing.items()}, timeout_s, what, watch, during)

    def clear_cells(self, metadata: "BatchMeta | _Rows", timeout_s: float, what: str,
                    watch: Callable[[], list[str]] | None = None) -> None:
        """Drop the rows of `metadata` from their units, from the calling thread (`wire`): TQ's own
        ``clear_data`` without a hop to the event loop's thread."""
        self._learn(metadata)
        routing = self._group_by_hash(metadata.global_indexes)
        self._wire().clear({unit: group.global_indexes for unit, group in routing.items()}, timeout_s, what, watch)

    def get_cells(self, metadata: "BatchMeta | _Rows", fields: list[str], timeout_s: float, what: str,
                  watch: Callable[[], list[str]] | None = None) -> dict[str, list[Any]]:
        """The stored cells of `fields` for the rows of `metadata`, in its row order."""
        self._learn(metadata)
        routing = self._group_by_hash(metadata.global_indexes)
        results = self._wire().get({unit: (group.global_indexes, fields) for unit, group in routing.items()},
                                   timeout_s, what, watch)
        if len(routing) == 1:
            data = next(iter(results.values()))
            return {f: list(data[f]) for f in fields}
        out: dict[str, list[Any]] = {f: [None] * len(metadata.global_indexes) for f in fields}
        for unit, group in routing.items():
            data = results[unit]
            for f in fields:
                column, values = out[f], data[f]
                for i, p in enumerate(group.batch_positions):
                    column[p] = values[i]
        return out

    def _wire(self) -> Wire:
        if self._wire_ is None:
            with self._wire_lock:  # a worker's call thread and its control thread may both get here first
                if self._wire_ is None:
                    self._wire_ = Wire(self.storage_manager_id, self.storage_unit_infos)
        return self._wire_

    def close(self) -> None:
        if getattr(self, "_wire_", None) is not None:
            self._wire_.close()
            self._wire_ = None
        super().close()

    def _group_by_hash(self, global_indexes: list[int]) -> dict[str, RoutingGroup]:
        if len(self.unit_ids) == 1:  # one unit (one per node, on one node): every row goes there
            return {self.unit_ids[0]: RoutingGroup(list(global_indexes), list(range(len(global_indexes))))}
        gis: dict[str, list[int]] = {}
        pos: dict[str, list[int]] = {}
        for p, g in enumerate(global_indexes):
            key = self.unit_ids[self.unit_of(g)]
            gis.setdefault(key, []).append(g)
            pos.setdefault(key, []).append(p)
        return {key: RoutingGroup(gis[key], pos[key]) for key in gis}


class _Rows:
    """Rows' addresses for a put or a get: what `_HomedStorageManager` reads of a ``BatchMeta``. The
    custom metadata (each row's tag) is made only when read: with one storage unit nothing reads it."""

    __slots__ = ("global_indexes", "_custom", "_rows", "_homes")

    def __init__(self, global_indexes: list[int], custom_meta: list[dict[str, Any]] | None = None,
                 rows: Sequence[int] = (), homes: Sequence[int | None] = ()) -> None:
        self.global_indexes = global_indexes
        self._custom, self._rows, self._homes = custom_meta, rows, homes

    @property
    def custom_meta(self) -> list[dict[str, Any]]:
        if self._custom is None:
            self._custom = [_tag(int(r), h) for r, h in zip(self._rows, self._homes, strict=True)]
        return self._custom

    @property
    def size(self) -> int:
        return len(self.global_indexes)


_BLOCK = "rlgraph:block:"  # the TQ partitions whose rows `create_partition(..., lookup=False)` reuses
_ASKED_KEPT = 64  # row sets a client remembers the addresses of, per partition


def _tag(row: int, home: int | None) -> dict[str, Any]:
    """A row's custom metadata on TQ's controller: its row number, and its home unit if it has one."""
    return {"row": row} if home is None else {"row": row, "unit": home}


# --------------------------------------------------------------------------- client
class _Loop:
    """An event loop on a daemon thread; ``run`` waits for a coroutine with a timeout."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Awaitable[Any], timeout: float, what: str,
            watch: Callable[[], list[str]] | None = None) -> Any:
        """`coro`'s result, waiting up to `timeout`; `watch` (the names of dead plane actors) is
        asked every `WATCH_S` meanwhile, and a death ends the wait with `DataPlaneDied`."""
        fut = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self.loop)
        while True:
            # asked whether it is done, not timed out of `result`: since Python 3.11 the future's own
            # TimeoutError (the coroutine ran past `timeout`) and a wait's are the same class
            done, _ = concurrent.futures.wait([fut], timeout=WATCH_S if watch is not None else None)
            if done:
                try:
                    return fut.result()
                except asyncio.TimeoutError:
                    raise DataPlaneError(f"timed out after {timeout}s waiting for TransferQueue to {what}") from None
            dead = watch() if watch is not None else []
            if dead:
                fut.cancel()
                raise DataPlaneDied(dead, f"waiting for TransferQueue to {what}") from None

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5.0)
        if not self.thread.is_alive():
            self.loop.close()


def _actor_nodes(actors: list[Any]) -> tuple[str, ...]:
    """The Ray node id of each actor (from the control store; () when one is not known)."""
    from ray._private import state

    nodes = []
    for handle in actors:
        try:
            info = state.actors(actor_id=handle._actor_id.hex())
            nodes.append(info["Address"]["NodeID"])
        except Exception:  # an older Ray's layout: no locality counts, nothing else changes
            return ()
    return tuple(nodes)


class _TQClient(DataPlaneClient):
    """Worker side: an ``AsyncTransferQueueClient`` (TQ's public async client) on our loop for the
    controller's requests; puts and gets leave from the calling thread (`wire`)."""

    def __init__(self, controller: Any, op_timeout_s: float, unit_nodes: tuple[str, ...] = (), secret: str = "",
                 shm_prefix: str = "") -> None:
        if secret:  # the plane's sockets admit only clients presenting it (`guard`)
            guard.install(secret)
        self._timeout = op_timeout_s
        # the node of each storage unit (by rank) and ours: for the bytes that stay on this node and
        # those that cross to another
        self._unit_nodes = unit_nodes
        self._node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        self._watch: Callable[[], list[str]] | None = None  # the driver's: names of dead plane actors
        own_timeouts(op_timeout_s)
        try:
            conf = ray.get(controller.get_config.remote(), timeout=op_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise DataPlaneError(
                f"timed out after {op_timeout_s}s waiting for the TransferQueue controller's config"
            ) from None
        if conf is None:
            raise DataPlaneError("the TransferQueue controller has no config yet: is tq.init still running?")
        client_id = f"rlgraph_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        self._client = AsyncTransferQueueClient(client_id=client_id, controller_info=conf.controller.zmq_info)
        backend = conf.backend.storage_backend
        if backend != "SimpleStorage":
            self._client.close()
            raise DataPlaneError(f"rlgraph runs TransferQueue's SimpleStorage backend; this controller has {backend!r}")
        try:  # handshakes with the controller (TQ_STORAGE_HANDSHAKE_TIMEOUT, 30 s by default)
            self._client.initialize_storage_manager(manager_type=HOMED_MANAGER, config=conf.backend[backend])
        except Exception as e:
            self._client.close()
            raise DataPlaneError(f"could not connect to TransferQueue's storage: {e}") from e
        self._manager: _HomedStorageManager = self._client.storage_manager
        self._rows: dict[str, dict[int, tuple[int, dict[str, Any]]]] = {}  # partition -> row -> (index, custom)
        # partition -> rows -> their addresses as `_meta` last built them: an op's chunk is put and got
        # with the same rows several times (1,024 rows: 0.13 ms to build, 0.01 ms to find); read-only
        self._asked: dict[str, dict[tuple[int, ...], _Rows]] = {}
        # partition -> rows -> (global indexes, homes) the driver sent with a call (`learn`), not yet in `_rows`
        self._learned: dict[str, dict[tuple[int, ...], tuple[Sequence[int], Sequence[int | None]]]] = {}
        self._loop: _Loop | None = _Loop(f"{client_id}_loop")
        # large tensor columns through shared memory, on a one-machine plane (`shm`)
        self._segments: shm.Segments | None = shm.Segments(shm_prefix) if shm_prefix else None

    def _run(self, coro: Awaitable[Any], what: str, nbytes: int = 0) -> Any:
        return self._loop.run(coro, self._op_timeout(nbytes), what, self._watch)

    def _op_timeout(self, nbytes: int = 0) -> float:
        # a large payload gets longer than the op timeout: at least 20 MB/s on top of it
        return self._timeout + nbytes / 20e6

    def _meta(self, partition: str, rows: tuple[int, ...]) -> "_Rows":
        """The addresses of `rows` of `partition` (what a put's or a get's routing reads of a TQ
        ``BatchMeta``, without building one: 0.3 ms for 1,024 rows): their global indexes, looked up by key on the
        controller the first time this client meets a row, then remembered until the partition is
        forgotten (`forget`, sent when the driver clears it: a partition created again under the
        same name may give its rows other indexes)."""
        asked = self._asked.get(partition)
        if asked is not None:
            meta = asked.get(rows)
            if meta is not None:
                return meta
        learned = self._learned.get(partition)
        if learned is not None:
            given = learned.get(rows)
            if given is not None:  # the rows the driver sent with this call: as it gave them, no lookup per row
                return self._asked_for(partition, rows, _Rows(list(given[0]), rows=rows, homes=given[1]))
            self._learn_rows(partition)
        own = self._own_addresses(partition, rows)
        if own is not None:  # a partition this plane created: its table
            return self._asked_for(partition, rows, _Rows(own[0], rows=rows, homes=own[1]))
        known = self._rows.setdefault(partition, {})
        pick = operator.itemgetter(*rows) if len(rows) > 1 else (lambda d: (d[rows[0]],))
        try:
            pairs = pick(known)
        except KeyError:
            pairs = None
        new = [r for r in rows if r not in known] if pairs is None else []
        if new:
            found = self._run(
                self._client.async_kv_retrieve_meta([str(r) for r in new], partition, create=False),
                f"look up rows of partition {partition!r}",
            )
            if found.size != len(new):
                have = set(self._run(self._client.async_kv_retrieve_keys(list(found.global_indexes), partition),
                                     f"name the rows found in partition {partition!r}")) if found.size else set()
                missing = [r for r in new if str(r) not in have]
                raise DataPlaneError(
                    f"rows {missing[:8]}{'...' if len(missing) > 8 else ''} are not in partition "
                    f"{partition!r}; call create_partition with enough rows first"
                )
            custom = list(found.custom_meta or ())
            if len(custom) != len(new):  # writing made-up metadata back would erase the rows' homes
                raise DataPlaneError(f"TransferQueue returned metadata for {len(custom)} of {len(new)} rows of "
                                     f"partition {partition!r}; it was created by another client or changed since")
            known.update(zip(new, zip(found.global_indexes, custom)))
            pairs = pick(known)
        indexes, custom = zip(*pairs)
        return self._asked_for(partition, rows, _Rows(list(indexes), list(custom)))

    def _own_addresses(self, partition: str, rows: tuple[int, ...]) -> tuple[list[int], list[int | None]] | None:
        """The addresses of `rows` where this client made the partition (the driver's plane), else None."""
        return None

    def _asked_for(self, partition: str, rows: tuple[int, ...], meta: _Rows) -> _Rows:
        asked = self._asked.setdefault(partition, {})
        if len(asked) >= _ASKED_KEPT:
            del asked[next(iter(asked))]  # the oldest
        asked[rows] = meta
        return meta

    def forget(self, partition: str) -> None:
        self._rows.pop(partition, None)
        self._asked.pop(partition, None)
        self._learned.pop(partition, None)
        if self._segments is not None:
            self._segments.forget(partition)

    def learn(self, partition: str, rows: Sequence[int], addresses: Any) -> None:
        """`addresses`: (global indexes, home units or None) of `rows`, from the driver's
        `TransferQueueDataPlane.addresses`; it replaces what this client knew of those rows. Kept as
        given, for the call's puts and gets of exactly these rows (1,024 rows: 0.43 ms to enter one by
        one into the row table); entered into the table only when another set of rows is looked up."""
        if addresses is None:
            return
        indexes, homes = addresses
        rows = tuple(rows)
        if len(indexes) != len(rows) or len(homes) != len(rows):
            raise DataPlaneError(f"partition {partition!r}: addresses of {len(indexes)} rows ({len(homes)} homes) "
                                 f"for {len(rows)} rows")
        self._asked.pop(partition, None)
        learned = self._learned.setdefault(partition, {})
        learned.pop(rows, None)  # the newest last: entered into the table after the others
        learned[rows] = (indexes, homes)

    def _learn_rows(self, partition: str) -> None:
        """Enter the addresses learned for `partition` into its row table, oldest first."""
        known = self._rows.setdefault(partition, {})
        for rows, (indexes, homes) in self._learned.pop(partition, {}).items():
            for r, index, home in zip(rows, indexes, homes):
                known[int(r)] = (int(index), _tag(int(r), home))

    def _put(self, partition: str, rows: tuple[int, ...], columns: dict[str, _Column]) -> None:
        meta = self._meta(partition, rows)
        # the large columns' room in shared memory first: their cells go to the storage unit, and
        # their bytes are copied in while it stores them (no reader learns of the rows before the put returns)
        placed = self._segments.place(partition, columns) if self._segments is not None else None
        shared = placed.cells if placed is not None else {}
        encoded = {name: shared[name] if name in shared else cells.encode(col) for name, col in columns.items()}
        self._manager.put_cells(meta, encoded, self._op_timeout(sum(sum(map(len, column)) for column in encoded.values())),
                                f"put columns {sorted(columns)} to partition {partition!r}", self._watch,
                                placed.write if placed is not None else None)
        if self._segments is not None:  # one node: every byte is local; a shared column's are its rows'
            count_locality(sum(_nbytes(columns[n].value) if n in shared else sum(map(len, c))
                               for n, c in encoded.items()), 0)
        else:
            self._count_locality(meta, encoded)

    def _count_locality(self, meta: BatchMeta, encoded: dict[str, list[Any]]) -> None:
        """Count each row's bytes as local or cross-node by the node of the unit that stores it."""
        if not self._unit_nodes or not self._node:
            return
        units = len(self._unit_nodes)
        per_row = [sum(sizes) for sizes in zip(*(cells.payload_nbytes(c) for c in encoded.values()))]
        local = sum(n for g, n in zip(meta.global_indexes, per_row)
                    if self._unit_nodes[self._manager.unit_of(g) % units] == self._node)
        count_locality(local, sum(per_row) - local)

    def _get(self, partition: str, rows: tuple[int, ...], columns: tuple[str, ...]) -> dict[str, ColumnData]:
        meta = self._meta(partition, rows)
        try:
            got = self._manager.get_cells(meta, list(columns), self._timeout,
                                          f"get columns {list(columns)} of partition {partition!r}", self._watch)
        except DataPlaneError:
            raise
        except Exception as e:  # TQ raises StorageKeyNotFoundError / RuntimeError for missing cells
            raise DataPlaneError(
                f"get columns {list(columns)} of partition {partition!r} failed, most likely a column was "
                f"never written for some of rows {list(rows)[:8]}; get only what an op upstream has put. "
                f"TransferQueue said: {e}"
            ) from None
        out = {c: cells.decode(got[c], self._segments) for c in columns}
        if self._segments is not None:  # one node: every byte is local
            count_locality(sum(_nbytes(out[c]) if cells.any_shared(got[c]) else sum(map(len, got[c]))
                               for c in columns), 0)
        else:
            self._count_locality(meta, got)
        return out

    def close(self) -> None:
        if self._loop is None:
            return
        self._loop.stop()
        self._client.close()
        self._loop = None
        if self._segments is not None:
            self._segments.close()


@dataclass(frozen=True)
class TransferQueueHandle(DataPlaneHandle):
    """Picklable: the controller's actor handle; ``connect()`` reads its config and opens a client."""

    controller: Any
    op_timeout_s: float = 60.0
    unit_nodes: tuple[str, ...] = ()  # the Ray node of each storage unit, in unit order
    secret: str = field(default="", repr=False)  # the plane's per-run secret (`guard`); travels only through Ray
    shm_prefix: str = ""  # the names of the plane's shared-memory segments; "" when it uses none (`shm`)

    def connect(self) -> DataPlaneClient:
        return _TQClient(self.controller, self.op_timeout_s, self.unit_nodes, self.secret, self.shm_prefix)


class TransferQueueDataPlane(_TQClient, DataPlane):
    """Driver side of the TransferQueue backend. ``start()`` runs ``tq.init`` (the controller and
    SimpleStorage units); ``close()`` runs ``tq.close``."""

    def __init__(self, controller: Any, config: TransferQueueConfig, secret: str = "") -> None:
        self._shm_prefix = _shm_prefix(config)
        super().__init__(controller, config.op_timeout_s, secret=secret, shm_prefix=self._shm_prefix)
        self._secret = secret
        self._controller = controller
        self.config = config
        self._actors = {"TransferQueue controller": controller}
        for i in range(config.num_storage_units):
            try:
                self._actors[f"TransferQueue storage unit {i}"] = ray.get_actor(STORAGE_UNIT_NAME.format(i))
            except ValueError:  # another TQ layout: the controller is still watched
                pass
        self._watch = lambda: dead_actors(self._actors)
        self._created: set[str] = set()  # partitions this plane created and has not cleared
        self._on_block: set[str] = set()  # of them, those on a block's rows (`_create_on_block`)
        self._free: dict[int, collections.deque[list[int]]] = {}  # row count -> free blocks' global indexes
        self._blocks = itertools.count()
        # partition -> (global index, home or None) of each row, by row, for the partitions it created: its own
        # puts' and gets' addresses and the workers' (`addresses`)
        self._tables: dict[str, tuple[list[int], list[int | None]]] = {}
        units = [controller] if config.unit_hosted else [
            self._actors.get(f"TransferQueue storage unit {i}") for i in range(config.num_storage_units)]
        self._unit_nodes = _actor_nodes(units) if all(units) else ()
        self._owner_pid = os.getpid()
        self._closed = False

    @classmethod
    def start(cls, config: TransferQueueConfig | None = None) -> "TransferQueueDataPlane":
        """Check resources, start TQ in the connected Ray cluster, return the driver side."""
        config = config or TransferQueueConfig()
        if not ray.is_initialized():
            raise DataPlaneError("TransferQueueDataPlane.start() needs Ray: call ray.init() first")
        try:
            ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
        except ValueError:
            pass
        else:
            raise DataPlaneError(
                f"a TransferQueue controller ({CONTROLLER_NAME!r} in namespace {CONTROLLER_NAMESPACE!r}) "
                f"already runs in this Ray cluster and TQ allows one; close the plane that started it, "
                f"or connect to it with that plane's handle().connect()"
            )
        check_tq_resources(config.num_storage_units)
        secret = guard.new_secret()
        guard.install(secret)  # this process's TQ client (tq.init makes one) presents it
        _run_tq_init(config, secret)
        controller = ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
        try:
            return cls(controller, config, secret)
        except BaseException:
            tq.close()
            raise

    def create_partition(self, partition: str, num_rows: int, homes: Sequence[int] | None = None,
                         lookup: bool = True) -> None:
        if num_rows < 1:
            raise DataPlaneError(f"partition {partition!r}: num_rows must be >= 1, got {num_rows}")
        homes = self._check_homes(partition, num_rows, homes)
        if partition in self._created:  # only this plane creates partitions (TQ allows one plane per cluster)
            raise DataPlaneError(f"partition {partition!r} already exists; clear it before creating it again")
        if partition.startswith(_BLOCK):
            raise DataPlaneError(f"partition {partition!r}: names starting {_BLOCK!r} are the plane's own")
        if not lookup:
            self._create_on_block(partition, num_rows, homes)
            return
        meta = self._run(
            self._client.async_kv_retrieve_meta([str(i) for i in range(num_rows)], partition, create=True),
            f"register {num_rows} rows of partition {partition!r}",
        )
        tags = [_tag(i, None if homes is None else homes[i]) for i in range(num_rows)]
        if homes is not None and self.config.num_storage_units > 1:
            # the homes, for a client that looks rows up (`_TQClient._meta`) and routes by them
            meta.update_custom_meta(tags)
            self._run(self._client.async_set_custom_meta(meta), f"tag rows of partition {partition!r}")
        # else nothing to tell the controller (a round trip of 26 ms for 4,096 rows): a client finds
        # a row by its key, str(row), and one unit, or TQ's own rule, needs no home
        self._manager.learn(list(meta.global_indexes), tags)
        self._created.add(partition)
        # the driver knows its rows: it asks nothing before its own puts and gets (`_own_addresses`), and
        # hands them to the workers with each call (`addresses`), so theirs ask nothing either
        self._tables[partition] = (list(meta.global_indexes), [None] * num_rows if homes is None else list(homes))
        self._asked.pop(partition, None)

    def _create_on_block(self, partition: str, num_rows: int, homes: list[int] | None) -> None:
        """`create_partition` for clients that are given its rows' addresses: the rows of a block
        (a TQ partition of the plane's own, of `num_rows` keys) that a cleared partition freed, the
        longest free first, as TQ reuses global indexes; the controller is asked only for a block
        of a size not met before. Its clear drops the rows from their units and frees the block,
        with no request to the controller: a step's partition costs no round trip to it (two,
        each ~1 ms of the driver's and ~1 ms of the controller's CPU a step, with its event loop's
        hop)."""
        free = self._free.get(num_rows)
        if free:
            indexes = free.popleft()
        else:
            block = f"{_BLOCK}{next(self._blocks)}"
            meta = self._run(
                self._client.async_kv_retrieve_meta([str(i) for i in range(num_rows)], block, create=True),
                f"register {num_rows} rows of partition {partition!r}",
            )
            indexes = list(meta.global_indexes)
        self._manager.learn(indexes, [_tag(i, None if homes is None else homes[i]) for i in range(num_rows)])
        self._created.add(partition)
        self._on_block.add(partition)
        self._tables[partition] = (indexes, [None] * num_rows if homes is None else list(homes))
        self._asked.pop(partition, None)

    def addresses(self, partition: str, rows: Sequence[int]) -> tuple[list[int], list[int | None]] | None:
        """(global indexes, home units or None) of `rows`, for the workers' `learn`; None when this
        plane does not know them all (a partition it did not create, or one cleared)."""
        table = self._tables.get(partition)
        if table is None:
            return None
        indexes, homes = table
        if not rows:
            return [], []
        if len(rows) == 1:
            r = int(rows[0])
            return ([indexes[r]], [homes[r]]) if 0 <= r < len(indexes) else None
        if min(rows) < 0 or max(rows) >= len(indexes):
            return None
        pick = operator.itemgetter(*rows)  # one C call a list, not a lookup per row (1,024 rows: 0.23 ms)
        return list(pick(indexes)), list(pick(homes))

    def _own_addresses(self, partition: str, rows: tuple[int, ...]) -> tuple[list[int], list[int | None]] | None:
        return self.addresses(partition, rows)

    def _check_homes(self, partition: str, num_rows: int, homes: Sequence[int] | None) -> list[int] | None:
        if homes is None:
            return None
        homes = [int(h) for h in homes]
        units = self.config.num_storage_units
        if len(homes) != num_rows:
            raise DataPlaneError(f"partition {partition!r}: {len(homes)} homes for {num_rows} rows; give one per row")
        bad = sorted({h for h in homes if not 0 <= h < units})
        if bad:
            raise DataPlaneError(f"partition {partition!r}: homes {bad} are not storage units (0..{units - 1})")
        return homes

    def storage_nodes(self) -> tuple[str, ...]:
        return tuple(self._unit_nodes)

    def clear(self, partition: str) -> None:
        if partition in self._on_block:
            self._clear_block(partition)
            return
        table = self._tables.pop(partition, None)
        self.forget(partition)
        if table is None:  # a partition this plane did not create: TQ finds its rows
            self._run(self._client.async_clear_partition(partition), f"clear partition {partition!r}")
        else:
            indexes, homes = table
            self._run(self._clear_known(partition, _Rows(indexes, rows=range(len(indexes)), homes=homes)),
                      f"clear partition {partition!r}")
        self._created.discard(partition)

    def _clear_block(self, partition: str) -> None:
        """Clear a partition on a block's rows (`_create_on_block`): its rows dropped from their units,
        then the block freed. A clear that fails keeps the partition as it was (its rows may still hold
        cells; a later clear sends it again), and its block is never handed to another."""
        indexes, homes = self._tables[partition]
        self.forget(partition)
        self._manager.clear_cells(_Rows(indexes, rows=range(len(indexes)), homes=homes), self._op_timeout(),
                                  f"clear partition {partition!r}", self._watch)
        del self._tables[partition]
        self._on_block.discard(partition)
        self._created.discard(partition)
        self._free.setdefault(len(indexes), collections.deque()).append(indexes)  # freed once the units answered

    async def _clear_known(self, partition: str, meta: _Rows) -> None:
        """Clear a partition whose rows this plane knows (it created it): the storage units' rows and
        the controller's partition at once, one round trip. TQ's own clear makes four in turn (the
        partition's rows asked of the controller, their production status zeroed for TQ's consumers,
        which rlgraph does not use, the units, the controller): 4.9 ms of the driver's time a step.
        The rows' indexes are free for a new partition only once both have answered."""
        await asyncio.gather(self._client.storage_manager.clear_data(meta),  # type: ignore[arg-type]
                             self._client._clear_partition_in_controller(partition))  # TQ's own request

    def handle(self) -> TransferQueueHandle:
        return TransferQueueHandle(self._controller, self.config.op_timeout_s, self._unit_nodes, self._secret,
                                   self._shm_prefix)

    def actors(self) -> dict[str, Any]:
        return dict(self._actors)

    def guest_host(self) -> Any:
        return self._controller

    def close(self) -> None:
        if self._closed or os.getpid() != self._owner_pid:
            return
        self._closed = True
        try:
            super().close()
            tq.close()
        finally:
            if self._shm_prefix:
                shm.remove_all(self._shm_prefix)

    def uses_shared_memory(self) -> bool:
        return bool(self._shm_prefix)


def _shm_prefix(config: TransferQueueConfig) -> str:
    """The segment names of a new plane, or "" when it uses no shared memory: turned off, no
    ``/dev/shm``, or a Ray cluster of more than one node (a segment lives on one machine). Sweeps
    away the segments of drivers that died without cleaning up."""
    if not config.shared_memory or not shm.available():
        return ""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) != 1 or nodes[0].get("NodeID") != ray.get_runtime_context().get_node_id():
        return ""
    shm.sweep()
    return shm.prefix_for(os.getpid(), uuid.uuid4().hex[:12])


def own_timeouts(op_timeout_s: float) -> None:
    """rlgraph's timeouts for TransferQueue's storage requests, not the library's (200 s per
    attempt, 3 attempts): one attempt of at most the run's op timeout. The step is what rlgraph
    retries, and a dead storage unit is seen by the runner's watch within seconds. TQ reads these
    module settings when a client connects and on each request."""
    from transfer_queue.storage.managers import simple_storage_manager as ssm

    ssm.TQ_SIMPLE_STORAGE_SEND_RECV_TIMEOUT = max(1, int(op_timeout_s))
    ssm.TQ_SIMPLE_STORAGE_MAX_ATTEMPTS = 1


def _run_tq_init(config: TransferQueueConfig, secret: str) -> None:
    """``tq.init`` under a timeout. It waits on Ray actors without one; if they never start we
    kill what it created, which makes its pending ``ray.get`` fail and frees its thread. TQ's
    controller and storage units start as `guard.guarded_actor_class`es: their sockets admit only
    processes presenting `secret`, and each unit is served by one thread (`unit.DirectUnit`); the
    controller can host a guest (`guest.GuestHost`)."""
    import transfer_queue.interface as tq_interface
    from transfer_queue.storage.bootstrap import simple_storage_bootstrap as tq_bootstrap

    originals = {tq_interface: tq_interface.TransferQueueController, tq_bootstrap: tq_bootstrap.SimpleStorageUnit}
    # the controller can host a guest (`guest`: the data source, dataplane.host_source) and the unit
    hosts = (GuestHost, UnitHost) if config.unit_hosted else (GuestHost,)
    tq_interface.TransferQueueController = guard.guarded_actor_class(originals[tq_interface], secret, hosts)
    tq_bootstrap.SimpleStorageUnit = guard.guarded_actor_class(originals[tq_bootstrap], secret, (DirectUnit,))
    try:
        units = (_HostedUnit if config.unit_hosted else _EarlyUnits)(_tq_conf(config), config.start_timeout_s)
        with units.installed():  # its exit waits for the units' thread: the guarded class is still the one used
            _tq_init_with_timeout(config)
    finally:
        tq_interface.TransferQueueController = originals[tq_interface]
        tq_bootstrap.SimpleStorageUnit = originals[tq_bootstrap]


def _tq_conf(config: TransferQueueConfig) -> dict[str, Any]:
    """The settings rlgraph gives ``tq.init`` (merged there over TQ's own config.yaml)."""
    return {"backend": {"SimpleStorage": {
        "num_data_storage_units": config.num_storage_units,
        "total_storage_size": config.total_storage_size,
    }}}


class _EarlyUnits:
    """TQ's ``tq.init`` starts its storage units only once its controller is up (it waits for the
    controller's address first), so at start-up, when every new process competes for the CPU,
    the units' start follows the controller's. Nothing of the units' own depends on the
    controller: this starts them beside it, with TQ's own SimpleStorage bootstrap on a thread and
    the config ``tq.init`` would give it, and hands them to ``tq.init`` when it asks its storage
    provider for them."""

    def __init__(self, conf: dict[str, Any], timeout_s: float) -> None:
        from importlib import resources

        from omegaconf import OmegaConf

        self.timeout_s = timeout_s
        # as tq.init merges it: TQ's defaults, then rlgraph's settings
        self.conf = OmegaConf.merge(OmegaConf.create({}, flags={"allow_objects": True}),
                                    OmegaConf.load(resources.files("transfer_queue") / "config.yaml"), conf)
        self.handles: Any = None
        self.error: BaseException | None = None
        self.handed = False  # tq.init took the units (else they are killed when `installed` ends)
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        from transfer_queue.storage.bootstrap import StorageBootstrapProvider

        providers = StorageBootstrapProvider._providers
        key = str(self.conf.backend.storage_backend).lower()
        original = providers.get(key)
        # another backend, or RLGRAPH_TQ_EARLY_UNITS=0 (TQ's own order; the start-up benchmark's baseline):
        # tq.init starts the units as it does
        if key != "simplestorage" or original is None or os.environ.get("RLGRAPH_TQ_EARLY_UNITS", "1") == "0":
            yield
            return
        self._thread = threading.Thread(target=self._start, args=(original,), name="rlgraph_tq_units", daemon=True)
        self._thread.start()
        providers[key] = self._provide
        try:
            yield
        finally:
            providers[key] = original
            # tq.init failed or took another way (another controller was found): the units must not
            # outlive it. Their thread ends once they are up, or once tq.init's failure path killed them
            self._thread.join(min(self.timeout_s, 30.0))
            if not self.handed and self.handles:
                for handle in self.handles.values():
                    with contextlib.suppress(Exception):
                        ray.kill(handle)

    def _start(self, bootstrap: Callable[[Any], Any]) -> None:
        try:  # creates the units, then waits for each one's address (TQ's process_zmq_server_info)
            self.handles = bootstrap(self.conf)
        except BaseException as e:  # given to tq.init's thread when it asks for the units
            self.error = e

    def _provide(self, final_conf: Any) -> Any:
        """tq.init's storage provider: the units started early, their addresses in its config."""
        assert self._thread is not None
        self._thread.join(self.timeout_s)
        if self._thread.is_alive():
            raise DataPlaneError(f"TransferQueue's storage units did not start within {self.timeout_s}s")
        if self.error is not None:
            raise self.error
        ours, theirs = dict(self.conf.backend.SimpleStorage), dict(final_conf.backend.SimpleStorage)
        ours.pop("zmq_info", None)
        theirs.pop("zmq_info", None)
        if ours != theirs:  # tq.init merged another config than the one the units were started with
            raise DataPlaneError(f"TransferQueue's storage units were started with {ours}, but tq.init asks for "
                                 f"{theirs}; this TransferQueue version merges its config differently")
        final_conf.backend.SimpleStorage.zmq_info = self.conf.backend.SimpleStorage.zmq_info
        self.handed = True
        return self.handles


class _HostedUnit:
    """tq.init's storage provider when the controller hosts the only unit (`unit.UnitHost`): asks
    the controller, up by then, to start it, and gives tq.init the controller as the unit's handle."""

    def __init__(self, conf: dict[str, Any], timeout_s: float) -> None:
        self.timeout_s = timeout_s

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        from transfer_queue.storage.bootstrap import StorageBootstrapProvider

        providers = StorageBootstrapProvider._providers
        original = providers.get("simplestorage")
        providers["simplestorage"] = self._provide
        try:
            yield
        finally:
            providers["simplestorage"] = original

    def _provide(self, final_conf: Any) -> Any:
        controller = ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
        unit_conf = {**dict(final_conf.backend.SimpleStorage), "_run_id": uuid.uuid4().hex}  # as TQ's bootstrap
        unit_conf.pop("zmq_info", None)
        name = STORAGE_UNIT_NAME.format(0)
        final_conf.backend.SimpleStorage.zmq_info = {
            name: ray.get(controller.unit_start.remote(unit_conf), timeout=self.timeout_s)}
        return {name: controller}


def _tq_init_with_timeout(config: TransferQueueConfig) -> None:
    conf = _tq_conf(config)
    outcome: dict[str, BaseException] = {}

    def target() -> None:
        try:
            tq.init(conf)
        except BaseException as e:  # reported below
            outcome["error"] = e

    thread = threading.Thread(target=target, name="rlgraph_tq_init", daemon=True)
    thread.start()
    thread.join(config.start_timeout_s)
    timed_out = thread.is_alive()
    if timed_out or "error" in outcome:
        names = [(CONTROLLER_NAME, CONTROLLER_NAMESPACE)]
        names += [(STORAGE_UNIT_NAME.format(i), None) for i in range(config.num_storage_units)]
        for name, namespace in names:
            try:
                ray.kill(ray.get_actor(name, namespace=namespace))
            except ValueError:
                pass
        thread.join(10.0)
        tq.close()
        if not timed_out:
            raise DataPlaneError(f"TransferQueue failed to start: {outcome['error']!r}") from outcome["error"]
        raise DataPlaneError(
            f"TransferQueue did not start within {config.start_timeout_s}s: waited for its controller "
            f"and {config.num_storage_units} storage units (1 CPU each) to come up; Ray resources "
            f"now: {ray.available_resources()}"
        )
