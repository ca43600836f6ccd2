"""TransferQueue's storage unit, served by one thread.

TQ's ``SimpleStorageUnit`` takes each request on a proxy thread (its ROUTER socket) and forwards
it over an inproc socket to a worker thread, which answers back through the proxy: every put and
get crosses two Python threads twice, a GIL hand-off each way. Around each request it also caps
torch's threads (``limit_pytorch_auto_parallel_threads``: ``psutil.cpu_count`` and two
``torch.set_num_threads``), for tensor aggregation that a unit storing rlgraph's cells never does
(they arrive as bytes, `rlgraph.runtime.dataplane.cells`, and leave as bytes).

`DirectUnit`, mixed into the unit's actor class (`guard.guarded_actor_class`), serves the ROUTER
socket on one thread with TQ's own request handler (``_process_one_worker_request``), after the
same client-identity check TQ's proxy makes, and without the thread cap. A request from an
rlgraph client (`rlgraph.runtime.dataplane.wire`) is decoded without TQ's walk over every value
looking for TensorDicts (`wire.decode`; others' requests are walked as TQ walks them). The
protocol, the storage and the handlers are TQ's; only the hop is gone (and the unit's half-second
sleep at start-up, which waited for the worker thread).

An rlgraph client's put or get (its cells are bytes: `rlgraph.runtime.dataplane.cells`) is
answered by `DirectUnit._reply` with what TQ's handler does for it, in one function: the same
counts and timings, the same ``StorageUnitData.put_data`` / ``get_data``, the same answer (packed
by `wire.pack`, without a ``uuid4``), the same error kinds and wording, and the same warning for
a heavy get. TQ's handler spends ~30 us of Python on a small request (a debug log line formatted
whether logged or not, two messages made with ``uuid4``, its thread cap's context manager); in a
unit woken from its poll, with its caches cold, that was ~130 us of each request's ~400. Every
other request, and any request whose body this path does not read (a put with a data parser), goes
to TQ's handler. ``RLGRAPH_TQ_DIRECT_UNIT=0`` (in the environment
Ray's processes start with) keeps TQ's proxy and worker threads, for side-by-side measurement.

`UnitHost`, mixed into the controller's actor class, runs a plane's only storage unit in the
controller's process (``dataplane.host_unit``): the same unit class and thread, one Ray actor
less to start (each costs its process's start-up: Python, Ray's core worker, torch). TQ's start
asks it for the unit (`rlgraph.runtime.dataplane.tq`), and its close calls ``shutdown`` on what
it holds as the unit's handle, here the controller's.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import threading
import time
import types
from typing import Any, Iterator

__all__ = ["DirectUnit", "UnitHost", "ENV"]

ENV = "RLGRAPH_TQ_DIRECT_UNIT"
log = logging.getLogger(__name__)


@contextlib.contextmanager
def _no_thread_cap(*_: Any, **__: Any) -> Iterator[None]:
    yield


def _message_class(base: Any) -> Any:
    """TQ's message class, reading rlgraph clients' requests without the TensorDict walk."""
    from rlgraph.runtime.dataplane import wire

    if getattr(base, "_rlgraph_plain", False):
        return base

    def ours(sender: str) -> bool:
        return isinstance(sender, str) and sender.endswith(wire.SUFFIX)

    class Message(base):  # type: ignore[misc, valid-type]
        _rlgraph_plain = True

        @classmethod
        def deserialize(cls, frames: list[Any]) -> Any:
            return wire.decode(frames, ours)

    return Message


class _Received:
    """A request already read from the ROUTER socket, for TQ's handler, which reads its request
    from the socket it is given and sends the answer back on it."""

    def __init__(self, socket: Any, frames: list[Any]) -> None:
        self._socket, self._frames = socket, frames

    def recv_multipart(self, copy: bool = False) -> list[Any]:
        frames, self._frames = self._frames, []
        return frames

    def send_multipart(self, frames: list[Any], copy: bool = False) -> None:
        self._socket.send_multipart(frames, copy=copy)


@functools.cache
def _tq() -> Any:
    """The names of TQ's (and `wire`) a request's answer uses, imported once in the unit's process,
    not at each request (this module is imported, by Ray's unpickling, before TQ's)."""
    from transfer_queue.storage.simple_storage import KEY_NOT_FOUND_MARKER, StorageKeyNotFoundError
    from transfer_queue.utils.common import log_heavy_operation
    from transfer_queue.utils.zmq_utils import ZMQRequestType, frame_nbytes

    from rlgraph.runtime.dataplane import wire

    return types.SimpleNamespace(KEY_NOT_FOUND_MARKER=KEY_NOT_FOUND_MARKER,
                                 StorageKeyNotFoundError=StorageKeyNotFoundError,
                                 log_heavy_operation=log_heavy_operation, ZMQRequestType=ZMQRequestType,
                                 frame_nbytes=frame_nbytes, wire=wire)


class _Sent:
    """A stand-in socket that keeps what TQ's handler sends on it (a link's answer)."""

    def __init__(self) -> None:
        self.frames: list[Any] = []

    def send_multipart(self, frames: list[Any], copy: bool = False) -> None:
        self.frames = list(frames)


class DirectUnit:
    """Mixin for TQ's ``SimpleStorageUnit`` (see the module): one thread serves its requests."""

    storage_unit_id: str
    put_get_socket: Any
    worker_thread: Any
    _shutdown_event: threading.Event

    def _start_process_put_get(self) -> None:
        if os.environ.get(ENV, "1") == "0":
            super()._start_process_put_get()  # type: ignore[misc]
            return
        # the handlers' own globals (Ray ships TQ's class by value, so they need not be the module's),
        # in this unit's process only
        for handler in ("_handle_put", "_handle_get", "_handle_clear"):
            fn = inspect.unwrap(getattr(type(self), handler))  # under Ray's tracing wrappers
            fn.__globals__["limit_pytorch_auto_parallel_threads"] = _no_thread_cap
        serve = inspect.unwrap(getattr(type(self), "_process_one_worker_request"))
        if "ZMQMessage" in serve.__globals__:  # what it decodes each request with
            serve.__globals__["ZMQMessage"] = _message_class(serve.__globals__["ZMQMessage"])
        self._serve_lock = threading.Lock()  # TQ's storage is touched by one thread at a time
        self._monitor = None
        self.worker_thread = threading.Thread(target=self._serve, name=f"StorageUnitThread-{self.storage_unit_id}",
                                              daemon=True)
        self.worker_thread.start()
        self._link = self._listen()

    def _listen(self) -> Any:
        """This unit's link (`rlgraph.runtime.dataplane.link`), or None where it has none."""
        from rlgraph.runtime.dataplane import guard, link

        secret = guard.installed_secret()
        if not link.enabled() or not secret:
            return None
        try:
            return link.Listener(link.address(self.storage_unit_id, secret), secret, self._answer_link,
                                 self._serve_lock, self.storage_unit_id)
        except OSError as e:  # its address taken: clients reach this unit by ZMQ
            log.warning("storage unit %s: no link (%s); clients use ZMQ", self.storage_unit_id, e)
            return None

    def _answer_link(self, frames: list[bytearray]) -> list[Any]:
        """The answer's frames to a request that came by link: an rlgraph client's put or get answered
        here (`_reply`), any other by TQ's own handler, as over ZMQ."""
        monitor = self._perf_monitor()
        reply = self._reply(frames[0], monitor) if len(frames) == 1 else None
        if reply is not None:
            return reply
        sent = _Sent()
        self._process_one_worker_request(_Received(sent, [b"link", *frames]), monitor)  # type: ignore[attr-defined]
        if not sent.frames:  # TQ's handler answers every request; a link's client must not wait for nothing
            tq = _tq()
            return tq.wire.pack(tq.ZMQRequestType.PUT_GET_ERROR, self.storage_unit_id, None,
                             {"message": f"storage unit {self.storage_unit_id} gave no answer"})
        return sent.frames[1:]  # less the identity TQ's handler puts first

    def _perf_monitor(self) -> Any:
        """What times each request, as in TQ's loop: its metrics exporter where it has one, else a
        perf monitor of the unit's own."""
        exporter = getattr(self, "_metrics", None)
        if exporter is not None:
            return exporter
        if self._monitor is None:
            from transfer_queue.storage.simple_storage import IntervalPerfMonitor

            self._monitor = IntervalPerfMonitor(caller_name=f"{self.storage_unit_id}")
        return self._monitor

    def shutdown(self) -> None:
        """TQ's shutdown, after closing this unit's link."""
        link, self._link = getattr(self, "_link", None), None
        if link is not None:
            link.close()
        super().shutdown()  # type: ignore[misc]

    def _serve(self) -> None:
        import zmq
        from transfer_queue.storage.simple_storage import STORAGE_CLIENT_IDENTITY_PREFIXES

        front = self.put_get_socket
        poller = zmq.Poller()
        poller.register(front, zmq.POLLIN)
        while not self._shutdown_event.is_set():
            try:
                if not poller.poll(1000):  # bounded, so that a shutdown is seen within a second
                    continue
                frames = front.recv_multipart(copy=False)
            except zmq.ContextTerminated:
                return
            except zmq.ZMQError as e:  # as TQ's worker thread does: say so and poll again
                log.warning("storage unit %s: poll failed: %s", self.storage_unit_id, e)
                continue
            if not frames or not bytes(frames[0]).startswith(STORAGE_CLIENT_IDENTITY_PREFIXES):
                continue  # not a TransferQueue client: dropped, as TQ's proxy drops it
            monitor = self._perf_monitor()
            try:
                with self._serve_lock:
                    if not self._answer(front, frames, monitor):
                        self._process_one_worker_request(_Received(front, frames), monitor)  # type: ignore[attr-defined]
            except zmq.ContextTerminated:
                return
            except Exception:  # one request's failure (its client times out naming the unit); the unit serves on
                log.exception("storage unit %s: a request failed", self.storage_unit_id)
            finally:
                del frames


    def _answer(self, front: Any, frames: list[Any], monitor: Any) -> bool:
        """Answer an rlgraph client's put or get as TQ's handler would (see the module); False,
        having sent nothing, for any other request."""
        if len(frames) != 2:  # an identity and one msgpack frame: what a `Wire` sends
            return False
        reply = self._reply(frames[1], monitor)
        if reply is None:
            return False
        front.send_multipart([frames[0], *reply], copy=False)
        return True

    def _reply(self, frame: Any, monitor: Any) -> list[Any] | None:
        """The answer's frames to the request in msgpack `frame`, if it is an rlgraph client's put
        or get (see the module); None, having done nothing, for any other request."""
        tq = _tq()
        ZMQRequestType, wire = tq.ZMQRequestType, tq.wire
        try:
            request = wire.unpack(frame)
        except Exception:
            return None  # TQ's handler answers with its own error
        if type(request) is not dict:
            return None
        kind, sender, body = request.get("request_type"), request.get("sender_id"), request.get("body")
        if not (isinstance(sender, str) and sender.endswith(wire.SUFFIX)) or type(body) is not dict:
            return None
        if kind == ZMQRequestType.PUT_DATA.value and body.get("data_parser") is None:
            op = "PUT_DATA"
        elif kind == ZMQRequestType.GET_DATA.value:
            op = "GET_DATA"
        else:
            return None
        try:
            return self._handled(op, body, monitor)
        except Exception as e:  # what TQ's request loop answers for an error outside its handlers
            log.error("[%s]: worker error during %s from sender=%s: %s: %s", self.storage_unit_id, op, sender,
                      type(e).__name__, e)
            return wire.pack(ZMQRequestType.PUT_GET_ERROR, self.storage_unit_id, None, {
                "message": f"{self.storage_unit_id}, worker encountered error during operation "
                           f"{ZMQRequestType(kind)}: {str(e)}."})

    def _handled(self, op: str, body: dict[str, Any], monitor: Any) -> list[Any]:
        """`_reply` for a put or a get: TQ's counts, timing, storage call, answer and error answers."""
        tq = _tq()
        ZMQRequestType, StorageKeyNotFoundError, wire = tq.ZMQRequestType, tq.StorageKeyNotFoundError, tq.wire

        self._requests_arrived += 1  # type: ignore[attr-defined]
        arrivals = self._arrivals_by_op  # type: ignore[attr-defined]
        arrivals[op] = arrivals.get(op, 0) + 1
        started = time.perf_counter()
        with monitor.measure(op_type=op):  # around the handler, as in TQ's loop: its own errors are the loop's
            try:
                if op == "PUT_DATA":
                    self.storage_data.put_data(body["data"], body["global_indexes"])  # type: ignore[attr-defined]
                    answer, out = ZMQRequestType.PUT_DATA_RESPONSE, {}
                else:
                    data = self.storage_data.get_data(body["fields"], body["global_indexes"])  # type: ignore[attr-defined]
                    answer, out = ZMQRequestType.GET_DATA_RESPONSE, {"data": data}
            except Exception as e:  # TQ's handlers' error answers, word for word
                if op == "PUT_DATA":
                    answer, out = ZMQRequestType.PUT_ERROR, {
                        "message": f"Failed to put data into storage unit id #{self.storage_unit_id}, "
                                   f"detail error message: {str(e)}"}
                else:
                    missing = isinstance(e, StorageKeyNotFoundError)
                    (log.debug if missing else log.error)(
                        "[%s]: _handle_get error, fields=%s, global_indexes=%s: %s: %s", self.storage_unit_id,
                        body.get("fields"), body.get("global_indexes"), type(e).__name__, e)
                    answer, out = ZMQRequestType.GET_ERROR, {
                        "message": f"{f'[{tq.KEY_NOT_FOUND_MARKER}] ' if missing else ''}Failed to get data from "
                                   f"storage unit id #{self.storage_unit_id}, detail error message: {str(e)}"}
        reply = wire.pack(answer, self.storage_unit_id, None, out)
        if op == "GET_DATA":
            tq.log_heavy_operation(self.storage_unit_id, "get", time.perf_counter() - started,
                                   sum(tq.frame_nbytes(f) or 0 for f in reply),
                                   f"samples={len(body.get('global_indexes', ()))} fields={list(body.get('fields', ()))}")
        return reply


class UnitHost:
    """Mixin for TQ's controller actor class: hosts the plane's storage unit (see the module)."""

    _hosted_unit: Any = None

    def unit_start(self, config: dict[str, Any]) -> Any:
        """Start the storage unit here with TQ's SimpleStorage `config`; returns its ZMQ address
        (what TQ's bootstrap asks of a unit actor)."""
        from transfer_queue.storage.simple_storage import SimpleStorageUnit

        base = SimpleStorageUnit.__ray_metadata__.modified_class.__ray_actor_class__  # the class TQ decorated
        unit = type("HostedStorageUnit", (DirectUnit, base), {})(config)
        self._hosted_unit = unit
        return unit.get_zmq_server_info()

    def shutdown(self) -> None:
        """TQ's close, on what it holds as the unit's handle: stop the hosted unit."""
        if self._hosted_unit is not None:
            self._hosted_unit.shutdown()
            self._hosted_unit = None
