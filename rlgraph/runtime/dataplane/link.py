"""A storage unit's link: its puts and gets over a Unix-domain socket when client and unit share a machine.

A request over ZMQ crosses four threads: the client's thread hands it to its context's I/O
thread, which writes it to TCP; the unit's I/O thread reads it and wakes the unit's thread; the
answer goes back the same way. On this 2-core machine a 200-byte round trip took ~200 us that
way, against ~30-45 us over a Unix socket read by a thread blocked on it (and ~100 us when the
reader waits in ``poll`` first: a reader blocked in ``recv`` is woken straight onto the CPU), so
a 1-row put and get spent ~0.3 ms of its ~1 ms on the transport alone.

So a storage unit (`rlgraph.runtime.dataplane.unit.DirectUnit`) also listens on a Unix socket in
Linux's abstract namespace (`address`: no file to clean up; it goes when the process does), and a
`Wire` on the same machine sends its puts and gets there (`Links`):

- the messages are the ones the ZMQ path carries (TQ's ``ZMQMessage`` fields, one msgpack frame,
  `wire.pack`), each sent as its length (8 bytes) then its bytes;
- a connection starts with a mutual challenge on the run's secret (`rlgraph.runtime.dataplane.guard`):
  the unit proves it knows the secret before a client sends anything, and the client before the
  unit reads a request. Any local process can reach an abstract address, as it can a TCP port;
  none without the secret gets a byte decoded or answered;
- the unit serves each connection on a thread of its own, blocked on the socket, under the lock
  its ZMQ thread takes too (TQ's storage was only ever touched by one thread);
- the client waits for an answer in ``recv`` with a receive timeout of at most `wire.WATCH_S`,
  so it checks its deadline and asks `watch` whether a plane actor died as the ZMQ path does; a
  unit that closes the connection (it died) ends the wait at once;
- a connection whose request failed or timed out is closed, never reused (its late answer would
  be read as the next request's), as the ZMQ path's sockets are;
- a unit that cannot be reached by link (another machine, another network namespace, no secret,
  a unit started with ``RLGRAPH_TQ_LINK=0``) is sent to over ZMQ from then on; a unit that answers
  the challenge wrongly is logged.

``RLGRAPH_TQ_LINK=0`` (in the environment Ray's processes start with) turns links off on both
sides, for side-by-side measurement.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable, Iterator

__all__ = ["ENV", "Deadline", "LinkClosed", "LinkRefused", "Links", "Listener", "address", "enabled", "receive", "send",
           "set_receive_timeout"]

ENV = "RLGRAPH_TQ_LINK"
log = logging.getLogger(__name__)

_LENGTH = struct.Struct("<Q")
_HELLO = b"rlgraph-link-1"
_NONCE = 32
_PROOF = 32  # an HMAC-SHA256
_HANDSHAKE_S = 10.0  # a peer that has not finished the challenge by then is dropped
_SMALL = 1 << 16  # a message shorter than this is sent with its length in one write


class LinkClosed(ConnectionError):
    """The peer closed the connection (a unit that died, or shut down)."""


class LinkRefused(Exception):
    """The peer at a link address failed the challenge: it does not know the run's secret."""


def enabled() -> bool:
    """Whether this process may use links: on Linux (abstract addresses), unless turned off."""
    return sys.platform.startswith("linux") and os.environ.get(ENV, "1") != "0"


def address(unit_id: str, secret: str) -> str:
    """The abstract socket address of storage unit `unit_id` of the plane whose secret is `secret`
    (a digest of it, so that two runs' units never share a name, and the name tells nothing)."""
    tag = hashlib.sha256(f"{secret}\0{unit_id}".encode()).hexdigest()[:24]
    return f"\0rlgraph-tq-{tag}"


def send(sock: socket.socket, payload: Any) -> None:
    """One message: its length, then its bytes."""
    size = memoryview(payload).nbytes
    if size < _SMALL:
        sock.sendall(_LENGTH.pack(size) + bytes(payload))
    else:
        sock.sendall(_LENGTH.pack(size))
        sock.sendall(payload)


