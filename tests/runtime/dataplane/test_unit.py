"""`DirectUnit`: TransferQueue's storage unit served by one thread, with TQ's own handler."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from rlgraph.runtime.dataplane import unit as unit_mod
from rlgraph.runtime.dataplane.unit import DirectUnit

limit_pytorch_auto_parallel_threads = "TQ's thread cap"  # what the handlers below would call


class _FakeTQUnit:
    """The parts of TQ's SimpleStorageUnit that `DirectUnit` uses: its ROUTER socket, its
    shutdown event, its request handler, its handlers' module globals and its thread start."""

    proxy_started = False

    def __init__(self, ctx: zmq.Context) -> None:
        self.storage_unit_id = "TQ_STORAGE_UNIT_test"
        self.put_get_socket = ctx.socket(zmq.ROUTER)
        self.port = self.put_get_socket.bind_to_random_port("tcp://127.0.0.1")
        self._shutdown_event = threading.Event()
        self.handled: list[bytes] = []
        self.worker_thread = None

    def _start_process_put_get(self) -> None:
        _FakeTQUnit.proxy_started = True

    def _process_one_worker_request(self, socket, monitor) -> None:
        identity, *frames = socket.recv_multipart(copy=False)
        self.handled.append(bytes(frames[0]))
        if bytes(frames[0]) == b"break":
            raise RuntimeError("a request the handler cannot answer")
        socket.send_multipart([identity, b"answer:" + bytes(frames[0])], copy=False)

    def _handle_put(self):
        return limit_pytorch_auto_parallel_threads

    _handle_get = _handle_clear = _handle_put


class _Unit(DirectUnit, _FakeTQUnit):
    pass


def _client(ctx: zmq.Context, port: int, identity: bytes, timeout_ms: int = 2000) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, identity)
    s.setsockopt(zmq.RCVTIMEO, timeout_ms)
    s.connect(f"tcp://127.0.0.1:{port}")
    return s


def test_one_thread_answers_tq_clients_drops_others_and_stops_on_shutdown(monkeypatch):
    monkeypatch.delenv(unit_mod.ENV, raising=False)
    ctx = zmq.Context()
    u = _Unit(ctx)
    try:
        _FakeTQUnit.proxy_started = False
        u._start_process_put_get()
        assert not _FakeTQUnit.proxy_started and u.worker_thread.is_alive()
        # the handlers no longer cap torch's threads around each request
        assert u._handle_put() is unit_mod._no_thread_cap
        stranger = _client(ctx, u.port, b"someone_else", timeout_ms=300)
        stranger.send_multipart([b"hello"])
        tq = _client(ctx, u.port, b"TQ_STORAGE_client_1")
        tq.send_multipart([b"break"])  # the handler fails on it: the thread serves on
        tq.send_multipart([b"get"])
        assert tq.recv_multipart() == [b"answer:get"]
        assert u.handled == [b"break", b"get"]  # the stranger's request never reached the handler
        with pytest.raises(zmq.Again):
            stranger.recv_multipart()
        u._shutdown_event.set()
        t0 = time.monotonic()
        u.worker_thread.join(5)
        assert not u.worker_thread.is_alive() and time.monotonic() - t0 < 2.5
        for s in (stranger, tq):
            s.close(0)
    finally:
        u.put_get_socket.close(0)
        ctx.term()
        globals()["limit_pytorch_auto_parallel_threads"] = "TQ's thread cap"


def test_the_switch_keeps_tq_s_own_threads(monkeypatch):
    monkeypatch.setenv(unit_mod.ENV, "0")
    ctx = zmq.Context()
    u = _Unit(ctx)
    try:
        _FakeTQUnit.proxy_started = False
        u._start_process_put_get()
        assert _FakeTQUnit.proxy_started and u.worker_thread is None
        assert u._handle_put() == "TQ's thread cap"
    finally:
        u.put_get_socket.close(0)
        ctx.term()


def test_rlgraph_clients_requests_are_read_without_the_tensordict_walk_and_others_with_it():
    import torch
    from transfer_queue.utils.zmq_utils import ZMQMessage, ZMQRequestType

    from rlgraph.runtime.dataplane import wire

    message_class = unit_mod._message_class(ZMQMessage)
    assert unit_mod._message_class(message_class) is message_class  # patched once
    cells = [b"m\x08\x01abc", b"t\x08\x00"]
    marker = {"__tq_tensordict__": True, "batch_size": [2], "data": {"x": torch.arange(2)}}
    for sender, walked in ((f"manager_1{wire.SUFFIX}", False), ("TQ_STORAGE_client_2", True)):
        sent = ZMQMessage.create(request_type=ZMQRequestType.PUT_DATA, sender_id=sender, receiver_id="unit",
                                 body={"global_indexes": [3, 4], "data": {"x": cells}, "td": marker})
        got = message_class.deserialize(sent.serialize())
        assert got.request_type == ZMQRequestType.PUT_DATA and got.sender_id == sender
        assert got.body["global_indexes"] == [3, 4] and list(map(bytes, got.body["data"]["x"])) == cells
        assert isinstance(got.body["td"], dict) is not walked  # TQ's walk makes the marker a TensorDict
        if walked:
            assert torch.equal(got.body["td"]["x"], torch.arange(2))
    with pytest.raises(Exception, match="leading frame is empty"):
        message_class.deserialize([b""])


