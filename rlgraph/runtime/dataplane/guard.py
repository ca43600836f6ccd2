"""Only the run talks to its data plane: a per-run secret on every TransferQueue socket.

TransferQueue's controller and storage units listen on ZMQ ROUTER sockets and decode what
arrives with TQ's own decoder, which unpickles some frames (its pickle fallback, msgpack
extension types, checkpoint-load requests naming a file). Any local process that could reach
such a port could make it run code. rlgraph closes that door at the handshake: every socket
TransferQueue creates goes through `guarded_socket`, which makes

- each listening (ROUTER) socket a ZMQ PLAIN server, whose ZAP handler (`_ZapHandler`, one
  thread per ZMQ context, bound before the socket is) admits only the user name ``rlgraph`` with
  this run's secret, compared in constant time (pyzmq's ``ThreadAuthenticator`` leaves its
  sockets open when the context terminates, which would hang TQ's shutdown);
- each connecting (DEALER) socket with an identity (TQ's clients) a PLAIN client presenting it.

A peer without the secret never completes the handshake, so nothing it sends reaches TQ's
decoder. In-process sockets (a storage unit's proxy to its worker threads, ``inproc://``) carry
no identity and are left as they are.

The secret (`new_secret`, 32 random bytes, URL-safe text) is made by the driver for each data
plane and travels only through Ray (actor arguments and the pickled handle), whose channels
carry Ray's own token authentication. `install` puts the hook into a process: the driver
before ``tq.init``, each worker and the data source in ``connect``, and TQ's controller and
storage units through `guarded_actor_class`, a subclass of TQ's actor class whose constructor
installs the hook before TQ's opens its sockets.

PLAIN sends the secret in clear text: enough on one machine (loopback) and on a private cluster
network; over an untrusted network use an encrypted transport (a VPN or IPsec between nodes).
"""

from __future__ import annotations

import hmac
import secrets
import threading
import weakref
from typing import Any

import zmq

__all__ = ["new_secret", "install", "installed_secret", "guarded_socket", "guarded_actor_class", "USER",
           "TQ_SOCKET_MODULES"]

USER = "rlgraph"
DOMAIN = "rlgraph"  # the ZAP domain of the servers
# the TransferQueue modules that create sockets (each imported `create_zmq_socket` by name)
TQ_SOCKET_MODULES = ("transfer_queue.utils.zmq_utils", "transfer_queue.controller",
                     "transfer_queue.storage.simple_storage", "transfer_queue.storage.managers.base")

_lock = threading.Lock()
_secret: str | None = None
_original: Any = None  # TQ's create_zmq_socket
_handlers: dict[int, Any] = {}  # id(context) -> (the context, weakly; its ZAP handler thread)


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def installed_secret() -> str | None:
    """The secret this process's TQ sockets use (None: not installed)."""
    return _secret


class _ZapHandler(threading.Thread):
    """The ZAP handler (ZMQ RFC 27) of one context: admits a PLAIN peer presenting `USER` and the
    secret, refuses every other. Its socket lives in its own thread and closes when the context
    terminates, so TQ's shutdown (``ctx.term()``) is not held up by it."""

    ENDPOINT = "inproc://zeromq.zap.01"

    def __init__(self, ctx: zmq.Context) -> None:
        super().__init__(name="rlgraph_zap", daemon=True)
        self.ctx = zmq.Context.shadow(ctx.underlying)  # a plain (sync) view of the same context
        self.bound = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            sock = self.ctx.socket(zmq.REP)
            sock.linger = 0
            sock.bind(self.ENDPOINT)
        except BaseException as e:  # reported by `_zap_handler`
            self.error = e
            self.bound.set()
            return
        self.bound.set()
        try:
            while True:
                frames = sock.recv_multipart()
                request_id = frames[1] if len(frames) > 1 else b""
                ok = _admits(frames)
                sock.send_multipart([b"1.0", request_id, b"200" if ok else b"400",
                                     b"OK" if ok else b"not this run's process", b"", b""])
        except zmq.ContextTerminated:
            pass
        finally:
            sock.close(linger=0)


