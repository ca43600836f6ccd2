"""rlgraph.runtime.reaper: a SIGKILLed driver's descendants go with it, and nothing else does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from rlgraph.runtime.reaper import POLL_S, remove_segments, start_reaper

# a "driver" whose child would outlive it (as Ray's agents do): it prints the child's pid
DRIVER = ("import subprocess, sys, time\n"
          "child = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
          "print(child.pid, flush=True)\n"
          "time.sleep(300)\n")


def _segment(driver_pid: int) -> str:
    """A file named as the data plane names its shared-memory segments (`shm.prefix_for`)."""
    from rlgraph.runtime.dataplane import shm

    path = os.path.join(shm.SHM_DIR, f"{shm.prefix_for(driver_pid, 'abcdef012345')}-{os.getpid()}-0a0b0c0d-0")
    with open(path, "wb") as f:
        f.write(b"x")
    return path


def test_a_killed_drivers_descendants_are_killed_and_nothing_else():
    bystander = subprocess.Popen(["sleep", "300"])  # not the driver's: must survive
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True)
    try:
        child = psutil.Process(int(driver.stdout.readline()))
        # a segment of the driver's data plane, and one of another driver's (must stay)
        theirs, other = _segment(driver.pid), _segment(bystander.pid)
        reaper = start_reaper(driver.pid)
        time.sleep(3 * POLL_S)  # the reaper has noted the child
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)
        gone, alive = psutil.wait_procs([child], timeout=10)
        assert not alive, "the driver's child outlived it"
        assert reaper.wait(timeout=30) == 0  # the reaper ends by itself
        assert bystander.poll() is None
        assert not os.path.exists(theirs), "the killed driver's shared-memory segment is still there"
        assert os.path.exists(other)
    finally:
        remove_segments(bystander.pid)
        for p in (bystander, driver):
            if p.poll() is None:
                p.kill()


def test_a_driver_that_ends_normally_leaves_the_reaper_nothing_to_do():
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"])
    reaper = start_reaper(driver.pid)
    driver.wait(timeout=30)
    assert reaper.wait(timeout=30) == 0
