"""Security (issue 7, item 5): plans and checkpoints load without unpickling anything, and Ray
and the data plane listen on 127.0.0.1 unless an address is given.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import torch

from rlgraph.graph.plan import load_plan
from rlgraph.runtime.checkpoint import CHECKPOINT_FORMAT, CheckpointError, latest_checkpoint, load_state, save_state

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = str(ROOT / "tests" / "resources" / "tensor_pipeline.py")


class _Payload:
    """Unpickling this creates `marker`: the proof that a load ran code from a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _crafted(marker: Path) -> bytes:
    return pickle.dumps({"weight": _Payload(marker)})


def test_the_payload_is_live(tmp_path):
    """The crafted files below would run code if anything unpickled them."""
    marker = tmp_path / "ran"
    pickle.loads(_crafted(marker)).get("weight").close()
    assert marker.exists()


def _refuse_unpickling(monkeypatch) -> None:
    """From here on, every deserialiser that can run code raises if it is called."""

    def refuse(*a, **k):
        raise AssertionError("a load path unpickled a file")

    class RefusingUnpickler(pickle.Unpickler):
        def load(self):
            refuse()

    import ray.cloudpickle

    monkeypatch.setattr(pickle, "Unpickler", RefusingUnpickler)
    for mod, names in ((pickle, ("load", "loads")), (torch, ("load",)), (ray.cloudpickle, ("load", "loads"))):
        for name in names:
            monkeypatch.setattr(mod, name, refuse)


