"""The data plane: both backends, same semantics, same data.

Ray and TransferQueue start once per session (tests/runtime/conftest.py); every test uses its
own partition name and clears it, so tests do not see each other's rows.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import ray
import numpy as np
import torch

from rlgraph.errors import RLGraphError
from rlgraph.runtime.dataplane import (
    DataPlaneError,
    TransferQueueDataPlane,
    assemble_rows,
    check_tq_resources,
    payload_bytes_in_this_process,
    tq_resource_problems,
)

# the actor classes below live in a test module workers cannot import: ship them by value
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _part() -> str:
    return f"step_{uuid.uuid4().hex[:8]}"


def _same(a, b) -> bool:
    """Equal values of the same representation (dense tensor vs list of tensors matters)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


RAGGED = [torch.arange(k, dtype=torch.int64) for k in (3, 1, 4, 2)]


# --------------------------------------------------------------------------- no Ray needed
def test_assemble_rows_is_dense_only_when_rows_agree():
    assert _same(assemble_rows([torch.ones(2), torch.zeros(2)]), torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    ragged = assemble_rows([torch.ones(2), torch.zeros(3)])
    assert isinstance(ragged, list) and [len(r) for r in ragged] == [2, 3]
    assert assemble_rows(["a", "b"]) == ["a", "b"]


def test_data_plane_error_is_an_rlgraph_error():
    assert issubclass(DataPlaneError, RLGraphError)


@pytest.mark.timeout(60)
def test_a_request_past_its_timeout_raises_rather_than_spinning():
    """The driver's TransferQueue requests wait on their event loop's thread: one whose coroutine
    runs past its timeout raises, naming what it waited for (since Python 3.11 the coroutine's
    TimeoutError is the class a wait's own timeout raises, and was once taken for "not done yet")."""
    import asyncio

    from rlgraph.runtime.dataplane.base import DataPlaneDied
    from rlgraph.runtime.dataplane.tq import _Loop

    loop = _Loop("test_loop")
    try:
        t0 = time.monotonic()
        with pytest.raises(DataPlaneError, match=r"timed out after 0.2s waiting for TransferQueue to clear x"):
            loop.run(asyncio.sleep(30), 0.2, "clear x")
        with pytest.raises(DataPlaneError, match=r"timed out after 0.2s"):
            loop.run(asyncio.sleep(30), 0.2, "clear x", watch=lambda: [])
        assert time.monotonic() - t0 < 10
        assert loop.run(asyncio.sleep(0, result=5), 5, "x") == 5
        with pytest.raises(DataPlaneDied, match="unit 0"):  # a dead actor ends the wait before the timeout
            loop.run(asyncio.sleep(30), 30, "clear x", watch=lambda: ["unit 0"])
    finally:
        loop.stop()


def test_tq_resource_problems_names_what_is_missing():
    assert tq_resource_problems(2, available_cpus=8, node_cpus={"a" * 20: 8}) == []
    (problem,) = tq_resource_problems(3, available_cpus=2, node_cpus={"n" * 20: 8})  # 6 CPUs held by others
    assert "needs 4 free CPUs" in problem and "missing 2 CPU" in problem and "num_storage_units" in problem
    # a 2-CPU single node: short overall, and too small for its 3 pinned storage units
    assert len(tq_resource_problems(3, available_cpus=2, node_cpus={"n" * 20: 2})) == 2
    # two nodes: units 0 and 2 go to the first (sorted) node, which has 1 CPU
    problems = tq_resource_problems(3, available_cpus=8, node_cpus={"node_a": 1, "node_b": 7})
    assert len(problems) == 1 and "node_a" in problems[0] and "gets 2" in problems[0]


# --------------------------------------------------------------------------- both backends
@pytest.mark.ray
def test_put_get_dense_ragged_strings(plane):
    p = _part()
    plane.create_partition(p, 4)
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    plane.put(p, [0, 1, 2, 3], {"x": x, "ragged": RAGGED, "text": ["a", "bb", "", "dd"],
                                "score": torch.tensor([0.5, 1.5, 2.5, 3.5])})
    out = plane.get(p, (0, 1, 2, 3), ["x", "ragged", "text", "score"])
    assert _same(out["x"], x)
    assert _same(out["ragged"], RAGGED)  # ragged comes back as a list of per-row tensors
    assert out["text"] == ["a", "bb", "", "dd"]
    assert _same(out["score"], torch.tensor([0.5, 1.5, 2.5, 3.5]))
    # a subset in any order; ragged rows that happen to agree come back dense
    sub = plane.get(p, (3, 0), ["x", "ragged"])
    assert _same(sub["x"], x[[3, 0]])
    assert _same(sub["ragged"], [RAGGED[3], RAGGED[0]])
    one = plane.get(p, (1,), ["ragged", "text"])
    assert _same(one["ragged"], RAGGED[1].unsqueeze(0)) and one["text"] == ["bb"]
    plane.clear(p)


@pytest.mark.ray
def test_columns_written_for_different_rows_are_read_back_per_row(plane):
    p = _part()
    plane.create_partition(p, 6)
    plane.put(p, [0, 1, 2, 3], {"a": torch.zeros(4, 2)})
    plane.put(p, [5, 3, 2], {"b": ["x", "y", "z"]})
    assert _same(plane.get(p, (2, 3), ["a", "b"]), {"a": torch.zeros(2, 2), "b": ["z", "y"]})
    plane.put(p, [2], {"a": torch.ones(1, 2)})  # rewriting a cell replaces it
    assert _same(plane.get(p, (3, 2), ["a"]), {"a": torch.tensor([[0.0, 0.0], [1.0, 1.0]])})
    with pytest.raises(DataPlaneError, match="never written"):
        plane.get(p, (4, 5), ["a", "b"])  # row 4 has no "b", row 5 no "a"
    plane.clear(p)


@pytest.mark.ray
def test_clear_drops_rows_and_data(plane):
    p = _part()
    plane.create_partition(p, 3)
    plane.put(p, [0, 1, 2], {"x": torch.ones(3)})
    plane.clear(p)
    with pytest.raises(DataPlaneError, match=repr(p)):
        plane.get(p, (0,), ["x"])
    plane.create_partition(p, 2)  # the name is free again; nothing of the old rows is left
    with pytest.raises(DataPlaneError):
        plane.get(p, (0,), ["x"])
    plane.put(p, [0, 1], {"x": torch.tensor([7.0, 8.0])})
    assert _same(plane.get(p, (0, 1), ["x"])["x"], torch.tensor([7.0, 8.0]))
    plane.clear(p)
    plane.clear("never_created")  # no-op


@pytest.mark.ray
def test_a_client_forgets_the_rows_of_a_cleared_partition(plane):
    # a worker's client remembers where a partition's rows live; the same name created again
    # after a clear (a replayed step) puts them elsewhere, and the client is told to forget
    client = plane.handle().connect()
    try:
        p, other = _part(), _part()
        plane.create_partition(p, 3)
        client.put(p, [0, 1, 2], {"x": torch.tensor([1.0, 2.0, 3.0])})
        assert _same(client.get(p, (0, 1, 2), ["x"])["x"], torch.tensor([1.0, 2.0, 3.0]))
        plane.clear(p)
        client.forget(p)
        plane.create_partition(other, 4)  # takes the freed indexes first
        plane.create_partition(p, 3)
        client.put(other, [0, 1, 2, 3], {"x": torch.zeros(4)})
        client.put(p, [0, 1, 2], {"x": torch.tensor([4.0, 5.0, 6.0])})
        assert _same(client.get(p, (0, 1, 2), ["x"])["x"], torch.tensor([4.0, 5.0, 6.0]))
        assert _same(plane.get(other, (0, 1, 2, 3), ["x"])["x"], torch.zeros(4))
        plane.clear(p)
        plane.clear(other)
    finally:
        client.close()


@pytest.mark.ray
def test_a_client_looking_rows_up_names_exactly_those_missing(plane):
    # a client that was not handed the rows' addresses finds them by key on the controller; some
    # there, some not: the error names the missing ones (TQ answers with the rows it has)
    client = plane.handle().connect()
    try:
        p = _part()
        plane.create_partition(p, 4)
        with pytest.raises(DataPlaneError, match=r"rows \[4, 9\][^\]]* are not in partition"):
            client.put(p, [1, 4, 2, 9], {"x": torch.ones(4)})
        client.put(p, [3, 1], {"x": torch.tensor([3.0, 1.0])})  # found by key, in the order asked
        assert _same(plane.get(p, (1, 3), ["x"])["x"], torch.tensor([1.0, 3.0]))
        plane.clear(p)
    finally:
        client.close()


@pytest.mark.ray
def test_misuse_raises_typed_errors(plane):
    p = _part()
    plane.create_partition(p, 3)
    with pytest.raises(DataPlaneError, match="already exists"):
        plane.create_partition(p, 3)
    with pytest.raises(DataPlaneError, match=r"rows \[5"):
        plane.put(p, [5], {"x": torch.ones(1)})
    with pytest.raises(DataPlaneError, match="column 'x': put for 2 rows got 3 rows"):
        plane.put(p, [0, 1], {"x": torch.ones(3)})
    with pytest.raises(DataPlaneError, match="column 'x': unsupported type dict"):
        plane.put(p, [0], {"x": {"a": 1}})
    with pytest.raises(DataPlaneError, match="duplicates"):
        plane.put(p, [0, 0], {"x": torch.ones(2)})
    plane.put(p, [0], {"x": torch.ones(1)})
    with pytest.raises(DataPlaneError, match="never written"):
        plane.get(p, (0, 1), ["x"])
    with pytest.raises(DataPlaneError, match="needs columns"):
        plane.get(p, (0,), [])
    plane.clear(p)


def test_rows_are_integers_each_once_none_negative_and_a_tuple_passed_is_not_checked_again():
    from rlgraph.runtime.dataplane.base import _check_rows

    rows = (3, 1, 2)
    assert _check_rows("p", rows) is rows and _check_rows("p", rows) is rows
    converted = _check_rows("p", [np.int64(2), torch.tensor(5), True])
    assert converted == (2, 5, 1) and all(type(r) is int for r in converted)
    assert _check_rows("p", range(3)) == (0, 1, 2)
    with pytest.raises(DataPlaneError, match="rows must be integers, got \\[1.5\\]"):
        _check_rows("p", [0, 1.5])
    twice = (0, 0)
    for _ in range(2):  # a tuple that failed is never taken for one checked
        with pytest.raises(DataPlaneError, match="duplicates"):
            _check_rows("p", twice)
    with pytest.raises(DataPlaneError, match="must be >= 0, got -1"):
        _check_rows("p", (1, -1))


@ray.remote(num_cpus=0)
class _Worker:
    """A stand-in for a worker-group actor: connects with the handle, puts or gets."""

    def put(self, handle, partition, rows, columns):
        client = handle.connect()
        try:
            client.put(partition, rows, columns)
        finally:
            client.close()
        return payload_bytes_in_this_process()

    def get(self, handle, partition, rows, columns):
        client = handle.connect()
        try:
            return client.get(partition, rows, columns)
        finally:
            client.close()


@pytest.fixture(scope="session")
def workers(ray_cluster):
    pair = [_Worker.remote(), _Worker.remote()]
    yield pair
    for w in pair:
        ray.kill(w)


@pytest.mark.ray
def test_put_in_one_actor_get_in_another_without_the_driver(plane, workers):
    producer, consumer = workers
    p = _part()
    plane.create_partition(p, 5)
    before = plane.payload_bytes_in_this_process()
    x = torch.randn(5, 16)
    ragged = RAGGED + [torch.ones(2, dtype=torch.int64)]
    put_bytes = ray.get(producer.put.remote(plane.handle(), p, list(range(5)),
                                            {"x": x, "text": list("abcde"), "ragged": ragged}))
    assert put_bytes >= x.numel() * 4  # counted in the producer's process
    # the driver passes row ids only
    out = ray.get(consumer.get.remote(plane.handle(), p, (0, 1, 2, 3, 4), ["x", "text", "ragged"]))
    assert _same(out["x"], x) and out["text"] == list("abcde")
    assert _same(out["ragged"], ragged)
    assert plane.payload_bytes_in_this_process() == before  # no payload went through the driver
    plane.clear(p)


@pytest.mark.ray
@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this machine")
def test_large_columns_cross_processes_through_shared_memory(tq_plane, workers):
    """On one node the plane writes large tensor columns into /dev/shm and TransferQueue keeps their
    descriptors; a writer that has closed its client leaves its rows readable until the clear."""
    from rlgraph.runtime.dataplane import TransferQueueConfig, shm
    from rlgraph.runtime.dataplane.tq import _shm_prefix

    assert tq_plane.uses_shared_memory()  # the test cluster has one node
    assert _shm_prefix(TransferQueueConfig(shared_memory=False)) == ""
    producer, consumer = workers
    p = _part()
    tq_plane.create_partition(p, 8)
    big = torch.randn(8, 8192)  # 256 KiB
    ragged = [torch.arange(1000 * (i + 1), dtype=torch.int32) for i in range(8)]
    before = set(os.listdir(shm.SHM_DIR))
    ray.get(producer.put.remote(tq_plane.handle(), p, list(range(8)),
                                {"big": big, "ragged": ragged, "small": torch.ones(8)}))
    made = [n for n in set(os.listdir(shm.SHM_DIR)) - before if n.startswith(tq_plane._shm_prefix + "-")]
    assert len(made) == 1  # one segment for the put's two large columns
    out = ray.get(consumer.get.remote(tq_plane.handle(), p, (7, 0, 3), ["big", "ragged", "small"]))
    assert _same(out["big"], big[[7, 0, 3]]) and _same(out["small"], torch.ones(3))
    assert _same(out["ragged"], [ragged[7], ragged[0], ragged[3]])
    from rlgraph.runtime.dataplane.base import locality_bytes_in_this_process

    local = locality_bytes_in_this_process()[0]
    assert _same(tq_plane.get(p, tuple(range(8)), ["big"])["big"], big)  # the driver reads them too
    # the bytes the get moved are the rows', not their descriptors'
    assert locality_bytes_in_this_process()[0] - local == big.numel() * 4
    tq_plane.clear(p)


def _unit_keys(plane) -> list[int]:
    """Rows held by each TransferQueue storage unit, in unit order (the units' own counters)."""
    manager = plane._manager
    return [plane._run(manager._probe_storage_unit(target_storage_unit=uid), "probe")["active_keys"]
            for uid in manager.unit_ids]


@pytest.mark.ray
def test_tq_rows_are_stored_on_their_home_unit_by_every_client(tq_plane, workers):
    producer, consumer = workers
    p = _part()
    before = _unit_keys(tq_plane)
    homes = [1, 1, 0, 1, 1, 0]  # TransferQueue's own rule would put half of them on each unit
    tq_plane.create_partition(p, 6, homes=homes)
    x = torch.arange(12.0).view(6, 2)
    ray.get(producer.put.remote(tq_plane.handle(), p, list(range(6)), {"x": x, "t": list("abcdef")}))
    after = _unit_keys(tq_plane)
    assert [a - b for a, b in zip(after, before)] == [2, 4]
    # another process reads them (routing by the homes it finds in the rows' metadata), in any order
    out = ray.get(consumer.get.remote(tq_plane.handle(), p, (5, 0, 3), ["x", "t"]))
    assert _same(out["x"], x[[5, 0, 3]]) and out["t"] == ["f", "a", "d"]
    tq_plane.clear(p)  # the clear goes to the same units: nothing is left behind
    assert _unit_keys(tq_plane) == before
    # a partition without homes keeps TransferQueue's rule (global index modulo units)
    tq_plane.create_partition(p, 4)
    tq_plane.put(p, [0, 1, 2, 3], {"x": torch.zeros(4)})
    assert sum(_unit_keys(tq_plane)) - sum(before) == 4
    tq_plane.clear(p)
    with pytest.raises(DataPlaneError, match="homes \\[2\\] are not storage units"):
        tq_plane.create_partition(p, 2, homes=[0, 2])
    with pytest.raises(DataPlaneError, match="3 homes for 2 rows"):
        tq_plane.create_partition(p, 2, homes=[0, 1, 1])


@pytest.mark.ray
def test_a_client_on_the_units_machine_goes_by_their_links_and_one_with_links_off_by_zmq(tq_plane, monkeypatch):
    """Both reach the same storage: what one puts, the other reads (`rlgraph.runtime.dataplane.link`)."""
    from rlgraph.runtime.dataplane import link

    p = _part()
    tq_plane.create_partition(p, 6)
    x = torch.randn(6, 4)
    linked, by_zmq = tq_plane.handle().connect(), tq_plane.handle().connect()
    try:
        linked.put(p, [0, 1, 2], {"x": x[:3], "t": list("abc")})
        monkeypatch.setenv(link.ENV, "0")  # read when a client's first request makes its wire
        by_zmq.put(p, [3, 4, 5], {"x": x[3:], "t": list("def")})
        monkeypatch.delenv(link.ENV)
        for client in (linked, by_zmq):
            out = client.get(p, (5, 0, 1, 2, 3, 4), ["x", "t"])
            assert _same(out["x"], x[[5, 0, 1, 2, 3, 4]]) and out["t"] == list("fabcde")
        with_link, without = linked._manager._wire(), by_zmq._manager._wire()
        # the rows lie on both units (TQ's rule: global index modulo units), each reached by its link
        assert sorted(with_link._links._idle) == sorted(linked._manager.unit_ids) and not with_link._links._unlinked
        assert not any(with_link._pool._idle.values())  # no ZMQ socket was leased
        assert not without._links._idle and any(without._pool._idle.values())  # by ZMQ alone
    finally:
        linked.close()
        by_zmq.close()
        tq_plane.clear(p)


@pytest.mark.ray
def test_a_client_given_the_driver_s_addresses_asks_the_controller_nothing(tq_plane):
    # the driver hands each call the rows' addresses (global index, home unit); the worker's put
    # and get then go straight to the storage units, to the rows' homes, with no lookup
    client = tq_plane.handle().connect()
    try:
        p = _part()
        before = _unit_keys(tq_plane)
        tq_plane.create_partition(p, 4, homes=[1, 1, 0, 1])
        where = tq_plane.addresses(p, [3, 0, 2])
        assert where is not None and where[1] == [1, 1, 0]
        every = tq_plane.addresses(p, range(4))
        assert [every[0][r] for r in (3, 0, 2)] == where[0] and every[1] == [1, 1, 0, 1]
        assert tq_plane.addresses(p, [1]) == ([every[0][1]], [1])
        assert tq_plane.addresses(p, [4]) is None and tq_plane.addresses(p, [0, -1]) is None  # not its rows
        with pytest.raises(DataPlaneError, match="addresses of 3 rows"):
            client.learn(p, [3, 0], where)
        client.learn(p, [3, 0, 2], where)
        lookups = []
        real = client._client.async_kv_retrieve_meta
        client._client.async_kv_retrieve_meta = lambda *a, **k: lookups.append(a) or real(*a, **k)
        client.put(p, [3, 0, 2], {"x": torch.tensor([3.0, 0.0, 2.0])})
        assert _same(client.get(p, (0, 2, 3), ["x"])["x"], torch.tensor([0.0, 2.0, 3.0]))
        assert lookups == []
        assert [a - b for a, b in zip(_unit_keys(tq_plane), before)] == [1, 2]
        assert _same(tq_plane.get(p, (3,), ["x"])["x"], torch.tensor([3.0]))  # the driver's own view agrees
        with pytest.raises(DataPlaneError, match="never written"):
            client.get(p, (1,), ["x"])  # a row it was not told about: looked up, then found unwritten
        assert len(lookups) == 1
        with pytest.raises(DataPlaneError, match="never written"):
            client.get(p, (1, 0), ["x"])  # the addresses of rows (1, 0), remembered together: learn replaces them
        tq_plane.clear(p)
        assert tq_plane.addresses(p, [0]) is None  # a cleared partition has no addresses
        tq_plane.create_partition(p, 2)  # rows without a home: TransferQueue's own rule places them
        where = tq_plane.addresses(p, [1, 0])
        assert where is not None and where[1] == [None, None]
        client.learn(p, [1, 0], where)
        client.put(p, [1, 0], {"x": torch.tensor([1.0, 0.0])})
        assert _same(tq_plane.get(p, (0, 1), ["x"])["x"], torch.tensor([0.0, 1.0])) and len(lookups) == 1
        tq_plane.clear(p)
    finally:
        client.close()


@pytest.mark.ray
def test_a_partition_no_client_looks_up_takes_a_cleared_one_s_rows_without_asking_the_controller(tq_plane):
    # a step's partition (lookup=False: every client is handed its rows' addresses) lies on the rows of
    # one cleared before, with no request to TQ's controller; nothing of the old rows can be read through it
    client = tq_plane.handle().connect()
    try:
        p, q, r = _part(), _part(), _part()
        before = _unit_keys(tq_plane)
        tq_plane.create_partition(p, 4, homes=[1, 1, 0, 1], lookup=False)
        first = tq_plane.addresses(p, range(4))
        client.learn(p, range(4), first)
        client.put(p, [0, 1, 2, 3], {"x": torch.arange(4.0), "t": list("abcd")})
        assert _same(tq_plane.get(p, (3, 0), ["x"])["x"], torch.tensor([3.0, 0.0]))
        assert [a - b for a, b in zip(_unit_keys(tq_plane), before)] == [1, 3]
        tq_plane.clear(p)
        client.forget(p)
        assert _unit_keys(tq_plane) == before  # dropped from their units
        asked = []
        real = tq_plane._client.async_kv_retrieve_meta
        tq_plane._client.async_kv_retrieve_meta = lambda *a, **k: asked.append(a) or real(*a, **k)
        try:
            tq_plane.create_partition(q, 4, homes=[0, 0, 0, 0], lookup=False)
            assert asked == []
            again = tq_plane.addresses(q, range(4))
            assert sorted(again[0]) == sorted(first[0]) and again[1] == [0, 0, 0, 0]
            client.learn(q, range(4), again)
            with pytest.raises(DataPlaneError, match="never written"):
                client.get(q, (0,), ["x"])
            client.put(q, [0, 1, 2, 3], {"x": torch.ones(4)})
            assert [a - b for a, b in zip(_unit_keys(tq_plane), before)] == [4, 0]  # at their new homes
            assert _same(tq_plane.get(q, (0, 1, 2, 3), ["x"])["x"], torch.ones(4))
            tq_plane.create_partition(r, 3, lookup=False)  # a size not met before: rows of its own
            assert len(asked) == 1 and not set(tq_plane.addresses(r, range(3))[0]) & set(first[0])
        finally:
            tq_plane._client.async_kv_retrieve_meta = real
        stranger = tq_plane.handle().connect()  # a client not given the addresses
        try:
            with pytest.raises(DataPlaneError, match="are not in partition"):
                stranger.get(q, (0,), ["x"])
        finally:
            stranger.close()
        with pytest.raises(DataPlaneError, match="the plane's own"):
            tq_plane.create_partition("rlgraph:block:0", 2)
        tq_plane.clear(q)
        tq_plane.clear(r)
        assert _unit_keys(tq_plane) == before
    finally:
        client.close()



def test_a_failed_clear_of_a_partition_on_a_block_keeps_it_until_a_clear_succeeds(tq_plane):
    # a clear whose units did not answer leaves the partition (its rows may still hold cells): its block
    # goes to no new partition, and the next clear drops the rows and frees it
    p, q, r = _part(), _part(), _part()
    before = _unit_keys(tq_plane)
    tq_plane.create_partition(p, 4, lookup=False)
    first = tq_plane.addresses(p, range(4))
    tq_plane.put(p, [0, 1, 2, 3], {"x": torch.arange(4.0)})
    real = tq_plane._manager.clear_cells

    def refused(*a, **k):
        raise DataPlaneError("storage unit gone")

    tq_plane._manager.clear_cells = refused
    try:
        with pytest.raises(DataPlaneError, match="storage unit gone"):
            tq_plane.clear(p)
    finally:
        tq_plane._manager.clear_cells = real
    with pytest.raises(DataPlaneError, match="already exists"):
        tq_plane.create_partition(p, 4, lookup=False)
    assert tq_plane.addresses(p, range(4)) == first
    tq_plane.create_partition(q, 4, lookup=False)  # not on p's rows
    assert not set(tq_plane.addresses(q, range(4))[0]) & set(first[0])
    tq_plane.clear(p)
    assert sum(_unit_keys(tq_plane)) == sum(before)  # p's rows dropped (q holds none)
    tq_plane.create_partition(r, 4, lookup=False)  # now on p's block
    assert tq_plane.addresses(r, range(4))[0] == first[0]
    tq_plane.clear(q)
    tq_plane.clear(r)
    assert _unit_keys(tq_plane) == before


def _scenario(plane, p):
    """Puts in several shapes and orders, then gets of several row subsets; returns everything read."""
    plane.create_partition(p, 8)
    seen = []
    plane.put(p, [4, 5, 6, 7], {"ids": torch.arange(8).reshape(4, 2), "text": ["e", "f", "g", "h"]})
    plane.put(p, [3, 1], {"ids": torch.tensor([[30, 31], [10, 11]]), "text": ["d", "b"]})
    plane.put(p, [0, 1, 2, 3, 4, 5, 6, 7], {"resp": [torch.arange(k % 3 + 1) for k in range(8)],
                                            "mask": torch.tensor([1, 0, 1, 1, 0, 1, 1, 0], dtype=torch.bool),
                                            "logp": torch.linspace(-1, 0, 8, dtype=torch.float64)})
    for rows, cols in [((1, 3, 4), ["ids", "resp"]), ((5, 6, 7), ["ids", "resp"]), ((1, 3), ["text"]),
                       ((4, 5, 6, 7), ["text", "mask"]), ((7, 1), ["resp", "mask", "logp"])]:
        seen.append(plane.get(p, rows, cols))
    plane.put(p, [0, 2], {"ids": torch.tensor([[0, 1], [2, 3]]), "text": ["a", "c"]})
    seen.append(plane.get(p, tuple(range(8)), ["ids", "text", "resp", "logp"]))
    plane.clear(p)
    return seen


@pytest.mark.ray
def test_backends_return_identical_results(tq_plane, ray_plane):
    from_tq = _scenario(tq_plane, _part())
    from_ray = _scenario(ray_plane, _part())
    assert len(from_tq) == len(from_ray) == 6
    for a, b in zip(from_tq, from_ray):
        assert _same(a, b), (a, b)
    assert from_tq[2] == {"text": ["b", "d"]} and _same(from_tq[0]["ids"], torch.tensor([[10, 11], [30, 31], [0, 1]]))


# --------------------------------------------------------------------------- TransferQueue only
@pytest.mark.ray
def test_tq_listens_on_loopback_only(tq_plane):
    info = ray.get(tq_plane.handle().controller.get_zmq_server_info.remote())
    assert info.ip == "127.0.0.1"
    assert ray.util.get_node_ip_address() == "127.0.0.1"


@pytest.mark.ray
def test_tq_missing_resources_raise_instead_of_hanging(tq_plane):
    t0 = time.perf_counter()
    with pytest.raises(DataPlaneError, match=r"needs 51 free CPUs .* missing"):
        check_tq_resources(num_storage_units=50)
    assert time.perf_counter() - t0 < 5
    with pytest.raises(DataPlaneError, match="already runs in this Ray cluster"):
        TransferQueueDataPlane.start()


@pytest.mark.ray
def test_tq_start_times_out_with_a_message(tmp_path):
    """Bypass the resource check in a fresh Ray (2 CPUs) and ask for 3 storage units: tq.init
    would wait forever; start's watchdog must stop it and say what it waited for."""
    script = textwrap.dedent("""
        import os, ray
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
        from rlgraph.runtime.dataplane import DataPlaneError, TransferQueueConfig
        from rlgraph.runtime.dataplane.tq import _run_tq_init
        try:
            _run_tq_init(TransferQueueConfig(num_storage_units=3, start_timeout_s=2), "x" * 32)
        except DataPlaneError as e:
            print("ERROR:", e)
        ray.shutdown()
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90, env=env)
    assert "ERROR: TransferQueue did not start within 2s" in res.stdout, res.stdout + res.stderr[-2000:]


def test_row_nbytes_splits_a_column_per_row():
    import torch

    from rlgraph.runtime.dataplane.base import row_nbytes

    assert row_nbytes(torch.zeros(3, 4, dtype=torch.float32), 3) == [16, 16, 16]
    ragged = [torch.zeros(2, dtype=torch.int64), torch.zeros(5, dtype=torch.int64)]
    assert row_nbytes(ragged, 2) == [16, 40]
    assert row_nbytes(torch.nested.nested_tensor(ragged, layout=torch.jagged), 2) == [16, 40]
    assert row_nbytes(["ab", "\u00e9"], 2) == [2, 2]


def test_a_column_s_bytes_are_counted_alike_whether_its_rows_are_of_one_type_or_mixed():
    # `_nbytes` counts a column of one type of row without a test per row; the count is the per-row one
    import torch

    from rlgraph.runtime.dataplane import cells
    from rlgraph.runtime.dataplane.base import _nbytes

    def per_row(value):
        return sum(v.numel() * v.element_size() if isinstance(v, torch.Tensor) else len(v.encode())
                   if isinstance(v, str) else len(v) if isinstance(v, bytes) else 0 for v in value)

    columns = [["ab", "\u00e9", ""], [b"xyz", b""], [torch.zeros(2, dtype=torch.int64), torch.zeros(3, 2)[:, 0]],
               [{"a": 1}, {"b": [2]}], [1, 2.5, None, True], [[1, 2], (3,)], ["ab", b"cd", torch.zeros(4), {"e": 5}],
               [torch.zeros(3, dtype=torch.int8), "\u00e9\u00e9"], []]
    for column in columns:
        assert _nbytes(column) == per_row(column), column
    assert cells.any_shared([b"s1", b"m2"]) and cells.any_shared([memoryview(b"m3")])
    assert not cells.any_shared([b"s1", b"t2"]) and not cells.any_shared([b"s1", b""]) and not cells.any_shared([])
    assert cells.any_shared([b"", b"m2"])


def test_storage_units_started_beside_the_controller_are_handed_to_tq_init_as_it_asks(monkeypatch):
    """`_EarlyUnits` starts TQ's storage units beside its controller (TQ would start them after);
    tq.init's storage provider then gets those units, with their addresses in its config, but
    only if tq.init merged the very config they were started with."""
    import threading

    from omegaconf import OmegaConf

    from rlgraph.runtime.dataplane import tq as tq_mod
    from rlgraph.runtime.dataplane.tq import TransferQueueConfig, _EarlyUnits, _tq_conf

    started = []

    def bootstrap(conf):  # TQ's SimpleStorage bootstrap: creates the units, sets their addresses
        started.append(threading.current_thread().name)
        conf.backend.SimpleStorage.zmq_info = {"TransferQueueStorageUnit#0": "addr"}
        return {"TransferQueueStorageUnit#0": "handle"}

    from transfer_queue.storage.bootstrap import StorageBootstrapProvider

    providers = StorageBootstrapProvider._providers
    original = providers["simplestorage"]
    config = TransferQueueConfig(num_storage_units=1)
    try:
        providers["simplestorage"] = bootstrap
        early = _EarlyUnits(_tq_conf(config), timeout_s=10)
        with early.installed():
            final = early.conf.copy()
            final.backend.SimpleStorage.zmq_info = None
            assert StorageBootstrapProvider.get_provider("SimpleStorage")(final) == {"TransferQueueStorageUnit#0":
                                                                                      "handle"}
            assert final.backend.SimpleStorage.zmq_info == {"TransferQueueStorageUnit#0": "addr"}
            other = OmegaConf.merge(final, {"backend": {"SimpleStorage": {"num_data_storage_units": 2}}})
            with pytest.raises(DataPlaneError, match="were started with .* but tq.init asks for"):
                early._provide(other)
        assert started == ["rlgraph_tq_units"]
        assert StorageBootstrapProvider.get_provider("SimpleStorage") is bootstrap  # put back
        # tq.init that never asks for the units (it failed, or found another controller): they are killed
        killed = []
        monkeypatch.setattr(tq_mod.ray, "kill", killed.append)
        unasked = _EarlyUnits(_tq_conf(config), timeout_s=10)
        with unasked.installed():
            pass
        assert killed == ["handle"] and not unasked.handed
        assert early.handed  # the first one's units went to tq.init: left alone
    finally:
        providers["simplestorage"] = original
