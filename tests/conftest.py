"""Session fixtures: one local Ray cluster and one data plane per backend, started on first use.

Everything stays on 127.0.0.1: on Linux Ray resolves ``_node_ip_address="127.0.0.1"`` to the
machine's external address unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (the switch behind
its loopback default on macOS/Windows) is set before ``ray.init``; TransferQueue binds to Ray's
node IP, so it follows. Ray is started once (about 4 s) and TransferQueue once (7-10 s); each
fixture shuts down only what it started.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Ray reads this when it is first imported, so set it before anything imports ray.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# rlgraph's own cache (the tokenizer classes AutoTokenizer chose, rlgraph.ops.models): the tests'
# many temporary tokenizers stay out of the user's, and the user's entries cannot change a test
if "RLGRAPH_CACHE" not in os.environ:
    os.environ["RLGRAPH_CACHE"] = tempfile.mkdtemp(prefix="rlgraph-tests-cache-")
    atexit.register(shutil.rmtree, os.environ["RLGRAPH_CACHE"], True)

import pytest  # noqa: E402

NUM_CPUS = 8  # logical CPUs: TQ reserves 1 for its controller and 1 per storage unit


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    if ray.is_initialized():  # someone else started it: use it, leave it running
        yield ray
        return
    from ray._private import ray_constants

    saved = {k: os.environ.get(k) for k in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "TQ_NUM_THREADS")}
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # workers inherit it
    os.environ.setdefault("TQ_NUM_THREADS", "2")
    # if ray was imported before this conftest, the flag was read already: apply it here too
    ray_constants.ENABLE_RAY_CLUSTER = False
    from rlgraph.runtime.cluster import lean_head

    # address="local": a Ray of the session's own, never one left by `ray start` (a multi-node test's);
    # lean, as `rlgraph run` starts it: without the head's API server and monitors
    with lean_head():
        ray.init(address="local", num_cpus=NUM_CPUS, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def tq_plane(ray_cluster):
    from rlgraph.runtime.dataplane import TransferQueueConfig, TransferQueueDataPlane

    plane = TransferQueueDataPlane.start(TransferQueueConfig(num_storage_units=2, op_timeout_s=30))
    yield plane
    plane.close()


@pytest.fixture(scope="session")
def ray_plane(ray_cluster):
    from rlgraph.runtime.dataplane import RayObjectStoreDataPlane

    plane = RayObjectStoreDataPlane.start(op_timeout_s=30)
    yield plane
    plane.close()


@pytest.fixture(params=["transferqueue", "ray_object_store"])
def plane(request):
    """Each test using it runs once per backend."""
    return request.getfixturevalue("tq_plane" if request.param == "transferqueue" else "ray_plane")
