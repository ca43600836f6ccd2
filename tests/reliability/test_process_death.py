"""Processes of a run killed from outside (kill -9, as a user or the OOM killer would), each run
its own `rlgraph run` process with its own Ray (TQ allows one plane per cluster). The failure
matrix of docs/runtime.md: every process kind is killed at a point in step 2 drawn from a seeded
generator (a delay after step 1's record is written; the draw is printed with the result):

- a data-plane process: the run sees the death within seconds, starts a new data plane and every
  worker, replays from the start, and ends with the uninterrupted run's results;
- a group worker or the data source: the group (or source) is restarted and the lost calls run
  again, or every worker is restored and the step replayed; the uninterrupted run's results;
- a reward pool's scoring processes (reward.executor=process): each sample they held is scored
  again on a fresh process; the uninterrupted run's results;
- the driver: the run's Ray processes exit on their own (Ray fate-shares them with the driver
  that started them), and ``--resume`` in the same directory ends as the uninterrupted run;
- two runs at once on one machine do not disturb each other (each its own Ray, ports, temp dirs).
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
PIPELINE = str(ROOT / "tests" / "resources" / "stream_pipeline.py")
STEPS = 4
BOUND_S = 15  # a killed driver's Ray processes are gone within this (its reaper polls every second)
RECOVERY_S = 120  # every other kill: the run ends within this after the kill
SEED = 14  # the kill points' draws


def _kill_delay(victim: str) -> float:
    """Where in step 2 `victim` dies: seconds after step 1's record, a seeded draw per process kind
    (a step of these runs takes about 1 s)."""
    return round(random.Random(f"{SEED}:{victim}").uniform(0.0, 1.0), 3)
pytestmark = pytest.mark.ray  # each test is slow or faults (the markers are disjoint)


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _start(out: Path, backend: str = "transferqueue", *extra: str, pipeline: str = PIPELINE,
           args: tuple[str, ...] = ("gen.delay_s=0.1",)) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rlgraph.cli", "run", pipeline, "-o", str(out), "--steps", str(STEPS),
           "--dataplane", backend, "--timeout", "120", "trainer.max_retries=2", *args, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _run(out: Path, backend: str, victim: str | None = None, after: int = 2, step_s: float = 1.0,
         **how: object) -> tuple[int, str, list[dict], float]:
    """`rlgraph run` the streaming pipeline (or `how`'s); with `victim`, kill -9 every process whose
    command line starts with it (or, for "forkserver", names it: a reward pool's scoring processes)
    `_kill_delay(victim)` seconds after the record of step `after` - 1 is written (default: into
    step 2; `step_s`: how long a step of this run takes, which scales the draw). Returns (exit code,
    output, records, seconds the run took after the kill)."""
    proc = _start(out, backend, **how)  # type: ignore[arg-type]
    killed_at = None
    try:
        while victim and killed_at is None and proc.poll() is None:
            if len(_records(out)) >= after:
                time.sleep(_kill_delay(victim) * step_s)
                targets = [p for p in psutil.Process(proc.pid).children(recursive=True) if _titled(p, victim)]
                assert targets, f"no process titled {victim!r} under the run"
                for p in targets:
                    os.kill(p.pid, signal.SIGKILL)
                killed_at = time.time()
            time.sleep(0.05)
        text, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, text, _records(out), time.time() - killed_at if killed_at else 0.0


def _titled(p: psutil.Process, name: str) -> bool:
    try:
        if name == "forkserver":  # the fork server and the processes it forked share its command line
            return "multiprocessing.forkserver" in " ".join(p.cmdline())
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


# with one storage unit, the unit and the data source run in TransferQueue's controller's process by
# default (dataplane.host_unit, dataplane.host_source): killing it kills all three; the unit of its own
# is the other layout
OWN_UNIT = ("gen.delay_s=0.1", "dataplane.host_unit=false")
OWN_SOURCE = ("gen.delay_s=0.1", "dataplane.host_source=false")


@pytest.mark.slow
@pytest.mark.parametrize("backend,victim,name,args", [
    ("transferqueue", "ray::SimpleStorageUnit", "TransferQueue storage unit 0", OWN_UNIT),
    ("transferqueue", "ray::TransferQueueController", "TransferQueue controller", ("gen.delay_s=0.1",)),
    ("ray", "ray::_RowTracker", "Ray-store row tracker", ("gen.delay_s=0.1",)),
])
def test_a_killed_data_plane_process_is_replaced_and_the_run_ends_as_the_uninterrupted_one(
        tmp_path, uninterrupted, backend, victim, name, args):
    code, text, records, after_kill = _run(tmp_path / "run", backend, victim, args=args)
    assert code == 0, text
    assert f"rlgraph: the data plane's {name} died at step 2" in text, text
    assert _scores(records) == uninterrupted  # replayed from the start with the same seeds
    assert records[2]["faults/retries"] == 1
    assert records[2]["faults/restarts"] >= 2  # a new plane: the source and every worker restarted on it
    assert after_kill < RECOVERY_S, after_kill  # seen within seconds, not after a request timeout
    # docs/runtime.md's matrix
    print(f"{victim} killed {_kill_delay(victim)}s into step 2: the run ended {after_kill:.1f}s later")


@pytest.mark.faults
@pytest.mark.parametrize("victim", ["ray::GroupWorker", "ray::SourceWorker"])
def test_a_killed_worker_or_source_costs_no_sample(tmp_path, uninterrupted, victim):
    # the source works a step ahead (the runner admits one step early): killed in step 2 of 4 it has
    # made its last batch already, so it dies in step 1, with step 3's prompts still to make
    after = 1 if victim == "ray::SourceWorker" else 2
    code, text, records, after_kill = _run(tmp_path / "run", "transferqueue", victim, after=after,
                                           args=OWN_SOURCE if victim == "ray::SourceWorker" else ("gen.delay_s=0.1",))
    assert code == 0, text
    assert "rlgraph: " in text and "died" in text, text  # one line saying what died and what was done
    assert _scores(records) == uninterrupted
    assert sum(r.get("faults/retries", 0) for r in records) >= 1, records
    assert sum(r.get("faults/restarts", 0) for r in records) >= 1, records  # the source or group restarted
    assert after_kill < RECOVERY_S, after_kill
    print(f"{victim} killed {_kill_delay(victim)}s into step {after}: the run ended {after_kill:.1f}s later")


@pytest.mark.faults
def test_a_killed_reward_scoring_process_costs_no_sample(tmp_path):
    """The GRPO example with its rule reward on a process pool: kill -9 the pool's fork server and
    every scoring process (idle or mid-sample); the run ends with the uninterrupted run's scores."""
    how = {"pipeline": str(ROOT / "examples" / "grpo.py"),
           "args": ("reward.executor=process", "reward.concurrency=2")}
    code, text, clean, _ = _run(tmp_path / "clean", "transferqueue", **how)
    assert code == 0, text
    # a step of the example takes about 0.1 s, not the streaming pipeline's 1 s: the kill point's
    # draw is a fraction of the clean run's step, so the pool is still there to be killed
    step_s = sorted(r["timing/step_s"] for r in clean)[len(clean) // 2]
    code, text, records, after_kill = _run(tmp_path / "run", "transferqueue", "forkserver", step_s=step_s, **how)
    assert code == 0, text
    assert _scores(records) == _scores(clean) and len(records) == STEPS
    assert all(r.get("reward/mean") == c.get("reward/mean") for r, c in zip(records, clean))
    assert after_kill < RECOVERY_S, after_kill
    restarts = sum(r.get("reward/reward_metrics/process_restarts", 0) for r in records)
    print(f"reward scoring processes killed {_kill_delay('forkserver')}s into step 2: the run ended "
          f"{after_kill:.1f}s later, {restarts} sample(s) scored again")


def _alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {p.name()}")
        except psutil.NoSuchProcess:
            pass
    return out


def _held(ports: set[int]) -> list[str]:
    """Who listens on any of `ports` now: "port pid name command" for each."""
    out = []
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port in ports:
            try:
                p = psutil.Process(c.pid)
                out.append(f"{c.laddr.port} {c.pid} {p.name()} {' '.join(p.cmdline())[:120]}")
            except (psutil.Error, TypeError):
                out.append(f"{c.laddr.port} {c.pid}")
    return out


def _listening(p: psutil.Process) -> list:
    try:
        return [c for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    except psutil.Error:
        return []


@pytest.mark.faults
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
        # the ports the run listens on, read before the kill: read after it, the processes that held them
        # may be gone already (a race this test lost once)
        ports = {c.laddr.port for p in family for c in _listening(p)}
        assert ports, "the run's processes listen on no port"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        # Ray fate-shares the processes the driver started with it; the rest (the raylet's agents, which
        # would wait 60 s on the dead control store with their ports bound) the run's reaper kills
        killed, bound = time.time(), time.time() + BOUND_S
        while _alive(family) and time.time() < bound:
            time.sleep(0.5)
        assert not _alive(family), f"still running {BOUND_S} s after the driver was killed: {_alive(family)}"
        # within the same bound, no port of the run is listened on any more (a Ray worker started after
        # the family was listed may still be on its way out when the listed ones are gone)
        while (held := _held(ports)) and time.time() < bound:
            time.sleep(0.5)
        assert not held, f"ports of the killed run still listened on {BOUND_S} s after the kill, by: {held}"
        print(f"the driver killed after step 1: its processes were gone {time.time() - killed:.1f}s later")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    resumed = _start(out, "transferqueue", "trainer.save_every=1", "--resume")
    text, _ = resumed.communicate(timeout=400)
    assert resumed.returncode == 0, text
    assert _scores(_records(out)) == uninterrupted


@pytest.mark.faults
def test_two_runs_at_once_do_not_disturb_each_other(tmp_path, uninterrupted):
    procs = {name: _start(tmp_path / name) for name in ("first", "second")}
    for name, proc in procs.items():
        text, _ = proc.communicate(timeout=400)
        assert proc.returncode == 0, (name, text)
        assert _scores(_records(tmp_path / name)) == uninterrupted, name
