"""Processes of a run killed from outside (kill -9, as a user or the OOM killer would), each run
its own `rlgraph run` process with its own Ray (TQ allows one plane per cluster):

- a data-plane process: the run sees the death within seconds, starts a new data plane and every
  worker, replays from the start, and ends with the uninterrupted run's results;
- the driver: the run's Ray processes exit on their own (Ray fate-shares them with the driver
  that started them), and ``--resume`` in the same directory ends as the uninterrupted run;
- two runs at once on one machine do not disturb each other (each its own Ray, ports, temp dirs).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).parents[2]
PIPELINE = str(ROOT / "tests" / "resources" / "stream_pipeline.py")
STEPS = 4
BOUND_S = 90  # a killed driver's Ray processes are gone within this (measured: 61 s)
pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _start(out: Path, backend: str = "transferqueue", *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rlgraph.cli", "run", PIPELINE, "-o", str(out), "--steps", str(STEPS),
           "--dataplane", backend, "--timeout", "120", "gen.delay_s=0.1", "trainer.max_retries=2", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _run(out: Path, backend: str, victim: str | None = None) -> tuple[int, str, list[dict], float]:
    """`rlgraph run` the streaming pipeline; with `victim`, kill -9 the process whose title names it
    once step 1 is written (so during step 2). Returns (exit code, output, records, seconds the run
    took after the kill)."""
    proc = _start(out, backend)
    killed_at = None
    try:
        while victim and killed_at is None and proc.poll() is None:
            if len(_records(out)) >= 2:
                targets = [p for p in psutil.Process(proc.pid).children(recursive=True) if _titled(p, victim)]
                assert targets, f"no process titled {victim!r} under the run"
                for p in targets:
                    os.kill(p.pid, signal.SIGKILL)
                killed_at = time.time()
            time.sleep(0.1)
        text, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, text, _records(out), time.time() - killed_at if killed_at else 0.0


def _titled(p: psutil.Process, name: str) -> bool:
    try:
        return any(name in part for part in p.cmdline()[:1])
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def _scores(records: list[dict]) -> list[float]:
    return [r["score/mean"] for r in records]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    code, text, records, _ = _run(tmp_path_factory.mktemp("clean"), "transferqueue")
    assert code == 0, text
    assert len(records) == STEPS
    return _scores(records)


@pytest.mark.parametrize("backend,victim,name", [
    ("transferqueue", "ray::SimpleStorageUnit", "TransferQueue storage unit 0"),
    ("transferqueue", "ray::TransferQueueController", "TransferQueue controller"),
    ("ray", "ray::_RowTracker", "Ray-store row tracker"),
])
def test_a_killed_data_plane_process_is_replaced_and_the_run_ends_as_the_uninterrupted_one(
        tmp_path, uninterrupted, backend, victim, name):
    code, text, records, after_kill = _run(tmp_path / "run", backend, victim)
    assert code == 0, text
    assert f"rlgraph: the data plane's {name} died at step 2" in text, text
    assert _scores(records) == uninterrupted  # replayed from the start with the same seeds
    assert records[2]["faults/retries"] == 1
    assert after_kill < 120, after_kill  # seen within seconds, not after a request timeout
    print(f"{victim} killed during step 2: the run ended {after_kill:.1f}s later")  # docs/runtime.md's matrix


def _alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {p.name()}")
        except psutil.NoSuchProcess:
            pass
    return out


def test_a_killed_driver_leaves_no_process_and_resume_ends_as_the_uninterrupted_run(tmp_path, uninterrupted):
    out = tmp_path / "run"
    proc = _start(out, "transferqueue", "trainer.save_every=1")
    try:
        deadline = time.time() + 300
        while len(_records(out)) < 2 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert len(_records(out)) >= 2, proc.communicate()[0]
        family = psutil.Process(proc.pid).children(recursive=True)
        assert any(_titled(p, "ray::") for p in family)  # its Ray workers, TQ, the raylet's children
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        # Ray fate-shares its processes with the driver that started them; its per-node agents exit
        # once their last request to the dead control store times out (60 s)
        killed, bound = time.time(), time.time() + BOUND_S
        while _alive(family) and time.time() < bound:
            time.sleep(0.5)
        assert not _alive(family), f"still running {BOUND_S} s after the driver was killed: {_alive(family)}"
        print(f"the driver killed after step 1: its processes were gone {time.time() - killed:.1f}s later")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    resumed = _start(out, "transferqueue", "trainer.save_every=1", "--resume")
    text, _ = resumed.communicate(timeout=400)
    assert resumed.returncode == 0, text
    assert _scores(_records(out)) == uninterrupted


def test_two_runs_at_once_do_not_disturb_each_other(tmp_path, uninterrupted):
    procs = {name: _start(tmp_path / name) for name in ("first", "second")}
    for name, proc in procs.items():
        text, _ = proc.communicate(timeout=400)
        assert proc.returncode == 0, (name, text)
        assert _scores(_records(tmp_path / name)) == uninterrupted, name
