"""Storage requests sent from the calling thread: the put and get path of the TransferQueue client.

TransferQueue's storage manager is asynchronous: a synchronous caller hands each request to an
event loop on another thread and waits for its future. On a 2-core machine that hop, and the
asyncio socket under it, cost about 0.5 ms of a request's ~1.3 ms (a 1-row get, measured side by
side). A put or a get is one request per storage unit and one answer each, so `Wire` sends them
on plain (blocking) ZMQ sockets from the thread that asked, and waits on their answers with one
``zmq.Poller``:

- the messages are TransferQueue's own (``ZMQMessage``, ``PUT_DATA`` / ``GET_DATA``), so the
  storage units serve them as they serve TQ's client;
- the sockets come from TQ's ``ZMQSocketPool`` on a context of our own, under an identity that
  starts with the storage manager's id (the units drop any other), and carry the run's secret
  (`rlgraph.runtime.dataplane.guard` hooks TQ's socket factory);
- requests to several units go out together, then their answers are read as they come;
- the wait has a deadline whose error names what was waited for, and asks `watch` (the names of
  dead plane actors, the driver's) every `WATCH_S` seconds, so a dead unit ends it with
  `DataPlaneDied` instead of a timeout;
- a socket whose request failed or timed out is closed, never reused (its late answer would be
  read as the next request's); the pool does that for a lease that raises;
- messages between a `Wire` and a storage unit are decoded by TQ's own msgpack decoder without
  its walk over every value looking for TensorDicts (`decode`; the unit's side through
  `rlgraph.runtime.dataplane.unit`): they hold lists of bytes and numbers, never a TensorDict, and
  the walk cost 0.7 ms for 1,024 rows' cells;
- a unit on the same machine is sent to over its link instead (`rlgraph.runtime.dataplane.link`:
  a Unix-domain socket, ~0.15 ms less a round trip than ZMQ's two I/O threads each way), with the
  same messages, deadline and watch; a unit without one, or whose link breaks mid-request, by ZMQ;
- they are packed as ``ZMQMessage.serialize`` packs them (one msgpack frame of the same six
  fields), by msgspec's own encoder (`pack`): TQ's ``ZMQMessage.create`` draws a ``uuid4`` for
  each message's request id and its encoder sets a context variable around each message, about
  8 us of the ~30 us a storage unit spends on a small request (nothing matches answers to
  requests by that id: an answer comes back on the request's own socket).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from typing import Any, Callable, Mapping

import msgspec
import zmq
from transfer_queue.utils import serial_utils
from transfer_queue.utils.zmq_utils import ZMQMessage, ZMQRequestType, ZMQSocketPool, frame_nbytes

from rlgraph.runtime.dataplane import guard, link
from rlgraph.runtime.dataplane.link import LinkClosed
from rlgraph.runtime.dataplane.base import DataPlaneError

__all__ = ["SUFFIX", "Wire", "WATCH_S", "decode", "pack", "unpack"]

WATCH_S = 1.0  # how often a wait asks whether a plane actor died
log = logging.getLogger(__name__)


class _Plain(serial_utils.MsgpackDecoder):
    """TQ's message decoder, less the walk that rebuilds TensorDicts from their markers."""

    def _reconstruct_special_types(self, obj: Any) -> Any:
        return obj


_plain = _Plain()
_full = serial_utils.MsgpackDecoder()
SUFFIX = "_wire"  # ends the sender id of every request a `Wire` sends


def unpack(frame: Any) -> Any:
    """One msgpack frame (all a `Wire`'s message is) decoded as `decode` decodes a plain sender's."""
    return _plain.decode([frame])


def decode(frames: list[Any], plain: Callable[[str], bool] = lambda sender: True) -> ZMQMessage:
    """A message as ``ZMQMessage.deserialize`` reads it (the same frames, fields and errors), but
    its body is walked for TensorDicts only when `plain` says its sender may have sent one. The
    walk visits every value (0.7 ms for 1,024 rows' cells); the messages between a `Wire` and a
    storage unit hold lists of bytes and numbers, never a TensorDict."""
    if not frames or not frame_nbytes(frames[0]) or (len(frames) >= 2 and serial_utils._is_pickle_fallback(frames[0])):
        return ZMQMessage.deserialize(frames)  # TQ's own path: its error for a shifted frame, or pickle
    try:
        result = _plain.decode(frames)
    except Exception:
        return ZMQMessage.deserialize(frames)  # raises TQ's own error for it
    body = result["body"]
    if not plain(result["sender_id"]):
        body = _full._reconstruct_special_types(body)
    return ZMQMessage(request_type=ZMQRequestType(result["request_type"]), sender_id=result["sender_id"],
                      receiver_id=result["receiver_id"], body=body, request_id=result["request_id"],
                      timestamp=result["timestamp"])