_Sent = unit_mod._Sent  # a socket that keeps what is sent on it


@pytest.fixture
def tq_unit():
    """TQ's own storage unit class with `DirectUnit` mixed in, as `UnitHost.unit_start` makes it."""
    from transfer_queue.storage.simple_storage import SimpleStorageUnit

    base = SimpleStorageUnit.__ray_metadata__.modified_class.__ray_actor_class__
    made = type("HostedStorageUnit", (DirectUnit, base), {})({"total_storage_size": 4, "num_data_storage_units": 1})
    yield made
    made.shutdown()


def test_an_rlgraph_client_s_put_and_get_are_answered_as_tq_s_handler_answers_them(tq_unit):
    """`DirectUnit._answer` against TQ's `_process_one_worker_request` on the same requests: the same
    answer kinds and bodies (errors word for word), the same stored cells and counts; anything that
    is not an rlgraph client's put or get is left to TQ's handler."""
    from transfer_queue.storage.simple_storage import IntervalPerfMonitor
    from transfer_queue.utils.zmq_utils import ZMQMessage, ZMQRequestType

    from rlgraph.runtime.dataplane import wire

    ours, theirs = f"TQ_STORAGE_MANAGER_1{wire.SUFFIX}", "TQ_STORAGE_MANAGER_1"
    identity = b"TQ_STORAGE_client"
    monitor = IntervalPerfMonitor(caller_name="test")

    def by_tq(kind, body):
        sent = _Sent()
        frames = ZMQMessage.create(request_type=kind, sender_id=ours, receiver_id="u", body=body).serialize()
        tq_unit._process_one_worker_request(unit_mod._Received(sent, [identity, *frames]), monitor)
        return sent.frames

    def by_ours(kind, body, sender=ours):
        sent = _Sent()
        answered = tq_unit._answer(sent, [identity, *wire.pack(kind, sender, "u", body)], monitor)
        return sent.frames if answered else None

    requests = [
        (ZMQRequestType.PUT_DATA, {"global_indexes": [0, 1], "data": {"x": [b"a", b"bc"], "y": [b"", b"d"]},
                                   "data_parser": None}),
        (ZMQRequestType.GET_DATA, {"global_indexes": [1, 0], "fields": ["y", "x"]}),
        (ZMQRequestType.GET_DATA, {"global_indexes": [3], "fields": ["x"]}),  # a row never put
        (ZMQRequestType.GET_DATA, {"global_indexes": [0], "fields": ["z"]}),  # a field never put
        (ZMQRequestType.PUT_DATA, {"global_indexes": [5, 6, 7], "data": {"x": [b"e", b"f", b"g"]},
                                   "data_parser": None}),  # beyond the unit's 4 rows
        (ZMQRequestType.PUT_DATA, {"global_indexes": [2], "data": {"x": [b"e", b"f"]}, "data_parser": None}),
    ]
    for kind, body in requests:
        arrived = tq_unit._requests_arrived
        answer = by_ours(kind, body)
        assert answer is not None and answer[0] == identity and len(answer) == 2
        assert tq_unit._requests_arrived == arrived + 1
        reference = by_tq(kind, body)
        mine, tq_s = ZMQMessage.deserialize(answer[1:]), ZMQMessage.deserialize(reference[1:])
        assert (mine.request_type, mine.sender_id, mine.receiver_id) == \
            (tq_s.request_type, tq_s.sender_id, tq_s.receiver_id), body
        assert mine.body == tq_s.body, body
    assert tq_unit._arrivals_by_op == {"PUT_DATA": 6, "GET_DATA": 6}
    assert tq_unit.storage_data.get_data(["x"], [0, 1]) == {"x": [b"a", b"bc"]}
    # left to TQ's handler: another sender, a put with a data parser, a clear, a frame that is not msgpack
    put = {"global_indexes": [0], "data": {"x": [b"a"]}, "data_parser": None}
    assert by_ours(ZMQRequestType.PUT_DATA, put, sender=theirs) is None
    assert by_ours(ZMQRequestType.PUT_DATA, {**put, "data_parser": "parse"}) is None
    assert by_ours(ZMQRequestType.CLEAR_DATA, {"global_indexes": [0]}) is None
    assert not tq_unit._answer(_Sent(), [identity, b"\xc1 not msgpack"], monitor)
    assert not tq_unit._answer(_Sent(), [identity, *wire.pack(ZMQRequestType.GET_DATA, ours, "u", put)[0:1], b"x"],
                               monitor)
    assert tq_unit._arrivals_by_op == {"PUT_DATA": 6, "GET_DATA": 6}


