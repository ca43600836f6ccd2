"""`Wire`: storage requests from the calling thread, against stand-in storage units (ZMQ ROUTER
sockets made by TransferQueue's own socket factory, so the run's guard applies to them as it does
to TQ's units). The real units are exercised by every TransferQueue test in test_dataplane.py."""

from __future__ import annotations

import threading
import time

import pytest
import zmq
from transfer_queue.utils import zmq_utils
from transfer_queue.utils.enum_utils import Role
from transfer_queue.utils.zmq_utils import ZMQMessage, ZMQRequestType, ZMQServerInfo

from rlgraph.runtime.dataplane.base import DataPlaneDied, DataPlaneError
from rlgraph.runtime.dataplane.wire import Wire


class _Unit:
    """A stand-in storage unit: answers each request after `delay` s, echoing its body's ``tag``."""

    def __init__(self, name: str, delay: float = 0.0) -> None:
        self.name, self.delay = name, delay
        self.ctx = zmq.Context()
        self.sock = zmq_utils.create_zmq_socket(self.ctx, zmq.ROUTER, "127.0.0.1")
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.info = ZMQServerInfo(role=Role.STORAGE, id=name, ip="127.0.0.1", ports={"put_get_socket": port})
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            identity, *frames = self.sock.recv_multipart()
            request = ZMQMessage.deserialize(frames)
            if self.stop.wait(self.delay):
                return
            tag = request.body["global_indexes"]
            answer = ZMQMessage.create(request_type=ZMQRequestType.GET_DATA_RESPONSE, sender_id=self.name,
                                       body={"data": {"x": [self.name.encode(), bytes(tag)]}})
            self.sock.send_multipart([identity] + answer.serialize())

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def units():
    made: list[_Unit] = []
    yield lambda name, delay=0.0: made.append(_Unit(name, delay)) or made[-1]
    for u in made:
        u.close()


def _wire(*units: _Unit) -> Wire:
    # the units admit identities that start with a storage manager's prefix; ours do
    return Wire("TQ_STORAGE_test", {u.name: u.info for u in units})


def test_requests_to_several_units_go_out_together_and_each_answer_is_its_own(units):
    a, b = units("unit_a", delay=0.3), units("unit_b", delay=0.3)
    wire = _wire(a, b)
    try:
        t0 = time.monotonic()
        got = wire.get({"unit_a": ([1], ["x"]), "unit_b": ([2], ["x"])}, timeout_s=10, what="get x")
        took = time.monotonic() - t0
    finally:
        wire.close()
    assert got == {"unit_a": {"x": [b"unit_a", bytes([1])]}, "unit_b": {"x": [b"unit_b", bytes([2])]}}
    assert took < 0.55, f"the two requests waited one after the other ({took:.2f}s)"


def test_a_unit_that_does_not_answer_in_time_ends_the_wait_with_what_was_waited_for(units):
    slow = units("unit_slow", delay=1.0)
    wire = _wire(slow)
    try:
        with pytest.raises(DataPlaneError, match=r"timed out after 0s waiting for TransferQueue to get x .*unit_slow"):
            wire.get({"unit_slow": ([1], ["x"])}, timeout_s=0.2, what="get x")
    finally:
        wire.close()


def test_a_late_answer_is_never_read_as_the_next_request_s(units):
    """The socket of a timed-out request is closed; the next request gets a fresh one."""
    slow = units("unit_slow", delay=0.4)
    wire = _wire(slow)
    try:
        with pytest.raises(DataPlaneError):
            wire.get({"unit_slow": ([7], ["x"])}, timeout_s=0.1, what="get x")
        got = wire.get({"unit_slow": ([8], ["x"])}, timeout_s=10, what="get x")
    finally:
        wire.close()
    assert got["unit_slow"]["x"][1] == bytes([8])


def test_a_dead_plane_actor_ends_the_wait_at_once(units):
    """The driver's wait asks `watch` every WATCH_S; a death is a DataPlaneDied, not a timeout."""
    silent = units("unit_silent", delay=30.0)
    wire = _wire(silent)
    try:
        t0 = time.monotonic()
        with pytest.raises(DataPlaneDied, match="storage unit 0"):
            wire.get({"unit_silent": ([1], ["x"])}, timeout_s=60, what="get x",
                     watch=lambda: ["TransferQueue storage unit 0"])
        assert time.monotonic() - t0 < 3.0
    finally:
        wire.close()


def test_a_refused_put_names_the_unit(units):
    """A unit answering a put with anything but PUT_DATA_RESPONSE (here a get's answer) is an error."""
    unit = units("unit_a")
    wire = _wire(unit)
    try:
        with pytest.raises(DataPlaneError, match="storage unit unit_a refused to put x"):
            wire.put({"unit_a": ([1], {"x": [b"v"]})}, timeout_s=10, what="put x")
    finally:
        wire.close()


def test_a_broken_connection_is_named_as_such(units, monkeypatch):
    """A transport error is the data plane's, not "a column was never written"."""
    unit = units("unit_a")
    wire = _wire(unit)

    def broken(*args, **kwargs):
        raise zmq.ZMQError(zmq.EHOSTUNREACH)

    monkeypatch.setattr(zmq.Socket, "send_multipart", broken)
    try:
        with pytest.raises(DataPlaneError, match="connection to TransferQueue's storage failed while trying to get x"):
            wire.get({"unit_a": ([1], ["x"])}, timeout_s=5, what="get x")
    finally:
        monkeypatch.undo()
        wire.close()


def test_during_runs_while_the_unit_works_and_its_error_leaves_no_answer_behind(units):
    """A put's copy into shared memory (`during`) runs after its requests are sent, before the wait:
    a unit that takes 0.3 s and a `during` of 0.3 s take about 0.3 s together. If `during` raises, its
    error is the call's and the answer still on its way is never read as the next request's."""
    unit = units("unit_a", delay=0.3)
    wire = _wire(unit)
    seen = []
    try:
        t0 = time.monotonic()
        got = wire.exchange({"unit_a": ZMQMessage.create(request_type=ZMQRequestType.GET_DATA, sender_id="x",
                                                         receiver_id="unit_a", body={"global_indexes": [3]})},
                            timeout_s=10, what="get x", during=lambda: seen.append(time.sleep(0.3)))
        took = time.monotonic() - t0
        assert seen and got["unit_a"].body["data"]["x"][1] == bytes([3])
        assert took < 0.55, f"the unit waited for `during` ({took:.2f}s)"

        def fail() -> None:
            raise OSError("copy failed")

        with pytest.raises(OSError, match="copy failed"):
            wire.exchange({"unit_a": ZMQMessage.create(request_type=ZMQRequestType.GET_DATA, sender_id="x",
                                                       receiver_id="unit_a", body={"global_indexes": [4]})},
                          timeout_s=10, what="get x", during=fail)
        again = wire.get({"unit_a": ([5], ["x"])}, timeout_s=10, what="get x")
        assert again["unit_a"]["x"][1] == bytes([5])
    finally:
        wire.close()