def test_checkpoint_and_plan_loads_never_unpickle(tmp_path, monkeypatch):
    from rlgraph.graph.compile import compile_pipeline
    from rlgraph.graph.loader import load_pipeline

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    d = tmp_path / "checkpoints" / "step_0"
    save_state({"columns": {"w": model.state_dict()}, "instances": {"0": {"opt": opt.state_dict()}}}, d, "actor_0")
    save_state({"epoch": 0, "offset": 4, "val_offset": 0}, d, "source")
    (d / "meta.json").write_text(json.dumps({"format": CHECKPOINT_FORMAT, "step": 0}))
    plan = compile_pipeline(load_pipeline(PIPELINE)[0])
    plan_path = plan.save(tmp_path / "plan.json")

    _refuse_unpickling(monkeypatch)
    assert latest_checkpoint(tmp_path) == d
    back = load_state(d, "actor_0")
    assert torch.equal(back["columns"]["w"]["weight"], model.weight)
    assert torch.equal(back["instances"]["0"]["opt"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert load_state(d, "source")["offset"] == 4
    assert load_plan(plan_path) == plan


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_crafted_pickle_in_a_checkpoint_is_not_executed(tmp_path, how):
    marker = tmp_path / "ran"
    d = tmp_path / "checkpoints" / "step_0"
    save_state({"weight": torch.ones(2)}, d, "actor_0")
    (d / "meta.json").write_text(json.dumps({"format": CHECKPOINT_FORMAT, "step": 0}))
    # the tensor file replaced by a pickle (a torch.save zip holds one too), and pickles beside it
    if how == "pickle":
        (d / "actor_0.safetensors").write_bytes(_crafted(marker))
    else:
        torch.save({"weight": _Payload(marker)}, d / "actor_0.safetensors")
    for name in ("actor_0.pt", "actor_0.pkl", "actor_0.bin", "model.pt"):
        (d / name).write_bytes(_crafted(marker))
    with pytest.raises(CheckpointError, match=r"actor_0.safetensors' is not a valid safetensors file"):
        load_state(d, "actor_0")
    assert latest_checkpoint(tmp_path) == d
    assert not marker.exists()


def test_a_crafted_pickle_as_plan_or_checkpoint_json_is_not_executed(tmp_path):
    from rlgraph.errors import PlanError

    marker = tmp_path / "ran"
    (tmp_path / "plan.json").write_bytes(_crafted(marker))
    with pytest.raises(PlanError, match="is not a text file"):
        load_plan(tmp_path / "plan.json")
    d = tmp_path / "checkpoints" / "step_0"
    d.mkdir(parents=True)
    (d / "meta.json").write_bytes(_crafted(marker))
    with pytest.raises(CheckpointError, match="is not valid JSON"):
        latest_checkpoint(tmp_path)
    (d / "meta.json").write_text(json.dumps({"format": CHECKPOINT_FORMAT, "step": 0}))
    (d / "actor_0.json").write_bytes(_crafted(marker))
    with pytest.raises(CheckpointError, match="is not valid JSON"):
        load_state(d, "actor_0")
    assert not marker.exists()


# deserialisers that can run code when given a file's bytes
_UNSAFE = {("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"), ("cloudpickle", "load"),
           ("cloudpickle", "loads"), ("dill", "load"), ("dill", "loads"), ("joblib", "load"), ("torch", "load"),
           ("marshal", "loads"), ("marshal", "load"), ("shelve", "open"), ("torch.serialization", "load")}


def test_no_module_of_rlgraph_calls_an_unpickler():
    """Static check over the package: no call of pickle/cloudpickle/dill/joblib/marshal loads or
    torch.load, so no file rlgraph reads (plans, checkpoints, data) is unpickled."""
    found = []
    for path in sorted((ROOT / "rlgraph").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if (node.value.id, node.attr) in _UNSAFE:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value.id}.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:  # the whole module: safetensors.torch.load reads no pickle
                    if (node.module, alias.name) in _UNSAFE:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} from {node.module} import {alias.name}")
    assert not found, "unpickling calls: " + ", ".join(found)


# -------------------------------------------------------------------------------------- loopback

_LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def _listeners(procs: list[psutil.Process]) -> list[tuple[str, int, int, str]]:
    """(address, port, pid, name) of every listening TCP socket of `procs` (read only)."""
    out = []
    for p in procs:
        try:
            name = " ".join(p.cmdline())[:120] or p.name()
            conns = p.net_connections("tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        out += [(c.laddr.ip, c.laddr.port, p.pid, name) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def _is_ray_or_tq(p: psutil.Process) -> bool:
    """Ray's own processes (GCS, raylet, agents, monitors, idle workers) and TransferQueue's
    actors. Actors running op bodies (`ray::GroupWorker`) are left out: user code opens what it
    likes (torch.distributed's store, for one, listens on all interfaces)."""
    try:
        cmd = " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    if cmd.startswith("ray::GroupWorker"):
        return False
    return cmd.startswith("ray::") or f"{os.sep}ray{os.sep}" in cmd


@pytest.mark.ray
def test_session_ray_and_transferqueue_listen_on_loopback_only(ray_cluster, tq_plane):
    procs = [p for p in psutil.Process().children(recursive=True) if _is_ray_or_tq(p)]
    if not procs:
        pytest.skip("Ray was started outside this test process; its processes are not ours to inspect")
    listeners = _listeners(procs)
    names = " ".join(n for *_, n in listeners)
    assert "gcs_server" in names and "raylet" in names, listeners
    assert "TransferQueueController" in names and "SimpleStorageUnit" in names, listeners
    exposed = [entry for entry in listeners if entry[0] not in _LOOPBACK]
    assert not exposed, f"listening beyond loopback: {exposed}"


_START_AND_LIST = textwrap.dedent("""
    import json, os, sys, psutil
    from rlgraph.graph.compile import compile_pipeline
    from rlgraph.graph.loader import load_pipeline
    from rlgraph.runtime.cluster import start_ray, check_cluster
    from rlgraph.runtime.dataplane import TransferQueueConfig, TransferQueueDataPlane

    plan = compile_pipeline(load_pipeline(sys.argv[1])[0], ["cluster.cpus_per_node=6"])
    handle = start_ray(plan)  # as `rlgraph run` does without --address
    check_cluster(plan)
    plane = TransferQueueDataPlane.start(TransferQueueConfig(num_storage_units=1, op_timeout_s=30))
    try:
        me = psutil.Process()
        out = []
        for p in [me] + me.children(recursive=True):
            try:
                cmd = " ".join(p.cmdline())[:120]
                out += [[c.laddr.ip, c.laddr.port, cmd] for c in p.net_connections("tcp")
                        if c.status == psutil.CONN_LISTEN]
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        print("LISTENERS " + json.dumps(out))
        print("TOKEN_AUTH " + json.dumps(handle.token_auth))
    finally:
        plane.close()
        handle.shutdown()
""")


@pytest.mark.ray
@pytest.mark.slow
def test_rlgraph_run_starts_ray_and_transferqueue_on_loopback(tmp_path):
    """`start_ray` without an address, as `rlgraph run` calls it, in a process of its own: every
    listening socket of that process and its descendants is on loopback. RAY_ADDRESS naming
    another cluster is ignored (only --address joins one)."""
    env = {**os.environ, "RAY_ADDRESS": "10.255.255.1:6379"}
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # start_ray must set what it needs itself
    env.pop("RAY_AUTH_MODE", None)  # Ray's token authentication is on by default
    res = subprocess.run([sys.executable, "-c", _START_AND_LIST, PIPELINE], env=env, capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("LISTENERS "))
    listeners = json.loads(line[len("LISTENERS "):])
    names = " ".join(n for *_, n in listeners)
    assert "gcs_server" in names and "TransferQueueController" in names, listeners
    exposed = [entry for entry in listeners if entry[0] not in _LOOPBACK]
    assert not exposed, f"listening beyond loopback: {exposed}"
    assert "TOKEN_AUTH true" in res.stdout.splitlines()


_START_AND_NAME = textwrap.dedent("""
    import sys, psutil
    from rlgraph.graph.compile import compile_pipeline
    from rlgraph.graph.loader import load_pipeline
    from rlgraph.runtime.cluster import start_ray

    handle = start_ray(compile_pipeline(load_pipeline(sys.argv[1])[0], []))
    try:
        names = []
        for p in psutil.Process().children(recursive=True):
            try:
                names.append(" ".join(p.cmdline()))
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        print("PROCESSES", " | ".join(names))
    finally:
        handle.shutdown()
""")


@pytest.mark.ray
@pytest.mark.parametrize("head", ["lean", "full"])
def test_a_local_ray_starts_without_the_head_processes_a_run_does_not_use(tmp_path, head):
    """`start_ray`, as `rlgraph run` calls it: no dashboard API server, autoscaler monitor or log
    monitor (RLGRAPH_RAY_HEAD=full: Ray's own set); the raylet's agents either way."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env["RLGRAPH_RAY_HEAD"] = head
    res = subprocess.run([sys.executable, "-c", _START_AND_NAME, PIPELINE], env=env, capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("PROCESSES "))
    assert "gcs_server" in line and "raylet" in line and "dashboard/agent.py" in line, line
    for process in ("dashboard/dashboard.py", "autoscaler/_private/monitor.py", "_private/log_monitor.py"):
        assert (process in line) == (head == "full"), (process, line)
    # the agent renames its process; the raylet's command line holds the one it started it with
    raylet = next(p for p in line[len("PROCESSES "):].split(" | ") if p.split()[0].endswith("/raylet"))
    agent = raylet.split("--dashboard_agent_command=", 1)[1].split("--runtime_env_agent_command=", 1)[0]
    assert ("--minimal" in agent.split()) == (head == "lean"), agent  # lean: the agent without its HTTP server


@pytest.mark.ray
def test_a_lean_start_waits_for_its_node_in_short_steps(ray_cluster, monkeypatch):
    """`cluster._wait_for_node` (Ray's own wait checks once a second): it returns as soon as the GCS
    lists the node alive, and gives up after NODE_WAIT_S for a node that never registers, leaving
    Ray's own lookup to say so."""
    import time

    from rlgraph.runtime import cluster

    ctx = ray_cluster.get_runtime_context()
    gcs, node = ctx.gcs_address, ctx.get_node_id()
    t0 = time.monotonic()
    cluster._wait_for_node(gcs, node)
    assert time.monotonic() - t0 < 0.5
    monkeypatch.setattr(cluster, "NODE_WAIT_S", 0.3)
    polls = []
    real_sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: (polls.append(s), real_sleep(s)))
    t0 = time.monotonic()
    cluster._wait_for_node(gcs, "ab" * 28)  # no such node
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert len(polls) >= 5 and set(polls) == {cluster.NODE_POLL_S}
