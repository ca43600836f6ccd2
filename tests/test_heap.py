"""`rlgraph.heap.freeze`: the start-up heap out of the collector's full collections, unless switched off."""

import os
import subprocess
import sys

import pytest

PROBE = """
import gc, json, sys
import torch  # a start-up's worth of objects
from rlgraph import heap
froze = heap.freeze()
frozen = gc.get_freeze_count()
junk = [[i] for i in range(1000)]  # made after the freeze: collected as before
print(json.dumps({"froze": froze, "frozen": frozen, "later_tracked": gc.is_tracked(junk),
                  "refrozen": gc.get_freeze_count() == frozen}))
"""


def _probe(switch):
    env = {k: v for k, v in os.environ.items() if k != "RLGRAPH_GC_FREEZE"}
    if switch is not None:
        env["RLGRAPH_GC_FREEZE"] = switch
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120, check=True)
    import json

    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("switch", [None, "1"])
def test_freeze_moves_the_start_up_heap_to_the_permanent_generation(switch):
    got = _probe(switch)
    assert got["froze"] is True
    assert got["frozen"] > 50_000  # torch's modules, functions and classes
    assert got["later_tracked"] and got["refrozen"]  # later objects stay in the collector's generations


def test_the_switch_leaves_the_collector_as_python_has_it():
    got = _probe("0")
    assert got == {"froze": False, "frozen": 0, "later_tracked": True, "refrozen": True}