_encoder = msgspec.msgpack.Encoder()
_ids = itertools.count()
_ID_PREFIX = f"{os.getpid() & 0xffff:04x}"


def pack(kind: ZMQRequestType, sender_id: str, receiver_id: str | None, body: dict[str, Any]) -> list[Any]:
    """The frames ``ZMQMessage.create(...).serialize()`` gives for a message whose body holds only
    what msgpack itself writes (strings, numbers, bytes, lists and dicts of them), packed without
    ``create``'s ``uuid4`` (see the module). A body with anything else goes through TQ's own path."""
    try:
        return [_encoder.encode({"request_type": kind.value, "sender_id": sender_id, "receiver_id": receiver_id,
                                 "request_id": f"{_ID_PREFIX}{next(_ids) & 0xffffffff:08x}",
                                 "timestamp": time.time(), "body": body})]
    except (TypeError, OverflowError, ValueError):  # a tensor or another object TQ's encoder has a hook for
        return ZMQMessage.create(request_type=kind, sender_id=sender_id, receiver_id=receiver_id,
                                 body=body).serialize()


class Wire:
    """Blocking request/answer exchanges with TransferQueue storage units (see the module doc)."""

    def __init__(self, manager_id: str, units: Mapping[str, Any]) -> None:
        """`manager_id`: the TQ storage manager's id (its identity prefix admits us);
        `units`: each unit's ``ZMQServerInfo`` by unit id."""
        self._id = f"{manager_id}{SUFFIX}"
        self._units = dict(units)
        self._ctx = zmq.Context()
        self._pool = ZMQSocketPool(self._ctx, self._id, "put_get_socket")
        # a unit on this machine is sent to over its link (`link`); the others, and any unit
        # without one, over ZMQ
        secret = guard.installed_secret() if link.enabled() else None
        self._links = link.Links(secret, lambda unit: link.address(getattr(self._units[unit], "id", unit), secret),
                                 WATCH_S)

    def put(self, requests: Mapping[str, tuple[list[int], dict[str, list[Any]]]], timeout_s: float, what: str,
            watch: Callable[[], list[str]] | None = None, during: Callable[[], None] | None = None) -> None:
        """Store cells: per unit id, (global indexes, {field: cells in that order}). `during` runs once
        the requests are sent, while the units store them (a put's copy into shared memory)."""
        messages = {unit: self._message(ZMQRequestType.PUT_DATA, unit, {
            "global_indexes": indexes, "data": data, "data_parser": None}) for unit, (indexes, data) in requests.items()}
        for unit, answer in self.exchange(messages, timeout_s, what, watch, during).items():
            if answer.request_type != ZMQRequestType.PUT_DATA_RESPONSE:
                raise DataPlaneError(f"storage unit {unit} refused to {what}: {answer.body.get('message', answer.body)}")

    def get(self, requests: Mapping[str, tuple[list[int], list[str]]], timeout_s: float, what: str,
            watch: Callable[[], list[str]] | None = None) -> dict[str, dict[str, list[Any]]]:
        """Stored cells: per unit id, (global indexes, fields) -> per unit id, {field: cells}."""
        messages = {unit: self._message(ZMQRequestType.GET_DATA, unit, {"global_indexes": indexes, "fields": fields})
                    for unit, (indexes, fields) in requests.items()}
        out = {}
        for unit, answer in self.exchange(messages, timeout_s, what, watch).items():
            if answer.request_type != ZMQRequestType.GET_DATA_RESPONSE:
                raise KeyError(f"storage unit {unit}: {answer.body.get('message', answer.body)}")
            out[unit] = answer.body["data"]
        return out

    def clear(self, requests: Mapping[str, list[int]], timeout_s: float, what: str,
              watch: Callable[[], list[str]] | None = None) -> None:
        """Drop rows: per unit id, their global indexes (TQ's own handler answers)."""
        messages = {unit: self._message(ZMQRequestType.CLEAR_DATA, unit, {"global_indexes": indexes})
                    for unit, indexes in requests.items()}
        for unit, answer in self.exchange(messages, timeout_s, what, watch).items():
            if answer.request_type != ZMQRequestType.CLEAR_DATA_RESPONSE:
                raise DataPlaneError(f"storage unit {unit} refused to {what}: {answer.body.get('message', answer.body)}")

    def _message(self, kind: Any, unit: str, body: dict[str, Any]) -> list[Any]:
        return pack(kind, self._id, unit, body)

    def exchange(self, messages: Mapping[str, ZMQMessage | list[Any]], timeout_s: float, what: str,
                 watch: Callable[[], list[str]] | None = None,
                 during: Callable[[], None] | None = None) -> dict[str, ZMQMessage]:
        """Send each unit its message (a ``ZMQMessage`` or its frames, `pack`), run `during`, then
        wait for every answer (by unit id). If `during` raises, the answers are not waited for
        (their sockets are closed, never reused)."""
        try:
            return self._exchange(messages, timeout_s, what, watch, during)
        except zmq.ZMQError as e:  # the transport, not the data: say so (a get would blame a missing column)
            raise DataPlaneError(f"the connection to TransferQueue's storage failed while trying to {what}: {e}") from e

    def _exchange(self, messages: Mapping[str, ZMQMessage | list[Any]], timeout_s: float, what: str,
                  watch: Callable[[], list[str]] | None,
                  during: Callable[[], None] | None = None) -> dict[str, ZMQMessage]:
        deadline = time.monotonic() + timeout_s
        framed = {unit: m.serialize() if isinstance(m, ZMQMessage) else m for unit, m in messages.items()}
        answers: dict[str, ZMQMessage] = {}
        wait = link.Deadline(deadline, timeout_s, what, lambda: sorted(set(framed) - set(answers)), watch, WATCH_S)
        linked: dict[str, Any] = {}  # unit -> the link connection its request went on, until answered
        try:
            with contextlib.ExitStack() as leases:
                sockets = {}

                def by_zmq(unit: str) -> None:
                    sock = leases.enter_context(self._pool.lease(self._units[unit]))
                    sock.send_multipart(framed[unit], copy=False)
                    sockets[sock] = unit

                for unit in framed:
                    if not self._send_by_link(unit, framed[unit], linked, wait):
                        by_zmq(unit)
                if during is not None:
                    during()
                for unit, conn in list(linked.items()):
                    try:
                        with wait.on(conn):
                            answer = link.receive(conn, wait)
                    except OSError as e:  # the link broke (its unit died, or is closing): on by ZMQ
                        self._links.drop(unit, linked.pop(unit), unlink=True)
                        log.debug("storage unit %s: link broke (%s) while trying to %s; asking by ZMQ", unit, e, what)
                        by_zmq(unit)
                        continue
                    answers[unit] = decode(answer)
                    self._links.give(unit, linked.pop(unit))
                poller = zmq.Poller()
                for sock in sockets:
                    poller.register(sock, zmq.POLLIN)
                while len(answers) < len(framed):  # the ZMQ answers, under the same deadline and watch
                    left = wait.left()
                    if left <= 0:
                        wait.timed_out()
                    ready = dict(poller.poll(1000 * min(left, WATCH_S if watch is not None else left)))
                    for sock in ready:
                        answers[sockets[sock]] = decode(sock.recv_multipart(copy=False))
                        poller.unregister(sock)
                    if not ready:
                        wait.watched()
                return answers
        finally:
            for unit, conn in linked.items():  # a request unanswered: its late answer must never be read
                self._links.drop(unit, conn)

    def _send_by_link(self, unit: str, frames: list[Any], linked: dict[str, Any], wait: link.Deadline) -> bool:
        """Send `unit` its request over its link, if it has one; False: send it by ZMQ."""
        conn = self._links.take(unit, within_s=wait.left())
        if conn is None:
            return False
        linked[unit] = conn  # dropped by the caller if the send does not end well
        try:
            with wait.on(conn):
                link.send(conn, frames, wait)
        except (LinkClosed, BrokenPipeError, ConnectionResetError) as e:  # the unit went since the connection was made
            self._links.drop(unit, linked.pop(unit), unlink=True)
            log.debug("storage unit %s: link broke (%s); using ZMQ", unit, e)
            return False
        except OSError as e:  # the transport, not the data (the caller drops the connection)
            raise DataPlaneError(f"the link to TransferQueue's storage unit {unit} failed while trying to "
                                 f"{wait.what}: {e}") from e
        return True

    def close(self) -> None:
        self._links.close()
        self._pool.close()
        self._ctx.destroy(linger=0)
