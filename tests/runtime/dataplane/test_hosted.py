"""The data plane's controller as a host: of the only storage unit (`unit.UnitHost`,
``dataplane.host_unit``) and of a guest object (`guest.GuestHost`: the data source,
``dataplane.host_source``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from rlgraph.errors import RLGraphError
from rlgraph.runtime.dataplane import DataPlaneError
from rlgraph.runtime.dataplane.guest import GuestHost, Hosted


CLOSED: list[int] = []


class Counter:
    """A guest: counts its calls; fails to build when asked to (`fail`: True raises a typed error,
    "exit" calls sys.exit); `close` notes its start."""

    def __init__(self, start: int, fail: bool | str = False, delay_s: float = 0.0) -> None:
        time.sleep(delay_s)
        if fail == "exit":
            sys.exit(3)
        if fail:
            raise BadGuest(f"cannot start at {start}")
        self.start = self.n = start

    def bump(self, by: int = 1) -> int:
        self.n += by
        return self.n

    def leave(self) -> None:
        sys.exit(0)

    def close(self) -> None:
        CLOSED.append(self.start)


class BadGuest(RLGraphError):
    pass


class AsksTheHost:
    """A guest whose build asks its host actor through Ray, as a data-plane client's connect does."""

    def __init__(self) -> None:
        import ray

        host = ray.get_actor("TransferQueueController", namespace="transfer_queue")
        self.config = ray.get(host.get_config.remote(), timeout=20)

    def ok(self) -> str:
        return "answered"


IMPL = f"{__name__}:Counter"


def test_a_guest_is_built_on_a_thread_and_called_in_order():
    host = GuestHost()
    t0 = time.perf_counter()
    host.guest_start(IMPL, (10, False, 0.3), "counter", timeout_s=10)
    assert time.perf_counter() - t0 < 0.2  # returns before the guest is built
    assert host.guest_call("bump") == 11  # waits for the build
    assert host.guest_call("bump", by=5) == 16
    host.guest_start(IMPL, (0,), "counter", timeout_s=10)  # a new guest replaces the old
    assert host.guest_call("bump") == 1


def test_a_guest_that_fails_to_build_raises_its_own_error_at_each_call_and_the_host_lives():
    host = GuestHost()
    host.guest_start(IMPL, (3, True), "counter", timeout_s=10)
    for _ in range(2):
        with pytest.raises(BadGuest, match="cannot start at 3"):
            host.guest_call("bump")
    host.guest_start(IMPL, (3,), "counter", timeout_s=10)
    assert host.guest_call("bump") == 4


def test_a_guest_is_closed_when_stopped_by_its_own_token_or_replaced_even_while_it_builds():
    CLOSED.clear()
    host = GuestHost()
    host.guest_start(IMPL, (1,), "counter", timeout_s=10, token="a")
    assert host.guest_call("bump") == 2
    host.guest_stop("b")  # a late stop of another start: nothing happens
    assert host.guest_call("bump") == 3 and CLOSED == []
    host.guest_stop("a")
    assert CLOSED == [1]
    with pytest.raises(DataPlaneError, match="no guest was started"):
        host.guest_call("bump")
    host.guest_start(IMPL, (5, False, 0.5), "counter", timeout_s=10, token="c")  # still building when replaced
    host.guest_start(IMPL, (7,), "counter", timeout_s=10, token="d")
    assert host.guest_call("bump") == 8  # the newer guest answers
    deadline = time.time() + 5
    while 5 not in CLOSED and time.time() < deadline:
        time.sleep(0.05)
    assert CLOSED == [1, 5]  # the replaced build closed what it made, once it had made it
    host.guest_start(IMPL, (9,), "counter", timeout_s=10, token="e")
    assert host.guest_call("bump") == 10 and CLOSED == [1, 5, 7]  # a built guest is closed when replaced


def test_a_guest_that_exits_is_a_typed_error_not_the_host_s_end():
    host = GuestHost()
    host.guest_start(IMPL, (0, "exit"), "counter", timeout_s=10)
    with pytest.raises(DataPlaneError, match=r"the counter stopped while it was built: SystemExit\(3\)"):
        host.guest_call("bump")
    host.guest_start(IMPL, (0,), "counter", timeout_s=10)
    with pytest.raises(DataPlaneError, match=r"the counter's leave stopped: SystemExit\(0\)"):
        host.guest_call("leave")


