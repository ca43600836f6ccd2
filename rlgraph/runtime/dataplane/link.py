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

- the messages are the ones the ZMQ path carries, frame for frame (TQ's ``ZMQMessage``, packed by
  `wire.pack` or TQ's own encoder): the number of frames, then each frame's length and bytes;
- a connection starts with a mutual challenge on the run's secret (`rlgraph.runtime.dataplane.guard`):
  each side sends a fresh nonce, and each proof is an HMAC of its role, the unit's address and both
  nonces. The unit checks the client's proof before it proves anything or reads a request, and the
  client checks the unit's before it sends one, so no process without the secret gets a byte
  decoded or answered, and a proof made for one connection (or one unit) is worth nothing on
  another. Any local process can reach an abstract address, as it can a TCP port;
- the unit serves each connection on a thread of its own, blocked on the socket, under the lock
  its ZMQ thread takes too (TQ's storage was only ever touched by one thread). At most
  `_CHALLENGES` connections may be in their challenge at once; more are closed at once;
- the client sends and waits for the answer with send and receive timeouts of at most
  `wire.WATCH_S` (`Deadline`): at each, it checks its deadline and asks `watch` whether a plane
  actor died, as the ZMQ path does; a message half sent or half read goes on from where it was. A
  unit that closes the connection (it died, or is closing) ends the wait at once;
- a connection whose request failed or timed out is closed, never reused (its late answer would
  be read as the next request's), as the ZMQ path's sockets are;
- a unit that cannot be reached by link (another machine, another network namespace, no secret,
  links off) is sent to over ZMQ from then on; one whose connection failed for a while (a full
  backlog, a challenge that timed out) is tried again after `_RETRY_S`; one that fails the
  challenge is logged.

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
from typing import Any, Callable, Sequence

__all__ = ["ENV", "Deadline", "LinkClosed", "LinkRefused", "Links", "Listener", "address", "enabled", "receive",
           "send"]

ENV = "RLGRAPH_TQ_LINK"
log = logging.getLogger(__name__)

_COUNT = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")
_HELLO = b"rlgraph-link-2"
_NONCE = 32
_PROOF = 32  # an HMAC-SHA256
_HANDSHAKE_S = 10.0  # a challenge not finished by then is given up
_CHALLENGES = 32  # connections a unit takes through their challenge at once
_RETRY_S = 5.0  # a unit whose connection failed for a passing reason is tried again after this
_SMALL = 1 << 16  # a message shorter than this is sent in one write


class LinkClosed(ConnectionError):
    """The peer closed the connection (a unit that died, or is closing)."""


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


def _set_timeout(sock: socket.socket, option: int, seconds: float | None) -> None:
    seconds = 0.0 if seconds is None else max(seconds, 0.001)
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", whole, int((seconds - whole) * 1e6)))


def set_timeouts(sock: socket.socket, seconds: float | None) -> None:
    """Make a blocking socket's sends and receives give up after `seconds` (None: never)."""
    _set_timeout(sock, socket.SO_RCVTIMEO, seconds)
    _set_timeout(sock, socket.SO_SNDTIMEO, seconds)


class Deadline:
    """How long a client's exchange may take (see the module): its sends and receives time out every
    `watch_s` seconds at most (the socket's timeouts, set at connect), and each time `lapsed` asks
    `watch` whether a plane actor died, and ends the wait with the ZMQ path's errors."""

    def __init__(self, at: float, timeout_s: float, what: str, units: Callable[[], list[str]],
                 watch: Callable[[], list[str]] | None, watch_s: float) -> None:
        """`at`: when the wait ends (``time.monotonic``), `timeout_s` after it started."""
        self.at = at
        self.timeout_s, self.what, self.units, self.watch, self.watch_s = timeout_s, what, units, watch, watch_s

    def left(self) -> float:
        return self.at - time.monotonic()

    def watched(self) -> None:
        """Raise `DataPlaneDied` if `watch` names a dead plane actor."""
        from rlgraph.runtime.dataplane.base import DataPlaneDied

        if self.watch is not None:
            dead = self.watch()
            if dead:
                raise DataPlaneDied(dead, f"waiting for TransferQueue to {self.what}")

    def timed_out(self) -> None:
        """Raise the wait's timeout error, naming the units not yet answered."""
        from rlgraph.runtime.dataplane.base import DataPlaneError

        raise DataPlaneError(f"timed out after {self.timeout_s:.0f}s waiting for TransferQueue to {self.what} "
                             f"(no answer from storage units {self.units()})")

    def lapsed(self, sock: socket.socket) -> None:
        """A send or a receive timed out: raise if the wait is over, else set the next one's timeout."""
        self.watched()
        left = self.left()
        if left <= 0:
            self.timed_out()
        set_timeouts(sock, min(left, self.watch_s))

    @contextlib.contextmanager
    def on(self, sock: socket.socket) -> Any:
        """`sock`'s timeouts no later than the deadline inside, set back to `watch_s` after."""
        shortened = self.left() < self.watch_s
        if shortened:
            set_timeouts(sock, self.left())
        try:
            yield
        finally:
            if shortened or self.left() < self.watch_s:
                set_timeouts(sock, self.watch_s)


def send(sock: socket.socket, frames: Sequence[Any], deadline: Deadline | None = None) -> None:
    """One message of `frames`: their number, then each one's length and bytes. With a `deadline`,
    each send that times out asks it whether to go on; without one, the socket waits as it is set."""
    views = [memoryview(f).cast("B") for f in frames]
    head = _COUNT.pack(len(views)) + b"".join(_LENGTH.pack(v.nbytes) for v in views)
    if sum(v.nbytes for v in views) < _SMALL:
        _send_all(sock, memoryview(head + b"".join(views)), deadline)
        return
    _send_all(sock, memoryview(head), deadline)
    for view in views:
        _send_all(sock, view, deadline)


def _send_all(sock: socket.socket, view: memoryview, deadline: Deadline | None) -> None:
    sent = 0
    while sent < len(view):
        try:
            sent += sock.send(view[sent:])
        except (BlockingIOError, TimeoutError):  # the send timeout
            if deadline is None:
                raise
            deadline.lapsed(sock)


def receive(sock: socket.socket, deadline: Deadline | None = None) -> list[bytearray]:
    """One message's frames, read from a blocking socket: with a `deadline`, each read that times out
    asks it whether to go on (a message half read is read on from where it was); without one, the
    socket waits as it is set."""
    count = bytearray(_COUNT.size)
    _receive_into(sock, memoryview(count), deadline)
    lengths = bytearray(_LENGTH.size * _COUNT.unpack(count)[0])
    _receive_into(sock, memoryview(lengths), deadline)
    frames = []
    for (n,) in _LENGTH.iter_unpack(lengths):
        frame = bytearray(n)
        _receive_into(sock, memoryview(frame), deadline)
        frames.append(frame)
    return frames


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


def _prove(key: bytes, role: bytes, addr: str, unit_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, role + b"\0" + addr.encode() + b"\0" + unit_nonce + client_nonce, hashlib.sha256).digest()


def _exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray(n)
    _receive_into(sock, memoryview(out), None)
    return bytes(out)


def _challenge_as_unit(sock: socket.socket, key: bytes, addr: str) -> None:
    """The unit's side: it sends a nonce, checks the client's proof, and only then proves the secret
    itself: a client that fails gets nothing but the nonce."""
    mine = secrets.token_bytes(_NONCE)
    sock.sendall(_HELLO + mine)
    hello = _exact(sock, len(_HELLO) + _NONCE + _PROOF)  # hello, the client's nonce, its proof
    if hello[:len(_HELLO)] != _HELLO:
        raise LinkRefused("not an rlgraph link client")
    theirs = hello[len(_HELLO):len(_HELLO) + _NONCE]
    if not hmac.compare_digest(hello[len(_HELLO) + _NONCE:], _prove(key, b"client", addr, mine, theirs)):
        raise LinkRefused("the client does not know the run's secret")
    sock.sendall(_prove(key, b"unit", addr, mine, theirs))


def _challenge_as_client(sock: socket.socket, key: bytes, addr: str) -> None:
    hello = _exact(sock, len(_HELLO) + _NONCE)
    if hello[:len(_HELLO)] != _HELLO:
        raise LinkRefused("the link address is held by something other than an rlgraph storage unit")
    theirs, mine = hello[len(_HELLO):], secrets.token_bytes(_NONCE)
    sock.sendall(_HELLO + mine + _prove(key, b"client", addr, theirs, mine))
    if not hmac.compare_digest(_exact(sock, _PROOF), _prove(key, b"unit", addr, theirs, mine)):
        raise LinkRefused("the process at the link address does not know the run's secret")


class Listener:
    """A storage unit's end: accepts connections on `addr` and serves each on a thread of its own:
    `answer` (under `lock`) turns each request's frames into the answer's."""

    def __init__(self, addr: str, secret: str, answer: Callable[[list[bytearray]], Sequence[Any]],
                 lock: threading.Lock, name: str) -> None:
        self._addr, self._key = addr, secret.encode()
        self._answer, self._lock, self._name = answer, lock, name
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._challenging = 0
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
            except OSError as e:
                if self._closed.is_set():
                    return
                log.warning("%s: a link connection could not be accepted (%s); trying again", self._name, e)
                time.sleep(0.1)  # out of descriptors, say: some may be let go
                continue
            with self._conns_lock:
                if self._closed.is_set() or self._challenging >= _CHALLENGES:
                    conn.close()  # closing, or too many strangers at once
                    continue
                self._conns.add(conn)
                self._challenging += 1
            try:
                threading.Thread(target=self._serve, args=(conn,), name=f"{self._name}-link-conn",
                                 daemon=True).start()
            except RuntimeError as e:  # no thread to be had
                log.warning("%s: no thread for a link connection (%s)", self._name, e)
                self._forget(conn, challenged=False)

    def _forget(self, conn: socket.socket, challenged: bool) -> None:
        with self._conns_lock:
            self._conns.discard(conn)
            if not challenged:
                self._challenging -= 1
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        challenged = False
        try:
            conn.settimeout(_HANDSHAKE_S)
            _challenge_as_unit(conn, self._key, self._addr)
            conn.settimeout(None)  # blocking: waits for the client's next request as long as it takes
            with self._conns_lock:
                self._challenging -= 1
            challenged = True
            while True:
                request = receive(conn)
                with self._lock:
                    if self._closed.is_set():
                        return  # the unit is closing: its storage may be going
                    reply = self._answer(request)
                send(conn, reply)
        except LinkRefused as e:
            log.warning("%s: refused a link connection: %s", self._name, e)
        except (OSError, LinkClosed):
            pass  # the client went, or the unit is closing
        except Exception:  # an answer that failed: the client's wait ends when the connection closes
            log.exception("%s: a request on a link failed", self._name)
        finally:
            self._forget(conn, challenged)

    def close(self) -> None:
        """Stop accepting and end every connection (its client's wait ends at once); returns once no
        answer is being made."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)
        with self._lock:  # an answer in progress ends; any later one sees the flag
            pass


class Links:
    """A client's connections to its units' links, kept for reuse (see the module): `take` one,
    then `give` it back after a whole exchange, or `drop` it after anything else."""

    def __init__(self, secret: str | None, addresses: Callable[[str], str], watch_s: float) -> None:
        self._key = secret.encode() if secret else None
        self._addresses = addresses
        self._watch_s = watch_s
        self._idle: dict[str, list[socket.socket]] = {}
        self._unlinked: dict[str, float] = {}  # unit -> when to try its link again (inf: never)
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._closed = False

    def _forked(self) -> None:
        """In a forked child: the parent's connections are the parent's (closed here: the child's
        copies of their descriptors would keep the units from seeing the parent let go of them)."""
        for socks in self._idle.values():
            for sock in socks:
                sock.close()
        self._idle, self._unlinked, self._pid = {}, {}, os.getpid()

    def take(self, unit: str, within_s: float = _HANDSHAKE_S) -> socket.socket | None:
        """A connection to `unit`'s link (an idle one, or a new one made within `within_s`), or None
        where the unit has no link (then use ZMQ)."""
        if self._key is None:
            return None
        with self._lock:
            if os.getpid() != self._pid:
                self._forked()
            if self._unlinked.get(unit, 0.0) > time.monotonic() or self._closed:
                return None
            idle = self._idle.get(unit)
            if idle:
                return idle.pop()
        return self._connect(unit, min(_HANDSHAKE_S, within_s))

    def give(self, unit: str, sock: socket.socket) -> None:
        """Back for reuse: `sock` ended an exchange, its answer read whole."""
        with self._lock:
            if os.getpid() == self._pid and not self._closed:
                self._idle.setdefault(unit, []).append(sock)
                return
        sock.close()

    def drop(self, unit: str, sock: socket.socket, unlink: bool = False) -> None:
        """Close `sock` (an exchange on it failed, or was abandoned); with `unlink`, reach `unit`
        by ZMQ from now on (its link broke: the unit died, or is closing)."""
        sock.close()
        if unlink:
            self._unlink(unit, float("inf"))

    def _unlink(self, unit: str, retry_s: float) -> None:
        with self._lock:
            self._unlinked[unit] = time.monotonic() + retry_s
            for other in self._idle.pop(unit, []):
                other.close()

    def _connect(self, unit: str, within_s: float) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        addr = self._addresses(unit)
        try:
            sock.settimeout(max(within_s, 0.001))
            sock.connect(addr)
            _challenge_as_client(sock, self._key, addr)  # type: ignore[arg-type]
            sock.settimeout(None)  # blocking, its sends and receives bounded by timeouts (`Deadline`)
            set_timeouts(sock, self._watch_s)
            return sock
        except LinkRefused as e:
            log.warning("storage unit %s: not using its link: %s", unit, e)
            retry_s = float("inf")
        except (ConnectionRefusedError, FileNotFoundError) as e:  # nothing listens here: another machine, links off
            log.debug("storage unit %s: no link (%s); using ZMQ", unit, e)
            retry_s = float("inf")
        except (OSError, LinkClosed) as e:  # a full backlog, a challenge that timed out: for a while
            log.debug("storage unit %s: link not reached (%s); using ZMQ for %gs", unit, e, _RETRY_S)
            retry_s = _RETRY_S
        sock.close()
        self._unlink(unit, retry_s)
        return None

    def close(self) -> None:
        with self._lock:
            idle, self._idle, self._closed = self._idle, {}, True
        for socks in idle.values():
            for sock in socks:
                sock.close()
