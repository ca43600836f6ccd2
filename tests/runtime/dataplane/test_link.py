"""Links: a storage unit's puts and gets over a Unix-domain socket on one machine
(`rlgraph.runtime.dataplane.link`), and a `Wire` that uses them where it can and ZMQ otherwise.
The real units' links are exercised by every TransferQueue test in test_dataplane.py."""

from __future__ import annotations

import socket
import threading
import time
import uuid

import pytest
from transfer_queue.utils.zmq_utils import ZMQMessage, ZMQRequestType

from rlgraph.runtime.dataplane import guard, link
from rlgraph.runtime.dataplane.base import DataPlaneDied, DataPlaneError

SECRET = "the-run-s-secret"


def _address() -> str:
    return link.address(f"TQ_STORAGE_UNIT_{uuid.uuid4().hex[:8]}", SECRET)


@pytest.fixture
def listeners():
    made: list[link.Listener] = []

    def make(answer, secret=SECRET, addr=None):
        made.append(link.Listener(addr or _address(), secret, answer, threading.Lock(), "unit_test"))
        return made[-1]

    yield make
    for one in made:
        one.close()


def _links(addr: str, secret: str = SECRET, watch_s: float = 0.2) -> link.Links:
    return link.Links(secret, lambda unit: addr, watch_s)


def _deadline(timeout_s: float, watch=None, watch_s: float = 0.2) -> link.Deadline:
    return link.Deadline(time.monotonic() + timeout_s, timeout_s, "get x", lambda: ["u"], watch, watch_s)


def test_a_link_carries_requests_and_answers_and_its_connection_is_reused(listeners):
    addr = _address()
    seen = []
    listeners(lambda frames: seen.append(len(frames)) or [b"re:" + bytes(f) for f in frames], addr=addr)
    links = _links(addr)
    try:
        conn = links.take("u")
        assert conn is not None
        for frames in ([b""], [b"small"], [bytes(range(256)) * 20_000], [b"a", b"", memoryview(b"bc")], []):
            link.send(conn, frames, _deadline(10))  # one frame: empty, short, 5 MB; several; none
            assert link.receive(conn, _deadline(10)) == [b"re:" + bytes(f) for f in frames]
        links.give("u", conn)
        assert links.take("u") is conn  # the idle connection, not a new one
        assert seen == [1, 1, 1, 3, 0]
    finally:
        links.close()


def test_a_message_half_read_when_a_read_times_out_is_read_on_and_the_wait_watches_meanwhile():
    ours, theirs = socket.socketpair()
    try:
        link.set_timeouts(ours, 0.1)
        watched = []
        wait = _deadline(10, watch=lambda: watched.append(1) or [], watch_s=0.1)
        framed = b"\x01\x00\x00\x00" + b"\x05\x00\x00\x00\x00\x00\x00\x00hello"

        def slowly():
            theirs.sendall(framed[:10])
            time.sleep(0.5)
            theirs.sendall(framed[10:])

        threading.Thread(target=slowly).start()
        assert link.receive(ours, wait) == [b"hello"]
        assert len(watched) >= 2  # asked each time a read timed out
    finally:
        ours.close()
        theirs.close()


def test_a_wait_ends_at_its_deadline_or_when_watch_names_a_dead_actor(listeners):
    addr = _address()
    listeners(lambda frames: time.sleep(3) or [b"late"], addr=addr)
    links = _links(addr)
    try:
        conn = links.take("u")
        link.send(conn, [b"x"])
        t0 = time.monotonic()
        with pytest.raises(DataPlaneError, match=r"timed out after 1s waiting for TransferQueue to get x "
                                                 r"\(no answer from storage units \['u'\]\)"):
            link.receive(conn, _deadline(0.6))
        assert time.monotonic() - t0 < 1.5
        links.drop("u", conn)  # its late answer must never be read
        conn = links.take("u")
        link.send(conn, [b"x"])
        with pytest.raises(DataPlaneDied, match="storage unit 0"):
            link.receive(conn, _deadline(10, watch=lambda: ["TransferQueue storage unit 0"]))
        links.drop("u", conn)
    finally:
        links.close()


def test_only_a_peer_with_the_run_s_secret_is_linked_either_way(listeners, caplog):
    addr = _address()
    answered = []
    listeners(lambda frames: answered.append(frames) or [b""], addr=addr)
    # a client with another secret: the unit refuses it, and the client goes by ZMQ
    stranger = _links(addr, secret="another-run")
    assert stranger.take("u") is None
    assert "u" in stranger._unlinked and stranger.take("u") is None  # not tried again
    # a process that sends a request where the proof goes: refused, closed, nothing read or proven
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.settimeout(5)
    raw.connect(addr)
    assert len(raw.recv(64)) == len(link._HELLO) + 32  # the unit's hello and nonce
    raw.sendall(link._HELLO + bytes(32) + b"a request where the proof goes".ljust(32))
    assert raw.recv(64) == b""  # closed, having sent nothing more
    raw.close()
    assert answered == []
    # something else holding a unit's address (it does not know the secret): the client refuses it
    squat = _address()
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(squat)
    squatter.listen(1)

    def pose():
        conn, _ = squatter.accept()
        conn.sendall(link._HELLO + bytes(32))
        conn.recv(200)
        conn.sendall(bytes(32))
        time.sleep(0.5)
        conn.close()

    threading.Thread(target=pose, daemon=True).start()
    fooled = _links(squat)
    with caplog.at_level("WARNING", logger=link.__name__):
        assert fooled.take("u") is None
    assert "does not know the run's secret" in caplog.text
    squatter.close()


