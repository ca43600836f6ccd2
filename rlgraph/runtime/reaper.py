"""The reaper: when a driver that started its own Ray dies without shutting down (SIGKILL, OOM),
the processes it started go with it at once, instead of some of them holding their ports for a
minute.

Ray fate-shares the processes a driver starts directly (GCS, raylet, log monitor) with it
(``PR_SET_PDEATHSIG``), but not their children: the raylet's per-node agents (dashboard agent,
runtime-env agent) notice the raylet's death within seconds, then wait up to 60 s on a request to
the dead control store before they exit, with their ports bound; a worker's own children (a vLLM
engine) may outlive it too.

`start_reaper` spawns ``python -m rlgraph.runtime.reaper DRIVER_PID`` in a session of its own. While
the driver lives, the reaper notes the driver's descendants every `POLL_S` seconds (pid and start
time); when the driver is gone it removes the driver's shared-memory segments (`remove_segments`:
the data plane's large columns, `rlgraph.runtime.dataplane.shm`), sends SIGKILL to every noted
process still running with the same start time (never a recycled pid, never a process this run did
not start), and exits. A driver that
shuts down normally stops its processes itself; the reaper then finds none left and exits.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

__all__ = ["start_reaper", "remove_segments", "POLL_S"]

POLL_S = 1.0  # how often the reaper notes the driver's descendants, and checks that it lives


def start_reaper(driver_pid: int | None = None) -> subprocess.Popen:
    """Start the reaper of `driver_pid` (this process by default); it ends by itself."""
    pid = os.getpid() if driver_pid is None else driver_pid
    return subprocess.Popen([sys.executable, "-m", "rlgraph.runtime.reaper", str(pid)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            close_fds=True)


def _watch(driver_pid: int) -> int:
    import psutil

    try:
        driver = psutil.Process(driver_pid)
        started = driver.create_time()
    except psutil.NoSuchProcess:
        return 0
    noted: dict[int, float] = {}
    while True:
        try:
            if not driver.is_running() or driver.create_time() != started or driver.status() == psutil.STATUS_ZOMBIE:
                break
            for p in driver.children(recursive=True):
                try:
                    noted.setdefault(p.pid, p.create_time())
                except psutil.Error:
                    pass
        except psutil.NoSuchProcess:
            break
        except psutil.Error:  # a transient read error: look again
            pass
        time.sleep(POLL_S)
    killed = 0
    for pid, created in noted.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.pid != os.getpid():
                p.kill()
                killed += 1
        except psutil.Error:  # gone already, or not ours any more
            pass
    remove_segments(driver_pid)  # after the kills: no process of the run is left to make more
    return killed


def remove_segments(driver_pid: int) -> int:
    """Remove the shared-memory segments of `driver_pid`'s data planes (`rlgraph.runtime.dataplane.shm`,
    imported only now: it brings torch and Ray in, which this light process otherwise never needs);
    how many."""
    try:
        from rlgraph.runtime.dataplane import shm
    except Exception:  # pragma: no cover - a broken environment: the next plane's sweep removes them
        return 0
    return shm.remove_all(shm.driver_prefix(driver_pid))


if __name__ == "__main__":
    _watch(int(sys.argv[1]))
