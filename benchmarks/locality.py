"""Issue 15: column bytes that cross nodes, with rows stored near their workers or by TransferQueue's rule.

A Ray cluster of three nodes on 127.0.0.1 (a head and two workers, each its own raylet and object
store, as `ray start` makes them), joined with `--address` by `rlgraph run` processes, as a user
would. The GRPO example runs with its reward pool strictly spread over the nodes and one
TransferQueue storage unit per node, twice, alternating:

- ``dataplane.locality=node`` (the default): each row is stored on a unit of the node of the
  worker that handles it, and calls go to idle workers near their rows;
- ``dataplane.locality=hash``: TransferQueue's own rule, row ``g`` on unit ``g % 3``.

Both give the same metrics (checked here); the table has the bytes each step's op calls put to or
got from storage on their own node and on another node (``dataplane/*`` metrics), and step times.
On one machine "across nodes" is a loopback socket, so the time column shows what the routing
costs, not what a network would.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import common
from rlgraph.runtime.metrics import read_metrics

GRPO = common.ROOT / "examples" / "grpo_reward_pool.py"
NODE_CPUS = 3
SPREAD = ["cluster.num_nodes=3", f"cluster.cpus_per_node={NODE_CPUS}", "groups.reward.dp=3",
          "groups.reward.num_cpus=0.5", "groups.reward.placement=strict_spread"]
SAME = ("score/mean", "reward/mean", "response_length/mean", "update_actor/actor_metrics/pg_loss")


def _cluster() -> Any:
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every node on 127.0.0.1
    ray_constants.ENABLE_RAY_CLUSTER = False
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": NODE_CPUS, "node_ip_address": "127.0.0.1",
                                      "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=NODE_CPUS, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    return cluster


def _run(address: str, out: Path, steps: int, locality: str) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "rlgraph.cli", "run", str(GRPO), "-o", str(out), "--overwrite", "--steps", str(steps),
           "--timeout", "300", "--address", address, *SPREAD, f"dataplane.locality={locality}",
           "trainer.logger=[jsonl]"]
    proc = subprocess.run(cmd, cwd=common.ROOT, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"rlgraph run failed ({locality}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return read_metrics(out / "metrics.jsonl")


def measure(steps: int, repeats: int) -> tuple[common.Table, dict[str, list[list[dict[str, Any]]]]]:
    runs: dict[str, list[list[dict[str, Any]]]] = {"node": [], "hash": []}
    cluster = _cluster()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for k in range(repeats):  # alternate, so the machine's noise falls on both alike
                for locality in ("node", "hash"):
                    records = _run(cluster.address, Path(tmp) / f"{locality}_{k}", steps, locality)
                    runs[locality].append(records)
                    mb = sum(r.get("dataplane/cross_node_bytes", 0) for r in records) / 1e6
                    print(f"  locality={locality} run {k}: {mb:.2f} MB across nodes", flush=True)
    finally:
        cluster.shutdown()
    for a, b in zip(runs["node"], runs["hash"]):
        if [{k: r.get(k) for k in SAME} for r in a] != [{k: r.get(k) for k in SAME} for r in b]:
            raise AssertionError("dataplane.locality changed the run's metrics; it must only move bytes")

    t = common.Table(["dataplane.locality", "runs x steps", "local MB/step", "cross-node MB/step",
                      "cross-node fraction", "cross-node bytes / hash", "s/step (after step 0)", "s/step / hash"])
    per: dict[str, dict[str, float]] = {}
    for locality, rs in runs.items():
        recs = [r for run in rs for r in run]
        later = [r["timing/step_s"] for run in rs for r in run[1:] if "timing/step_s" in r] or \
                [r.get("timing/step_s", float("nan")) for r in recs]
        local = statistics.mean(r.get("dataplane/local_bytes", 0) for r in recs) / 1e6
        cross = statistics.mean(r.get("dataplane/cross_node_bytes", 0) for r in recs) / 1e6
        per[locality] = {"local": local, "cross": cross, "s": statistics.mean(later)}
    for locality in ("node", "hash"):
        p, h = per[locality], per["hash"]
        t.add(locality, f"{len(runs[locality])} x {steps}", p["local"], p["cross"],
              p["cross"] / (p["local"] + p["cross"]), p["cross"] / h["cross"] if h["cross"] else float("nan"),
              p["s"], p["s"] / h["s"])
    return t, runs


def run(quick: bool = False, steps: int | None = None, argv: list[str] | None = None, **_: Any) -> common.Section:
    steps = steps or (2 if quick else 4)
    repeats = 1 if quick else 2
    table, _ = measure(steps, repeats)
    table.print()
    intro = f"""
Three Ray nodes on 127.0.0.1 ({NODE_CPUS} CPUs each, a head and two workers as `ray start` makes
them), the GRPO example joined with `--address`, its reward pool strictly spread (one worker per
node), one TransferQueue storage unit per node (the default), {repeats} run(s) of {steps} steps per
setting, alternating. `node` (the default) stores each row on a unit of the node of the worker
that handles it (the actor group's: it reads and writes the per-token columns) and sends calls to
idle workers near their rows; `hash` is TransferQueue's own rule (row `g` on unit `g % 3`). The
byte columns are the `dataplane/local_bytes` and `dataplane/cross_node_bytes` step metrics (the
column bytes the step's op calls put to or got from storage on their own node, and on another).
Both settings gave the same scores, losses and response lengths in every step (checked).
"""
    ratio = table.rows[0][-1]
    notes = f"""
Reading: with TransferQueue's rule a worker finds about two thirds of its rows on another node;
with rows kept on the actor's node only what a reward worker on another node reads (the response
tokens of the rows it scores while the reward worker beside the actor is busy) crosses. Steps took
{ratio:.2f}x as long with `node` here. This plan has one actor worker, so `node` stores every row
on that node's one unit and that one process serves every put and get, where `hash` spreads them
over three; and on one machine a cross-node read is only a loopback socket, so locality has
nothing to win here. On a real network every cross-node byte is a network transfer, and a home
group of several ranks on several nodes spreads its rows over their units.
"""
    return common.Section("locality", "10. Many nodes: column bytes across nodes", intro, [table], notes,
                          common.command_line(argv if argv is not None else ["locality"]
                                              + (["--quick"] if quick else [])))
