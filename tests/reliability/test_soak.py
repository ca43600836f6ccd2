"""Soak (issue 14, item 5): 200 steps of the GRPO example with a process killed from outside about
every 20 steps, rotating over a worker, the TransferQueue controller (on one node its process also
holds the storage unit and the data source: ``dataplane.host_unit``, ``dataplane.host_source``), the
reward pool's scoring processes (the rule reward runs on a process pool here,
``reward.executor=process``) and the driver (then ``--resume``). The run must end with the
uninterrupted run's results and hold the sample accounting at every step. A storage unit and a
source of their own are killed in tests/reliability/test_process_death.py.

Not in the default run (about 8 minutes on 2 cores):

    .venv/bin/python -m pytest -m soak -s tests/reliability/test_soak.py

Its last result is in docs/runtime.md ("What happens when a process dies").
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).parents[2]
STEPS, EVERY, SAVE_EVERY = 200, 20, 10
KINDS = ["ray::GroupWorker", "ray::TransferQueueController", "forkserver", "driver"]
SCORING = "multiprocessing.forkserver"  # the reward pool's fork server and the processes it forked
COMPARED = ("score/mean", "update_actor/actor_metrics/pg_loss", "samples/trained", "samples/padding")
pytestmark = [pytest.mark.soak, pytest.mark.ray]


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _start(out: Path, *extra: str) -> subprocess.Popen:
    """`rlgraph run` the GRPO example into `out`; its output is appended to out.log."""
    cmd = [sys.executable, "-m", "rlgraph.cli", "run", str(ROOT / "examples" / "grpo.py"), "-o", str(out),
           "--steps", str(STEPS), "--timeout", "180", f"trainer.save_every={SAVE_EVERY}", "trainer.max_retries=3",
           "reward.executor=process", "reward.concurrency=2", *extra]
    with open(f"{out}.log", "a") as log:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _log(out: Path) -> str:
    return Path(f"{out}.log").read_text()


def _kill(proc: subprocess.Popen, kind: str, rng: random.Random) -> str:
    """Kill -9 one process of `kind` under the run (or the driver itself); returns what was killed."""
    if kind == "driver":
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        return f"driver {proc.pid}"
    found = []
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if kind == "forkserver" and SCORING in " ".join(p.cmdline()):
                found.append(p)
            elif p.cmdline()[:1] and p.cmdline()[0].startswith(kind):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    assert found, f"no {kind} under the run"
    if kind == "forkserver":  # all of them: the pool is replaced (a pebble pool breaks when one dies idle)
        for p in found:
            os.kill(p.pid, signal.SIGKILL)
        return f"{kind} and {len(found) - 1} scoring process(es)"
    victim = rng.choice(sorted(found, key=lambda p: p.pid))
    os.kill(victim.pid, signal.SIGKILL)
    return f"{kind} {victim.pid}"


@pytest.fixture(scope="module")
def model_ready():
    """The example's prepare hook builds and warm-starts its tiny model once; both runs reuse it."""
    from rlgraph.graph.loader import load_pipeline
    from rlgraph.runtime.runner import prepare

    import rlgraph

    pipeline, ref = load_pipeline(str(ROOT / "examples" / "grpo.py"))
    prepare(rlgraph.compile(pipeline, [], pipeline_ref=ref))


def test_soak_with_a_kill_every_twenty_steps_ends_as_the_uninterrupted_run(tmp_path, model_ready):
    t0 = time.time()
    clean = _start(tmp_path / "clean")
    assert clean.wait(timeout=1800) == 0, _log(tmp_path / "clean")
    expected = _records(tmp_path / "clean")
    clean_s = time.time() - t0

    out, rng, kills, t0 = tmp_path / "soak", random.Random(14), [], time.time()
    proc, next_kill = _start(out), EVERY + rng.randint(-5, 5)
    while True:
        done = len(_records(out))
        if proc.poll() is not None:
            assert proc.returncode == 0, f"after kills {kills}:\n{_log(out)}"
            if done >= STEPS:
                break
            raise AssertionError(f"the run stopped at step {done} after kills {kills}:\n{_log(out)}")
        if done >= next_kill and done < STEPS - 3:
            kind = KINDS[len(kills) % len(KINDS)]
            kills.append((done, _kill(proc, kind, rng)))
            if kind == "driver":
                proc = _start(out, "--resume")
            next_kill = done + EVERY + rng.randint(-5, 5)
        time.sleep(0.2)
    soak_s = time.time() - t0
    got = _records(out)
    assert [r["step"] for r in got] == list(range(STEPS))
    padded = json.loads((out / "plan.json").read_text())["batch"]["padded_batch"]
    for r in got:  # produced = trained + padding + dropped, every step
        assert r["samples/real"] + r["samples/padding"] == padded, r["step"]
        assert r["samples/trained"] + r["samples/dropped"] == r["samples/real"], r["step"]
    for key in COMPARED:
        assert [r.get(key) for r in got] == [r.get(key) for r in expected], key
    faults = [line for line in _log(out).splitlines() if line.startswith("rlgraph: ") and "died" in line]
    print(f"soak: {STEPS} steps, {len(kills)} kills {kills}; clean run {clean_s:.0f}s, with kills {soak_s:.0f}s; "
          f"final score/mean {got[-1]['score/mean']:.3f} (uninterrupted {expected[-1]['score/mean']:.3f})")
    print("\n".join(faults))