def test_closing_a_listener_ends_its_connections_at_once(listeners):
    addr = _address()
    unit = listeners(lambda frames: time.sleep(5) or [b""], addr=addr)
    links = _links(addr, watch_s=1.0)
    conn = links.take("u")
    link.send(conn, [b"x"])
    time.sleep(0.2)
    threading.Timer(0.2, unit.close).start()
    t0 = time.monotonic()
    with pytest.raises(link.LinkClosed):
        link.receive(conn, _deadline(30, watch_s=1.0))
    assert time.monotonic() - t0 < 6  # the answer in progress finishes; nothing waits for the deadline
    links.drop("u", conn, unlink=True)
    assert links.take("u") is None  # reached by ZMQ from now on


def test_a_forked_child_does_not_reuse_its_parent_s_connections(listeners):
    addr = _address()
    listeners(lambda frames: [b"ok"], addr=addr)
    links = _links(addr)
    conn = links.take("u")
    links.give("u", conn)
    links._pid = -1  # as if this process were a child forked after the parent kept `conn`
    other = links.take("u")
    try:
        assert other is not None and other is not conn
        assert conn.fileno() == -1  # the parent's connection closed here: the unit sees the child let go
    finally:
        other.close()


def test_a_wire_sends_by_link_and_a_broken_link_sends_by_zmq_from_then_on(listeners, monkeypatch):
    """A `Wire` whose unit has a link uses it; when the link breaks mid-request, the request goes by
    ZMQ (to a stand-in unit) and so does every later one."""
    from tests.runtime.dataplane.test_wire import _Unit, _wire

    monkeypatch.setattr(guard, "installed_secret", lambda: SECRET)
    unit = _Unit("unit_a")
    calls = []

    def answer(frames):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a unit that dies while answering")
        return ZMQMessage.create(request_type=ZMQRequestType.GET_DATA_RESPONSE, sender_id="unit_a",
                                 body={"data": {"x": [b"by link"]}}).serialize()

    listeners(answer, addr=link.address("unit_a", SECRET))
    wire = _wire(unit)
    try:
        assert wire.get({"unit_a": ([7], ["x"])}, timeout_s=10, what="get x") == {"unit_a": {"x": [b"by link"]}}
        # the stand-in ZMQ unit echoes its name and the request's indexes
        assert wire.get({"unit_a": ([7], ["x"])}, timeout_s=10, what="get x") == \
            {"unit_a": {"x": [b"unit_a", bytes([7])]}}
        assert wire.get({"unit_a": ([8], ["x"])}, timeout_s=10, what="get x") == \
            {"unit_a": {"x": [b"unit_a", bytes([8])]}}
        assert len(calls) == 2
    finally:
        wire.close()
        unit.close()


def test_a_proof_is_good_only_for_the_address_it_was_made_for(listeners, caplog):
    """Each proof covers the unit's address and both nonces: one made for another unit's address (a
    process relaying between a unit and a client that meant another) is refused."""
    addr, other = _address(), _address()
    listeners(lambda frames: [b""], addr=addr)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(addr)
    with caplog.at_level("WARNING", logger=link.__name__), pytest.raises(link.LinkClosed):
        link._challenge_as_client(sock, SECRET.encode(), other)
    sock.close()
    assert "the client does not know the run's secret" in caplog.text
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(addr)
    link._challenge_as_client(sock, SECRET.encode(), addr)  # the right address: accepted
    sock.close()


def test_a_wire_never_reads_a_late_answer_as_the_next_request_s(listeners, monkeypatch):
    """A request that timed out (with a deadline shorter than the watch's second), or whose put's copy
    raised, leaves its connection closed: the next request gets its own answer."""
    from tests.runtime.dataplane.test_wire import _Unit, _wire

    monkeypatch.setattr(guard, "installed_secret", lambda: SECRET)
    unit = _Unit("unit_b")

    def answer(frames):
        request = ZMQMessage.deserialize(frames)
        tag = request.body["global_indexes"][0]
        if tag == 1:
            time.sleep(1.0)
        return ZMQMessage.create(request_type=ZMQRequestType.GET_DATA_RESPONSE, sender_id="unit_b",
                                 body={"data": {"x": [bytes([tag])]}}).serialize()

    listeners(answer, addr=link.address("unit_b", SECRET))
    wire = _wire(unit)
    try:
        with pytest.raises(DataPlaneError, match="timed out after 0s waiting for TransferQueue to get x"):
            wire.get({"unit_b": ([1], ["x"])}, timeout_s=0.3, what="get x")
        assert wire.get({"unit_b": ([2], ["x"])}, timeout_s=10, what="get x") == {"unit_b": {"x": [bytes([2])]}}

        def copy_fails():
            raise RuntimeError("the copy failed")

        with pytest.raises(RuntimeError, match="the copy failed"):
            wire.put({"unit_b": ([3], {"x": [b"v"]})}, timeout_s=10, what="put x", during=copy_fails)
        assert wire.get({"unit_b": ([4], ["x"])}, timeout_s=10, what="get x") == {"unit_b": {"x": [bytes([4])]}}
        assert not wire._links._unlinked  # still by link: nothing broke
    finally:
        wire.close()
        unit.close()