def _admits(frames: list[bytes]) -> bool:
    """A ZAP request: version, request id, domain, address, identity, mechanism, credentials."""
    if len(frames) != 8 or frames[0] != b"1.0" or frames[5] != b"PLAIN" or _secret is None:
        return False
    return frames[6] == USER.encode() and hmac.compare_digest(frames[7], _secret.encode())


def _zap_handler(ctx: zmq.Context) -> None:
    """Start the ZAP handler of `ctx` once, before any of its sockets accepts a peer."""
    key = id(ctx)
    known = _handlers.get(key)
    # the id of a context that has gone may be given to a new one: the handler must be this one's
    if known is not None and known[0]() is ctx and known[1].is_alive():
        return
    handler = _ZapHandler(ctx)
    handler.start()
    if not handler.bound.wait(10) or handler.error is not None:
        raise RuntimeError(f"the data plane's authentication handler did not start: {handler.error!r}")
    _handlers[key] = (weakref.ref(ctx), handler)


def guarded_socket(ctx: zmq.Context, socket_type: Any, ip: str, identity: bytes | None = None) -> zmq.Socket:
    """TQ's ``create_zmq_socket``, with PLAIN authentication on its network sockets."""
    sock = _original(ctx, socket_type, ip, identity=identity)
    if _secret is None:
        return sock
    if socket_type == zmq.ROUTER:
        with _lock:
            _zap_handler(ctx)
        sock.setsockopt(zmq.PLAIN_SERVER, 1)
        sock.setsockopt(zmq.ZAP_DOMAIN, DOMAIN.encode())
    elif socket_type == zmq.DEALER and identity is not None:
        sock.setsockopt(zmq.PLAIN_USERNAME, USER.encode())
        sock.setsockopt(zmq.PLAIN_PASSWORD, _secret.encode())
    return sock


def install(secret: str) -> None:
    """Make every socket TransferQueue creates in this process from now on use `secret`.
    Idempotent; a second, different secret (a new data plane in the same process) replaces the
    first for sockets made after it."""
    global _secret, _original
    import importlib

    if not isinstance(secret, str) or len(secret) < 16:
        raise ValueError("the data plane's secret must be a string of at least 16 characters")
    with _lock:
        if _original is None:
            from transfer_queue.utils import zmq_utils

            _original = zmq_utils.create_zmq_socket
        for name in TQ_SOCKET_MODULES:
            module = importlib.import_module(name)
            if getattr(module, "create_zmq_socket", None) is not guarded_socket:
                module.create_zmq_socket = guarded_socket
        _secret = secret  # the handlers read it at each handshake


def guarded_actor_class(actor_class: Any, secret: str, mixins: tuple[type, ...] = ()) -> Any:
    """A Ray actor class made from TransferQueue's `actor_class` (``@ray.remote`` on TQ's class)
    whose constructor installs `secret` before TQ's constructor opens its sockets; `mixins` come
    before TQ's class (`rlgraph.runtime.dataplane.unit.DirectUnit` for a storage unit). Its CPUs
    and GPUs are TQ's; the concurrency groups its mixins declare (``CONCURRENCY_GROUPS``) its own."""
    import ray

    meta = actor_class.__ray_metadata__
    base = meta.modified_class.__ray_actor_class__  # the class TQ decorated

    from rlgraph.runtime.dataplane.lean import LeanImports

    # LeanImports first: the actor's process imports tensordict the lean way before TQ's modules
    class Guarded(LeanImports, *mixins, base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            from rlgraph.runtime.dataplane import guard

            guard.install(secret)
            super().__init__(*args, **kwargs)
            from rlgraph import heap

            heap.freeze()  # imports: out of the collector's full collections

    Guarded.__name__ = Guarded.__qualname__ = meta.class_name
    Guarded.__module__ = __name__
    groups = {name: n for m in mixins for name, n in getattr(m, "CONCURRENCY_GROUPS", {}).items()}
    options = {"concurrency_groups": groups} if groups else {}  # a mixin's own threads (`guest.GuestHost`)
    return ray.remote(num_cpus=meta.num_cpus, num_gpus=meta.num_gpus, **options)(Guarded)
