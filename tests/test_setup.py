"""scripts/setup.sh picks torch's build for the machine: CPU without a GPU (PyTorch's CPU index where
it is reachable, pip's own indexes where not), CUDA with one. --dry-run prints the choice only."""

import os
import subprocess
from pathlib import Path

import pytest

SETUP = Path(__file__).parents[1] / "scripts" / "setup.sh"


def _choice(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SETUP), "--dry-run", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


@pytest.mark.parametrize("gpu, reachable, build, source", [
    ("0", "1", "CPU", "from PyTorch's CPU index https://download.pytorch.org/whl/cpu"),
    ("0", "0", "CPU", "from pip's configured indexes (PyTorch's CPU index https://download.pytorch.org/whl/cpu "
                      "is not reachable from here)"),
    ("1", "1", "CUDA", "from pip's configured indexes (PyPI's torch for Linux is the CUDA build)"),
])
def test_the_build_follows_the_gpu_and_the_index(gpu, reachable, build, source):
    r = _choice(RLGRAPH_SETUP_GPU=gpu, RLGRAPH_SETUP_CPU_INDEX_REACHABLE=reachable)
    assert r.returncode == 0, r.stderr
    found = "an NVIDIA GPU was found" if gpu == "1" else "no NVIDIA GPU was found"
    assert r.stderr.splitlines() == [f"setup: torch 2.13.0: the {build} build, because {found} (nvidia-smi -L); "
                                     f"{source}", "setup: dry run: nothing installed"]


def test_a_forced_build_and_a_bad_argument():
    r = _choice("--torch=cpu", RLGRAPH_SETUP_GPU="1", RLGRAPH_SETUP_CPU_INDEX_REACHABLE="1")
    assert "the CPU build, because --torch=cpu; from PyTorch's CPU index" in r.stderr
    bad = subprocess.run(["bash", str(SETUP), "--torch=gpu"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown argument --torch=gpu" in bad.stderr
