"""Starting or joining Ray, and checking the cluster against the plan before any actor starts.

With no address, a new Ray starts locally on 127.0.0.1 (``RAY_ADDRESS`` and clusters left by
``ray start`` are ignored; only an explicit address joins one), with the plan's node size as its logical CPUs
(CPU counts in a plan are logical, so a 2-core laptop can run a plan declared for 8 CPUs); with
an address, the run joins that cluster. Either way, every resource the plan needs, the data
plane's included, is compared with what the cluster has, and anything missing fails the run
with a list, instead of a placement group that waits forever (peers hang here).

A local Ray starts lean (`lean_head`): without the three Python processes of Ray's head that a
run does not use, the dashboard's API server (state and job APIs, usage statistics; the dashboard
itself is off), the autoscaler's monitor and, unless ``--verbose`` streams the workers' output, the
log monitor. Each is a process that imports Ray's Python side, about 1.5 CPU-seconds in all, and
``ray.init`` waits for the API server before it returns (2.6 s -> 1.8 s on 2 cores, where start-up
is bound by the CPU). Two more changes to the same call: the dashboard agent the raylet starts is
its minimal one (no HTTP server: nothing reaches it without the API server), so this process
skips importing the agent's web dependencies to decide that; and ``ray.init`` learns that its node
registered by asking every 20 ms (`NODE_POLL_S`) instead of Ray's own wait, which checks once a
second (``GlobalStateAccessor::GetNode``) for a node that registers after 0.7-1.4 s here, so it
returned on the next whole second. ``RLGRAPH_RAY_HEAD=full`` starts Ray as it is (``ray list``,
``ray status`` and job submission need the API server).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from rlgraph.errors import RLGraphError
from rlgraph.graph.config import flatten
from rlgraph.graph.packing import Slot, dataplane_actors, pack
from rlgraph.graph.plan import Plan

__all__ = ["ClusterError", "NodeLost", "RayHandle", "alive_nodes", "check_cluster", "check_lost_nodes",
           "force_loopback", "lean_head", "missing_resources", "prune_sessions", "start_ray"]

log = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"
MARKER = "rlgraph_started"  # written into the session directory of every Ray an rlgraph run starts
SESSIONS_KEPT = 5  # finished rlgraph sessions kept in Ray's temp folder (RLGRAPH_RAY_SESSIONS_KEPT)
RAY_HEAD_ENV = "RLGRAPH_RAY_HEAD"  # "full": a local Ray starts its API server and monitors too
NODE_POLL_S = 0.02  # how often a lean start asks whether its node registered (`lean_head`)
NODE_WAIT_S = 30.0  # Ray's own wait for it (raylet_start_wait_time_s)


class ClusterError(RLGraphError):
    """Ray could not be started or joined, or the cluster lacks resources the plan needs."""


class NodeLost(ClusterError):
    """Nodes of the cluster died during the run and the remaining ones cannot hold the plan."""


@dataclass
class RayHandle:
    """Ray as this run found it: whether we started it (and so must stop it)."""

    started_here: bool
    address: str | None
    seconds: float = 0.0  # how long starting it took, when it was started before the fleet (`rlgraph run`)
    token_auth: bool | None = None  # Ray's token authentication (None: Ray did not say)

    def shutdown(self) -> None:
        import ray

        if self.started_here and ray.is_initialized():
            ray.shutdown()


GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd")  # NVIDIA's, AMD's (ROCm)


def _local_gpus() -> int:
    """The GPUs torch can use on this machine. Without a GPU driver's device files there are none,
    and torch is not imported to say so: ``start_ray`` runs before Ray starts, beside the run's own
    imports, and importing torch there (~1 s of CPU) held Ray's start back."""
    if not any(os.path.exists(f) for f in GPU_DEVICE_FILES):
        return 0
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # torch without CUDA support
        return 0