def set_receive_timeout(sock: socket.socket, seconds: float | None) -> None:
    """Make a blocking socket's reads give up after `seconds` (None: never)."""
    seconds = 0.0 if seconds is None else max(seconds, 0.001)
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6)))


class Deadline:
    """How long a client waits for an answer (see the module): reads time out every `watch_s`
    seconds at most (the socket's receive timeout, set at connect), and each time `lapsed` asks
    `watch` whether a plane actor died, and ends the wait with the ZMQ path's errors."""

    def __init__(self, at: float, timeout_s: float, what: str, units: Callable[[], list[str]],
                 watch: Callable[[], list[str]] | None, watch_s: float) -> None:
        """`at`: when the wait ends (``time.monotonic``), `timeout_s` after it started."""
        self.at = at
        self.timeout_s, self.what, self.units, self.watch, self.watch_s = timeout_s, what, units, watch, watch_s

    def lapsed(self, sock: socket.socket) -> None:
        """A read timed out: raise if the wait is over, else set the next read's timeout."""
        from rlgraph.runtime.dataplane.base import DataPlaneDied, DataPlaneError

        if self.watch is not None:
            dead = self.watch()
            if dead:
                raise DataPlaneDied(dead, f"waiting for TransferQueue to {self.what}")
        left = self.at - time.monotonic()
        if left <= 0:
            raise DataPlaneError(f"timed out after {self.timeout_s:.0f}s waiting for TransferQueue to {self.what} "
                                 f"(no answer from storage units {self.units()})")
        set_receive_timeout(sock, min(left, self.watch_s))


def receive(sock: socket.socket, deadline: Deadline | None = None) -> bytearray:
    """One message, read from a blocking socket: with a `deadline`, each read that times out asks
    it whether to go on (a message half read is read on from where it was); without one, the
    socket waits as long as it takes."""
    shortened = deadline is not None and deadline.at - time.monotonic() < deadline.watch_s
    if shortened:
        set_receive_timeout(sock, deadline.at - time.monotonic())
    try:
        head = bytearray(_LENGTH.size)
        _receive_into(sock, memoryview(head), deadline)
        body = bytearray(_LENGTH.unpack(head)[0])
        _receive_into(sock, memoryview(body), deadline)
    finally:
        if shortened or deadline is not None and deadline.at - time.monotonic() < deadline.watch_s:
            set_receive_timeout(sock, deadline.watch_s)  # as connected, for the next wait
    return body


def _receive_into(sock: socket.socket, view: memoryview, deadline: Deadline | None) -> None:
    got = 0
    while got < len(view):
        try:
            n = sock.recv_into(view[got:])
        except (BlockingIOError, TimeoutError):  # the receive timeout
            if deadline is None:
                raise
            deadline.lapsed(sock)
            continue
        if not n:
            raise LinkClosed("the peer closed the connection")
        got += n


def _prove(key: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, role + nonce, hashlib.sha256).digest()


def _exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray(n)
    _receive_into(sock, memoryview(out), None)
    return bytes(out)


def _challenge_as_unit(sock: socket.socket, key: bytes) -> None:
    """The unit's side: it sends a nonce, checks the client's proof of it, and only then proves
    the secret itself (on the client's nonce): a client that fails gets nothing but the nonce."""
    nonce = secrets.token_bytes(_NONCE)
    sock.sendall(_HELLO + nonce)
    hello = _exact(sock, len(_HELLO) + _NONCE + _PROOF)  # hello, the client's nonce, its proof of ours
    if hello[:len(_HELLO)] != _HELLO:
        raise LinkRefused("not an rlgraph link client")
    if not hmac.compare_digest(hello[len(_HELLO) + _NONCE:], _prove(key, b"client", nonce)):
        raise LinkRefused("the client does not know the run's secret")
    sock.sendall(_prove(key, b"unit", hello[len(_HELLO):len(_HELLO) + _NONCE]))


