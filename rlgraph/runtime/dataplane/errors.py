"""The data plane's errors, and the check for its dead actors: what the driver's runner needs of the
data plane before it starts one, importable without torch (`rlgraph.runtime.actor` says why)."""

from __future__ import annotations

from rlgraph.errors import RLGraphError

__all__ = ["DataPlaneDied", "DataPlaneError", "dead_actors"]


class DataPlaneError(RLGraphError):
    """The data plane could not start, was misused (unknown rows, missing columns, bad values),
    or a wait on it timed out. The message names the partition, column or resource."""


class DataPlaneDied(DataPlaneError):
    """A process of the data plane (a TransferQueue controller or storage unit, the Ray store's
    tracker) died. The runner restarts the plane and replays the step; the message names it."""

    def __init__(self, dead: list[str], what: str = "") -> None:
        self.dead = list(dead)
        super().__init__(f"the data plane's {', '.join(self.dead)} died" + (f" while {what}" if what else "")
                         + "; rlgraph restarts the data plane and every worker, and replays the step")


def dead_actors(actors: dict[str, object]) -> list[str]:
    """The names of those `actors` (name -> Ray actor handle) that Ray's control store (GCS)
    records as dead: a lookup per actor, no call into it, so a busy actor is never mistaken for
    a dead one and a dead one is seen within a poll, not after a request's timeout."""
    from ray._private import state  # the GCS actor table; ray.util.state would need the dashboard

    dead = []
    for name, handle in actors.items():
        try:
            info = state.actors(actor_id=handle._actor_id.hex())  # type: ignore[attr-defined]
        except Exception:  # the GCS is unreachable: the run's own waits will say so
            continue
        if info and info.get("State") == "DEAD":
            dead.append(name)
    return dead
