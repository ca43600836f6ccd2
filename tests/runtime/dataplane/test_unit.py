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