def force_loopback() -> None:
    """Keep a local Ray (and TransferQueue, which binds to Ray's node address) on 127.0.0.1.

    On Linux, Ray resolves ``_node_ip_address="127.0.0.1"`` to the external interface unless its
    cluster mode is off: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (inherited by Ray's workers) and
    the constant it was read into, for the case where ray was imported before this call.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def start_ray(plan: Plan, address: str | None = None, verbose: bool = False) -> RayHandle:
    """Join `address`, or start Ray locally on 127.0.0.1 sized from the plan.

    An already initialised Ray (e.g. a test session's) is reused and left running. The actors'
    own output (Ray's notices, engine logs, worker-death dumps) reaches this terminal only when
    `verbose`; it is always in Ray's session logs (/tmp/ray/session_latest/logs).
    """
    import logging

    import ray

    os.environ.setdefault("TQ_NUM_THREADS", "2")
    if not verbose:  # Ray's own notices (token authentication, start-up) are not the user's business
        logging.getLogger("ray").setLevel(logging.ERROR)
    if ray.is_initialized():
        return RayHandle(started_here=False, address=None)
    if address:
        try:
            ray.init(address=address, log_to_driver=verbose, configure_logging=verbose)
        except Exception as e:
            raise ClusterError(f"cannot join the Ray cluster at {address!r}: {type(e).__name__}: {e}; check the "
                               f"address (ray status on the head node prints it)") from e
        return RayHandle(started_here=True, address=address, token_auth=_token_auth())
    if plan.cluster.num_nodes > 1:
        raise ClusterError(
            f"the plan was compiled for {plan.cluster.num_nodes} nodes, but no --address was given and a local "
            f"Ray has one node; pass --address of your cluster, or recompile with cluster.num_nodes=1"
        )
    force_loopback()
    from rlgraph.runtime.reaper import start_reaper

    # before ray.init: a driver killed at any moment takes what it started along (Ray's agents would
    # hold their ports for a minute)
    start_reaper()
    try:
        with _stderr_held(not verbose), lean_head(verbose):
            ray.init(
                # "local": always a new Ray of our own on 127.0.0.1; never join a cluster named by
                # RAY_ADDRESS or left by `ray start` (only --address joins one)
                address="local",
                num_cpus=max(int(plan.cluster.cpus_per_node), 1),
                num_gpus=_local_gpus(),
                include_dashboard=False,
                _node_ip_address=LOOPBACK,
                log_to_driver=verbose,
                configure_logging=False,
            )
    except Exception as e:
        raise ClusterError(f"cannot start a local Ray on {LOOPBACK}: {type(e).__name__}: {e}; check free disk space "
                           f"in the Ray temp folder (/tmp/ray) and leftover Ray processes (`ray stop` ends "
                           f"those you started), or join a running cluster with --address") from e
    _mark_and_prune()
    return RayHandle(started_here=True, address=None, token_auth=_token_auth())


@contextlib.contextmanager
def lean_head(verbose: bool = False) -> Iterator[None]:
    """While ``ray.init`` starts a local Ray in this process: no dashboard API server, no autoscaler
    monitor, no log monitor unless `verbose`, the minimal dashboard agent, and the wait for the node
    in steps of `NODE_POLL_S` (see the module). Ray's ``ray.init`` has no option for them, so its
    node parameters, its node's API-server start, its check for the dashboard's dependencies and
    its node lookup are replaced for that call only (Ray pinned to 2.60.x, whose layout this is;
    another layout starts Ray as it is)."""
    if os.environ.get(RAY_HEAD_ENV, "lean") == "full":
        yield
        return
    try:
        from ray._private import node, parameter, services
        from ray._private import utils as ray_utils

        params, api_server = parameter.RayParams.__init__, node.Node.start_api_server
        get_node, agent_deps = services.get_node, ray_utils.get_dashboard_dependency_error
    except (ImportError, AttributeError):  # pragma: no cover - another Ray's layout
        yield
        return

    def lean_params(self: object, *args: object, **kwargs: object) -> None:
        params(self, *args, **kwargs)
        self.no_monitor = True  # type: ignore[attr-defined]
        self.include_log_monitor = bool(verbose)  # type: ignore[attr-defined]

    def no_api_server(self: object, **_: object) -> None:
        self._webui_url = None  # type: ignore[attr-defined]  # what the node reports as its dashboard

    def minimal_agent() -> ImportError:  # read as "the dashboard's dependencies are absent": --minimal
        return ImportError("rlgraph's lean local Ray: the dashboard agent without its HTTP server")

    def registered_node(gcs_address: str, node_id: str) -> object:
        _wait_for_node(gcs_address, node_id)
        return get_node(gcs_address, node_id)  # found now: Ray's own call returns at once

    parameter.RayParams.__init__ = lean_params  # type: ignore[method-assign]
    node.Node.start_api_server = no_api_server  # type: ignore[method-assign]
    services.get_node, ray_utils.get_dashboard_dependency_error = registered_node, minimal_agent
    try:
        yield
    finally:
        parameter.RayParams.__init__ = params  # type: ignore[method-assign]
        node.Node.start_api_server = api_server  # type: ignore[method-assign]
        services.get_node, ray_utils.get_dashboard_dependency_error = get_node, agent_deps


def _wait_for_node(gcs_address: str, node_id: str) -> None:
    """Until the GCS at `gcs_address` lists node `node_id` alive, asking every `NODE_POLL_S`, for at
    most `NODE_WAIT_S` (then Ray's own wait says what is missing)."""
    import time

    from ray._private import services, state

    gcs = state.GlobalState()
    try:
        gcs._initialize_global_state(services._get_gcs_client_options(gcs_address))
        end = time.monotonic() + NODE_WAIT_S
        while time.monotonic() < end:
            if any(n.get("NodeID") == node_id and n.get("Alive") for n in gcs.node_table()):
                return
            time.sleep(NODE_POLL_S)
    except Exception as e:  # noqa: BLE001 - Ray's own wait, after this, reports what is wrong
        log.debug("waiting for the node in the GCS: %s", e)
    finally:
        gcs.disconnect()


@contextlib.contextmanager
def _stderr_held(hold: bool) -> Iterator[None]:
    """While ``ray.init`` runs, this process's stderr (fd 2) goes to a temp file, written out after
    it unless a stop signal (Ctrl-C, SIGTERM) cut it short: a signal landing in Ray's C++ start-up
    makes Ray's failure-signal handler print a stack dump, and an interrupted run says one line."""
    if not hold:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        stopped = False
        try:
            yield
        except KeyboardInterrupt:
            stopped = True
            raise
        except SystemExit as e:  # Ray's own SIGTERM handler, installed while ray.init runs
            stopped = e.code == int(signal.SIGTERM)
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if not stopped:
                tmp.seek(0)
                held = tmp.read()
                if held:
                    os.write(2, held)


def _token_auth() -> bool | None:
    """Whether Ray's token authentication is on (Ray turns it on for a cluster it starts); off, any process
    reaching Ray's ports may run code in it, so say so (docs/runtime.md, Security)."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # another Ray layout: nothing to say
        return None
    on = bool(is_token_auth_enabled())
    if not on:
        import warnings

        warnings.warn(f"Ray's token authentication is off (RAY_AUTH_MODE={os.environ.get('RAY_AUTH_MODE', '')!r}): "
                      f"any process that reaches this Ray's ports can run code in it; unset RAY_AUTH_MODE unless "
                      f"the machine is yours alone (docs/runtime.md, Security)", RuntimeWarning, stacklevel=3)
    return on


def _mark_and_prune() -> None:
    """Mark this Ray's session directory as an rlgraph run's and delete old finished ones, so that
    Ray's temp folder stops growing (Ray itself never deletes a session directory)."""
    try:
        from ray._private.worker import _global_node

        session = Path(_global_node.get_session_dir_path())
        (session / MARKER).write_text(str(os.getpid()))
        kept = int(os.environ.get("RLGRAPH_RAY_SESSIONS_KEPT", SESSIONS_KEPT))
        removed = prune_sessions(session.parent, kept, current=session)
    except Exception as e:  # housekeeping must never stop a run
        log.debug("could not prune old Ray session directories: %s", e)
        return
    if removed:
        log.info("removed %d old rlgraph Ray session director%s from %s", len(removed),
                 "y" if len(removed) == 1 else "ies", session.parent)


def prune_sessions(root: Path, kept: int, current: Path | None = None) -> list[Path]:
    """Delete all but the newest `kept` finished session directories under `root` that an rlgraph
    run started (they hold `MARKER`); returns those deleted. A session is finished when the process
    that started it (its pid, in the marker) is gone. Sessions of other Ray users, running ones and
    `current` are never touched."""
    import shutil

    import psutil

    finished = []
    for d in root.glob("session_*"):
        marker = d / MARKER
        if d.is_symlink() or not marker.is_file() or (current is not None and d.resolve() == current.resolve()):
            continue
        try:
            if psutil.pid_exists(int(marker.read_text().strip() or "0")):
                continue
            finished.append((marker.stat().st_mtime, d))
        except (OSError, ValueError):
            continue
    finished.sort(reverse=True)
    removed = []
    for _, d in finished[max(kept, 0):]:
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def missing_resources(plan: Plan, nodes: list[dict[str, float]]) -> list[str]:
    """What the plan needs that `nodes` (each node's total resources) lack, as sentences.

    Checks the totals, then that every bundle fits on some node, by the compiler's packing rule
    (`rlgraph.graph.packing.pack`) applied to the real nodes.
    """
    need_cpu = plan.cluster.required_cpus
    need_gpu = plan.cluster.required_gpus
    have_cpu = sum(n.get("CPU", 0.0) for n in nodes)
    have_gpu = sum(n.get("GPU", 0.0) for n in nodes)
    out = []
    if need_cpu > have_cpu + 1e-9:
        out.append(f"{need_cpu:g} CPUs needed ({plan.cluster.dataplane_cpus:g} for the data plane, the rest for "
                   f"worker groups), the cluster has {have_cpu:g}")
    if need_gpu > have_gpu + 1e-9:
        out.append(f"{need_gpu:g} GPUs needed, the cluster has {have_gpu:g}")
    if out:
        return out
    slots = [Slot(p.name, b.index, b.num_cpus, b.num_gpus, p.placement) for p in plan.pools
             for b in p.bundles]
    packing = pack([(n.get("CPU", 0.0), n.get("GPU", 0.0)) for n in nodes], slots,
                   dataplane_actors(flatten(plan.config)))
    if not packing.unplaced:
        return []
    free = ", ".join(f"node {i} {c:g} CPU / {g:g} GPU" for i, (c, g) in
                     enumerate(zip(packing.free_cpus, packing.free_gpus)))
    strict = " (strict_spread: one node per slot)" if any(s.placement == "strict_spread" for s in packing.unplaced) else ""
    return [f"pool {s.pool!r} slot {s.index} needs {s.cpus:g} CPU and {s.gpus:g} GPU on one node{strict}; no node has "
            f"that left (free after the data plane and the other slots: {free})" for s in packing.unplaced]


def alive_nodes() -> dict[str, dict[str, float]]:
    """The cluster's live nodes: Ray node id -> its total resources."""
    import ray

    return {n["NodeID"]: n["Resources"] for n in ray.nodes() if n.get("Alive")}


def check_lost_nodes(plan: Plan, started_on: dict[str, dict[str, float]]) -> list[str]:
    """Nodes of `started_on` (the cluster when the run started) that are gone, by id; raise
    `NodeLost` when the nodes left lack what `plan` needs, naming the lost nodes and each pool's
    slots that no longer fit, instead of restarting workers that would wait for a node forever."""
    now = alive_nodes()
    lost = [node for node in started_on if node not in now]
    if lost:
        missing = missing_resources(plan, list(now.values()))
        if missing:
            names = ", ".join(f"{node[:12]} ({started_on[node].get('CPU', 0):g} CPU, "
                              f"{started_on[node].get('GPU', 0):g} GPU)" for node in lost)
            raise NodeLost(
                f"lost {len(lost)} node(s) of the cluster: {names}; the {len(now)} node(s) left cannot hold the "
                f"plan:\n  - " + "\n  - ".join(missing) + "\nfix: add a node with those resources (ray start "
                "--address=...) and resume (`rlgraph run ... --resume`), or recompile for the smaller cluster "
                "(lower groups.<name>.dp, or placement=spread instead of strict_spread)")
    return lost


def check_cluster(plan: Plan) -> dict[str, dict[str, float]]:
    """Raise `ClusterError` listing every resource the running Ray cluster lacks for `plan`;
    returns the live nodes it checked (`alive_nodes`)."""
    nodes = alive_nodes()
    missing = missing_resources(plan, list(nodes.values()))
    if missing:
        raise ClusterError(
            "the Ray cluster lacks resources this plan needs (nothing was started):\n  - "
            + "\n  - ".join(missing)
            + "\nfix: recompile for this cluster (cluster.cpus_per_node=..., groups.<name>.dp=..., "
            "groups.<name>.num_cpus=...), or add nodes"
        )
    return nodes
