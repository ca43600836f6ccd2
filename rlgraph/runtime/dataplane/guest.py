"""A guest in the data plane's controller: an object of the run's, living in that actor's process.

Every Ray actor is a process, and on a small machine each one's start is dear: Python, Ray's core
worker, torch imported (about 2.5 CPU-seconds each on 2 cores, where start-up is bound by the CPU;
docs/performance.md, section 17). TransferQueue's controller is such a process, mostly idle: it
keeps metadata and answers a few requests a step on its own threads. `GuestHost`, mixed into its
actor class (`guard.guarded_actor_class`), lets the runtime place an object there, the data source
(`rlgraph.runtime.source.SourceWorker`; ``dataplane.host_source``), instead of starting a process
for it:

- `guest_start` builds the guest on a thread of its own and returns at once, so the controller's
  Ray methods (TQ's, asked by clients as they connect) do not wait for the guest's imports;
- `guest_stop` closes it (its token names which start: a late stop never ends a newer guest);
- `guest_call` runs one of its methods, calls one at a time in the order they were sent, as an
  actor of its own would run them, on a thread of their own (the concurrency group `GROUP`), not
  the one TQ's own Ray methods run on: the first call waits for the guest to be built (at most its
  timeout, then `DataPlaneError` naming the guest), and the build itself asks the controller
  through Ray (a data-plane client's connect asks for TQ's config), which would wait for ever
  behind a call waiting for the build on one thread. A guest whose build failed raises that error
  at each call, so the run sees the source's own typed error, and the controller lives on.

A guest dies with its host: a dead controller is a dead data plane, which the runner replaces
(`rlgraph.runtime.fleet.Fleet.restart_plane`) with the source started again on the new one; a
hosted source that stops answering (a call that hangs) is handled the same way, since only
ending its host ends the call.
`Hosted` is the driver's side: ``hosted.produce.remote(...)`` as on an actor handle.
"""

from __future__ import annotations

import threading
from typing import Any

import ray

__all__ = ["GROUP", "GuestHost", "Hosted"]

GROUP = "rlgraph_guest"  # the host actor's concurrency group of the guest's calls


class _Guest:
    """One start of a guest: what its build made (or the error), set once the build ends."""

    def __init__(self, name: str, token: str, timeout_s: float) -> None:
        self.name, self.token, self.timeout_s = name, token, timeout_s
        self.obj: Any = None
        self.error: BaseException | None = None
        self.ready = threading.Event()


def _close(obj: Any) -> None:
    close = getattr(obj, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # its resources go with the host's process at the latest
            pass


class GuestHost:
    """Mixin for a data-plane actor class: hosts one guest object (see the module). The actor
    class declares `CONCURRENCY_GROUPS` (`guard.guarded_actor_class` does)."""

    CONCURRENCY_GROUPS = {GROUP: 1}

    _guest: _Guest | None = None

    @ray.method(concurrency_group=GROUP)
    def guest_start(self, impl: str, args: tuple = (), name: str = "guest", timeout_s: float = 600.0,
                    token: str = "") -> None:
        """Build ``impl`` ("module:Class") with `args` on a thread; replaces any guest before it (a
        build still running when it is replaced closes what it made). `token` names this start for
        `guest_stop`."""
        from rlgraph.runtime.dataplane.base import DataPlaneError

        guest, old = _Guest(name, token, timeout_s), self._guest
        self._guest = guest
        if old is not None and old.ready.is_set():
            _close(old.obj)

        def build() -> None:
            try:
                from importlib import import_module

                module, _, cls = impl.partition(":")
                guest.obj = getattr(import_module(module), cls)(*args)
            except Exception as e:  # raised at each call: the run sees it, the host lives on
                guest.error = e
            except BaseException as e:  # SystemExit and the like: not the host's to end with
                guest.error = DataPlaneError(f"the {name} stopped while it was built: {e!r}")
            finally:
                guest.ready.set()
            if self._guest is not guest:  # replaced meanwhile
                _close(guest.obj)

        threading.Thread(target=build, name=f"rlgraph_guest_{name}", daemon=True).start()

    @ray.method(concurrency_group=GROUP)
    def guest_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The guest's `method` with `args`, once the guest is built."""
        from rlgraph.runtime.dataplane.base import DataPlaneError

        guest = self._guest
        if guest is None:
            raise DataPlaneError(f"no guest was started in this data-plane process (asked for {method!r})")
        if not guest.ready.wait(guest.timeout_s):
            raise DataPlaneError(f"the {guest.name} hosted by the data plane's controller was not built "
                                 f"within {guest.timeout_s:g}s (its imports and set-up)")
        if guest.error is not None:
            raise guest.error
        try:
            return getattr(guest.obj, method)(*args, **kwargs)
        except Exception:
            raise
        except BaseException as e:  # SystemExit in an actor's call would end the host
            raise DataPlaneError(f"the {guest.name}'s {method} stopped: {e!r}") from None

    def guest_stop(self, token: str) -> None:
        """Close and drop the guest that `guest_start` with `token` made, if it is still the one
        here; a build still running closes what it makes. Never raises. On the host's own thread,
        not behind the guest's calls (one may hang: the host still lets go of it)."""
        guest = self._guest
        if guest is None or guest.token != token:
            return
        self._guest = None
        if guest.ready.is_set():
            _close(guest.obj)


class _Method:
    def __init__(self, actor: Any, name: str) -> None:
        self.actor, self.name = actor, name

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.actor.guest_call.remote(self.name, *args, **kwargs)


class Hosted:
    """The driver's handle on a guest: ``hosted.<method>.remote(...)`` runs it in the host actor."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Method(self.actor, name)