def _challenge_as_client(sock: socket.socket, key: bytes) -> None:
    hello = _exact(sock, len(_HELLO) + _NONCE)
    if hello[:len(_HELLO)] != _HELLO:
        raise LinkRefused("the link address is held by something other than an rlgraph storage unit")
    mine = secrets.token_bytes(_NONCE)
    sock.sendall(_HELLO + mine + _prove(key, b"client", hello[len(_HELLO):]))
    if not hmac.compare_digest(_exact(sock, _PROOF), _prove(key, b"unit", mine)):
        raise LinkRefused("the process at the link address does not know the run's secret")


class Listener:
    """A storage unit's end: accepts connections on `address` and serves each on a thread of its
    own: `answer` (under `lock`) turns each request's bytes into the answer's."""

    def __init__(self, addr: str, secret: str, answer: Callable[[bytearray], Any], lock: threading.Lock,
                 name: str) -> None:
        self._key = secret.encode()
        self._answer, self._lock, self._name = answer, lock, name
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(addr)
            self._sock.listen(64)
        except OSError:
            self._sock.close()
            raise
        self._thread = threading.Thread(target=self._accept, name=f"{name}-link", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            with self._conns_lock:
                if self._closed.is_set():
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name=f"{self._name}-link-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(_HANDSHAKE_S)
            _challenge_as_unit(conn, self._key)
            conn.settimeout(None)
            while True:
                request = receive(conn)
                with self._lock:
                    reply = self._answer(request)
                send(conn, reply)
        except LinkRefused as e:
            log.warning("%s: refused a link connection: %s", self._name, e)
        except (OSError, LinkClosed):
            pass  # the client went, or the unit is closing
        except Exception:  # an answer that failed: the client's wait ends when the connection closes
            log.exception("%s: a request on a link failed", self._name)
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        """Stop accepting and end every connection (its client's wait ends at once)."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._conns_lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)


class Links:
    """A client's connections to its units' links, kept for reuse (see the module): `take` one,
    then `give` it back after a whole exchange, or `drop` it after anything else."""

    def __init__(self, secret: str | None, addresses: Callable[[str], str], watch_s: float) -> None:
        self._key = secret.encode() if secret else None
        self._addresses = addresses
        self._watch_s = watch_s
        self._idle: dict[str, list[socket.socket]] = {}
        self._unlinked: set[str] = set()
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def take(self, unit: str) -> socket.socket | None:
        """A connection to `unit`'s link (an idle one, or a new one), or None where the unit has
        no link (then use ZMQ)."""
        if self._key is None or unit in self._unlinked:
            return None
        with self._lock:
            if os.getpid() != self._pid:  # a forked child: the parent's connections are the parent's
                self._idle, self._unlinked, self._pid = {}, set(), os.getpid()
            idle = self._idle.get(unit)
            if idle:
                return idle.pop()
        return self._connect(unit)

    def give(self, unit: str, sock: socket.socket) -> None:
        """Back for reuse: `sock` ended an exchange, its answer read whole."""
        with self._lock:
            if os.getpid() == self._pid:
                self._idle.setdefault(unit, []).append(sock)
                return
        sock.close()

    def drop(self, unit: str, sock: socket.socket, unlink: bool = False) -> None:
        """Close `sock` (an exchange on it failed, or was abandoned); with `unlink`, reach `unit`
        by ZMQ from now on (its link broke: the unit died, or is closing)."""
        sock.close()
        if unlink:
            with self._lock:
                self._unlinked.add(unit)
                for other in self._idle.pop(unit, []):
                    other.close()

    def _connect(self, unit: str) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(_HANDSHAKE_S)
            sock.connect(self._addresses(unit))
            _challenge_as_client(sock, self._key)  # type: ignore[arg-type]
            sock.settimeout(None)  # blocking, its reads bounded by the receive timeout (`Deadline`)
            set_receive_timeout(sock, self._watch_s)
            return sock
        except LinkRefused as e:
            log.warning("storage unit %s: not using its link: %s", unit, e)
        except (OSError, LinkClosed) as e:  # no unit listens here: another machine, or links off
            log.debug("storage unit %s: no link (%s); using ZMQ", unit, e)
        sock.close()
        with self._lock:
            self._unlinked.add(unit)
        return None

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for socks in idle.values():
            for sock in socks:
                sock.close()
