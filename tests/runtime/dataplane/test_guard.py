"""rlgraph.runtime.dataplane.guard: only the run's own processes talk to its TransferQueue.

A crafted message from another local process (no secret, or a wrong one) never reaches TQ's
decoder: it carries TQ's pickle marker and a payload that would create a file when unpickled,
and that file never appears. The run's own clients still work.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# TQ's decoder unpickles frames that follow this marker (transfer_queue.utils.serial_utils)
PICKLE_MARKER = b"\xc1\xfe\xed"


class _Touch:
    """Unpickling this creates a file: the proof that a message was executed."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path(self.path).touch, ())


def _attack(address: str, marker: Path, password: str | None) -> str:
    """From another process: connect to `address` (no PLAIN credentials, or a wrong password), send
    TQ's pickle frame and a pickled _Touch, and report whether any reply came back."""
    payload = pickle.dumps(_Touch(str(marker)))
    code = textwrap.dedent(f"""
        import sys, zmq
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, b"intruder")
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 3000)
        if {password!r} is not None:
            s.setsockopt(zmq.PLAIN_USERNAME, b"rlgraph")
            s.setsockopt(zmq.PLAIN_PASSWORD, {password!r}.encode())
        s.connect({address!r})
        s.send_multipart([{PICKLE_MARKER!r}, {payload!r}])
        try:
            s.recv_multipart()
            print("reply")
        except zmq.Again:
            print("no reply")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_an_unguarded_router_would_execute_the_payload(tmp_path):
    """The baseline the guard closes: TQ's decoder on TQ's frames runs the pickle."""
    from transfer_queue.utils.serial_utils import decode

    marker = tmp_path / "executed"
    try:
        decode([PICKLE_MARKER, pickle.dumps(_Touch(str(marker)))])
    except Exception:
        pass
    assert marker.exists()


def test_tq_sockets_refuse_a_process_without_the_secret(tq_plane, tmp_path):
    import ray

    from rlgraph.runtime.dataplane.tq import CONTROLLER_NAME, CONTROLLER_NAMESPACE

    controller = ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
    conf = ray.get(controller.get_config.remote(), timeout=30)
    addresses = [conf.controller.zmq_info.to_addr("request_handle_socket"),
                 conf.controller.zmq_info.to_addr("handshake_socket")]
    addresses += [info.to_addr("put_get_socket") for info in conf.backend.SimpleStorage.zmq_info.values()]
    assert len(addresses) == 4 and all(a.startswith("tcp://127.0.0.1:") for a in addresses)
    for i, address in enumerate(addresses):
        for password in (None, "not-the-secret-" + "x" * 20):
            marker = tmp_path / f"executed_{i}_{password is None}"
            assert _attack(address, marker, password) == "no reply"
            time.sleep(0.2)
            assert not marker.exists(), f"{address} executed a stranger's pickle"
    # the run's own clients are unaffected
    tq_plane.create_partition("guard_check", 2)
    import torch

    tq_plane.put("guard_check", [0, 1], {"x": torch.arange(2)})
    assert tq_plane.get("guard_check", [0, 1], ["x"])["x"].tolist() == [0, 1]
    tq_plane.clear("guard_check")


def test_the_handle_carries_the_secret_and_a_client_installs_it(tq_plane):
    from rlgraph.runtime.dataplane import guard

    handle = tq_plane.handle()
    assert handle.secret == guard.installed_secret() and len(handle.secret) >= 32
    assert "secret" not in repr(handle)  # never printed with the handle


def test_install_refuses_a_short_secret():
    from rlgraph.runtime.dataplane import guard

    with pytest.raises(ValueError, match="at least 16 characters"):
        guard.install("short")


def test_a_context_given_the_id_of_one_that_has_gone_gets_a_handler_of_its_own(tq_plane):
    """Python may give a new context the id of a terminated one; the new one must still admit the
    run's clients (before the fix its listening sockets had no handler and every handshake hung)."""
    import threading
    import weakref

    import zmq

    from rlgraph.runtime.dataplane import guard

    server_ctx, client_ctx, gone = zmq.Context(), zmq.Context(), zmq.Context()
    finished = threading.Thread(target=lambda: None)
    finished.start()
    finished.join()
    guard._handlers[id(server_ctx)] = (weakref.ref(gone), finished)  # what the gone context left behind
    router = guard.guarded_socket(server_ctx, zmq.ROUTER, "127.0.0.1")
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = guard.guarded_socket(client_ctx, zmq.DEALER, "127.0.0.1", identity=b"TQ_STORAGE_guard_test")
    try:
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"hello")
        assert router.poll(5000), "the run's own client was not admitted"
        assert router.recv_multipart()[-1] == b"hello"
    finally:
        dealer.close(linger=0)
        router.close(linger=0)
        for c in (server_ctx, client_ctx, gone):
            c.term()
