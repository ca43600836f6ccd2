"""`rlgraph.runtime.malloc`: a worker's process keeps freed memory for its next pass."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from rlgraph.graph.settings import TrainerSettings
from rlgraph.runtime import malloc

_PASSES = textwrap.dedent("""
    import resource, sys
    import torch
    from rlgraph.runtime.malloc import keep_freed
    set_ = keep_freed(int(sys.argv[1]))
    def one_pass(numel):  # a pass's activations: four blocks of 4-5 MiB, written, then freed
        alive = [torch.empty(numel).fill_(1.0) for _ in range(4)]
        del alive
    sizes = [(1 << 20) + k * 65536 for k in range(5)]  # the rows' lengths vary from pass to pass
    for numel in sizes:
        one_pass(numel)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for j in range(40):
        one_pass(sizes[j % 5])
    print(set_, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _faults(mb: int) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", _PASSES, str(mb)], capture_output=True, text=True, check=True)
    set_, faults = out.stdout.split()
    return set_ == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_passes_reuse_the_pages_freed_before_them_instead_of_faulting_in_new_ones():
    set_, kept = _faults(256)
    unset, default = _faults(0)
    if not set_:
        pytest.skip("not glibc: its malloc takes no such settings")
    assert not unset
    # by default what a pass frees at the heap's top goes back to the kernel (and a block larger than
    # those freed before is a fresh mapping): 9k-150k page faults in 40 passes here; kept, none
    assert default > 2000
    assert kept < default // 20


def test_zero_leaves_glibc_s_defaults_and_the_setting_defaults_to_keeping_256_mib():
    assert malloc.keep_freed(0) is False
    assert TrainerSettings.of({}).malloc_keep_mb == 256