def test_a_request_by_link_is_answered_as_one_by_zmq(tq_unit, monkeypatch):
    """Puts and gets by rlgraph's path; anything else (a clear, a message of several frames) by TQ's own
    handler, as over ZMQ; an error outside the handlers is answered, as TQ's request loop answers it."""
    import torch
    from transfer_queue.utils.zmq_utils import ZMQMessage, ZMQRequestType

    from rlgraph.runtime.dataplane import wire

    ours = f"TQ_STORAGE_MANAGER_1{wire.SUFFIX}"

    def by_link(kind, body):
        frames = ZMQMessage.create(request_type=kind, sender_id=ours, receiver_id="u", body=body).serialize()
        return ZMQMessage.deserialize(tq_unit._answer_link([bytearray(memoryview(f)) for f in frames]))

    answer = by_link(ZMQRequestType.PUT_DATA, {"global_indexes": [0, 1], "data": {"x": [b"a", b"b"]},
                                               "data_parser": None})
    assert answer.request_type == ZMQRequestType.PUT_DATA_RESPONSE
    answer = by_link(ZMQRequestType.GET_DATA, {"global_indexes": [1, 0], "fields": ["x"]})
    assert answer.request_type == ZMQRequestType.GET_DATA_RESPONSE and answer.body == {"data": {"x": [b"b", b"a"]}}
    # a tensor cell (TQ's own clients put them): the put's message and the get's answer are several frames
    answer = by_link(ZMQRequestType.PUT_DATA, {"global_indexes": [2], "data": {"t": [torch.arange(3)]},
                                               "data_parser": None})
    assert answer.request_type == ZMQRequestType.PUT_DATA_RESPONSE
    answer = by_link(ZMQRequestType.GET_DATA, {"global_indexes": [2], "fields": ["t"]})
    assert torch.equal(answer.body["data"]["t"][0], torch.arange(3))
    answer = by_link(ZMQRequestType.CLEAR_DATA, {"global_indexes": [0]})
    assert answer.request_type == ZMQRequestType.CLEAR_DATA_RESPONSE
    assert tq_unit.storage_data.get_data(["x"], [1]) == {"x": [b"b"]}
    with pytest.raises(Exception):
        tq_unit.storage_data.get_data(["x"], [0])  # cleared by TQ's handler
    # an error outside the handlers (here the timing monitor's) is answered, not left unanswered

    class Broken:
        def measure(self, op_type):
            raise RuntimeError("the monitor broke")

    monkeypatch.setattr(tq_unit, "_monitor", Broken())
    answer = by_link(ZMQRequestType.GET_DATA, {"global_indexes": [1], "fields": ["x"]})
    assert answer.request_type == ZMQRequestType.PUT_GET_ERROR
    assert answer.body["message"] == (f"{tq_unit.storage_unit_id}, worker encountered error during operation "
                                      f"ZMQRequestType.GET_DATA: the monitor broke.")


def test_a_unit_s_link_answers_by_its_address_and_goes_with_its_shutdown(monkeypatch):
    """A unit started with the run's secret listens at its link address; its shutdown frees it."""
    from transfer_queue.storage.simple_storage import SimpleStorageUnit
    from transfer_queue.utils.zmq_utils import ZMQMessage, ZMQRequestType

    from rlgraph.runtime.dataplane import guard, link, wire

    monkeypatch.setattr(guard, "installed_secret", lambda: "unit-test-secret")
    base = SimpleStorageUnit.__ray_metadata__.modified_class.__ray_actor_class__
    made = type("HostedStorageUnit", (DirectUnit, base), {})({"total_storage_size": 4, "num_data_storage_units": 1})
    addr = link.address(made.storage_unit_id, "unit-test-secret")
    links = link.Links("unit-test-secret", lambda unit: addr, 1.0)
    try:
        conn = links.take("u")
        assert conn is not None
        link.send(conn, wire.pack(ZMQRequestType.GET_DATA, f"m{wire.SUFFIX}", "u",
                                  {"global_indexes": [0], "fields": ["x"]}))
        answer = ZMQMessage.deserialize(link.receive(conn))
        assert answer.request_type == ZMQRequestType.GET_ERROR  # nothing stored: TQ's "not found" answer
        links.give("u", conn)
    finally:
        made.shutdown()
        links.close()
    again = link.Listener(addr, "unit-test-secret", lambda frames: frames, threading.Lock(), "after")  # free again
    again.close()