def test_a_guest_that_does_not_build_in_time_is_a_typed_error_naming_it():
    host = GuestHost()
    host.guest_start(IMPL, (0, False, 2.0), "slow counter", timeout_s=0.2)
    with pytest.raises(DataPlaneError, match="the slow counter hosted by the data plane's controller was not built "
                                             r"within 0.2s"):
        host.guest_call("bump")
    with pytest.raises(DataPlaneError, match="no guest was started"):
        GuestHost().guest_call("bump")


def test_hosted_calls_go_to_the_host_s_guest_call():
    sent = []

    class Method:
        def remote(self, *args, **kwargs):
            sent.append((args, kwargs))
            return "ref"

    class Actor:
        guest_call = Method()

    hosted = Hosted(Actor())
    assert hosted.produce.remote("p", 4, validation=True) == "ref"
    assert sent == [(("produce", "p", 4), {"validation": True})]
    with pytest.raises(AttributeError):
        hosted.__deepcopy__  # noqa: B018  (copy and pickle probe dunders: not guest methods)


_HOSTED_PLANE = textwrap.dedent("""
    import os, sys, torch, ray
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    from rlgraph.runtime.dataplane import TransferQueueConfig, TransferQueueDataPlane
    from rlgraph.runtime.dataplane.tq import STORAGE_UNIT_NAME, _actor_nodes
    from rlgraph.runtime.dataplane.guest import Hosted
    plane = TransferQueueDataPlane.start(TransferQueueConfig(num_storage_units=1, host_unit=True, op_timeout_s=30))
    try:
        try:
            ray.get_actor(STORAGE_UNIT_NAME.format(0))
            print("UNIT ACTOR")
        except ValueError:
            print("NO UNIT ACTOR")
        print("ACTORS", sorted(plane.actors()))
        host = plane.guest_host()
        print("UNIT NODE", plane.storage_nodes() == _actor_nodes([host]) and len(plane.storage_nodes()) == 1)
        plane.create_partition("p", 4)
        # a worker's client in another process: the rows go to the unit in the controller's process
        @ray.remote(num_cpus=0)
        def put(handle):
            c = handle.connect()
            c.put("p", [0, 1, 2, 3], {"x": torch.arange(8.0).reshape(4, 2), "s": ["a", "b", "c", "d"]})
            c.close()
        ray.get(put.remote(plane.handle()), timeout=60)
        got = plane.get("p", (3, 1), ["x", "s"])
        print("GOT", got["x"].tolist(), list(got["s"]))
        sys.path.insert(0, os.environ["TEST_DIR"])
        guest = Hosted(host)
        host.guest_start.remote("test_hosted:Counter", (41,), "counter", 30.0)
        print("GUEST", ray.get(guest.bump.remote(), timeout=60))
        # a call sent at once waits for the build, which asks the host through Ray: on one thread both would wait
        host.guest_start.remote("test_hosted:AsksTheHost", (), "guest asking its host", 60.0)
        print("ASKED", ray.get(guest.ok.remote(), timeout=60))
        plane.clear("p")
    finally:
        plane.close()
    print("CLOSED")
    ray.shutdown()
""")


@pytest.mark.ray
def test_the_controller_hosts_the_only_storage_unit_and_a_guest():
    """A plane of its own (TQ allows one per Ray cluster, and the session has one): in a fresh
    Ray, the unit runs in the controller's process, rows put from another process come back, the
    unit's node is the controller's, and a guest answers there."""
    here = os.path.dirname(__file__)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env["TEST_DIR"] = here
    env["PYTHONPATH"] = os.pathsep.join([here] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    res = subprocess.run([sys.executable, "-c", _HOSTED_PLANE], capture_output=True, text=True, timeout=180, env=env)
    out = res.stdout
    assert res.returncode == 0, out + res.stderr[-3000:]
    assert "NO UNIT ACTOR" in out, out
    assert "ACTORS ['TransferQueue controller']" in out, out
    assert "UNIT NODE True" in out, out
    assert "GOT [[6.0, 7.0], [2.0, 3.0]] ['d', 'b']" in out, out
    assert "GUEST 42" in out, out
    assert "ASKED answered" in out, out
    assert "CLOSED" in out, out
