"""The worker actor's Ray class (`rlgraph.runtime.actor`): built in the actor's process, the same
methods as the worker it hands calls to, and no torch in the driver that starts it."""

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from rlgraph.runtime import actor
from rlgraph.runtime.actor import STREAMS, WORKER_METHODS, WORKERS, actor_class
from rlgraph.runtime.worker import FaultInjectingWorker, GroupWorker

ROOT = Path(__file__).parents[2]


def _public(cls: type) -> set[str]:
    return {n for c in cls.__mro__ if c is not object for n, v in vars(c).items()
            if callable(v) and not n.startswith("_")}


def test_the_actor_class_has_every_method_of_the_worker_and_streams_where_it_streams():
    assert set(WORKER_METHODS) == _public(GroupWorker)
    assert _public(FaultInjectingWorker) <= set(WORKER_METHODS)
    for name in WORKER_METHODS:
        streams = inspect.isgeneratorfunction(getattr(GroupWorker, name))
        assert streams == (name in STREAMS), name
        assert inspect.isgeneratorfunction(getattr(actor_class(), name)) == streams, name


def test_the_actor_class_is_named_as_its_worker():
    """So the actor's process is ``ray::GroupWorker`` (``ray::FaultInjectingWorker``), as users and the
    reliability tests look for it."""
    for name in WORKERS:
        cls = actor_class(name)
        assert cls.__name__ == cls.__qualname__ == name and cls is actor_class(name)
        assert cls._impl == f"rlgraph.runtime.worker:{name}"


class _Worker:
    def __init__(self, a, b=0):
        self.args = (a, b)

    def ping(self):
        return self.args

    def run_chunk(self, *args, fault=None, **kwargs):
        return args, fault, kwargs

    def run_chunk_stream(self, n):
        yield from range(n)
        raise ValueError("after the parts")


def test_the_actor_builds_its_worker_with_its_arguments_and_hands_it_each_call():
    cls = type("GroupWorker", (actor._Actor,), {"_impl": f"{__name__}:_Worker"})
    obj = cls(1, 2)
    assert obj.ping() == (1, 2)
    assert obj.run_chunk("op", 3, fault="raise", fused=[]) == (("op", 3), "raise", {"fused": []})
    parts = obj.run_chunk_stream(2)
    assert next(parts) == 0 and next(parts) == 1
    with pytest.raises(ValueError, match="after the parts"):  # the worker's own error, unchanged
        next(parts)


def test_the_driver_creates_the_worker_actors_without_importing_torch():
    """`rlgraph run` submits the worker actors before it imports torch (for the data plane it starts
    beside them): on a small machine the workers' start does not wait for the driver's imports."""
    code = (
        "import sys, ray\n"
        "import rlgraph.cli, rlgraph.runtime.runner, rlgraph.runtime.fleet, rlgraph.runtime.reporting\n"
        "import rlgraph.runtime.dataplane, rlgraph.ops.tiny\n"
        "from rlgraph.runtime.actor import READ_AHEAD, actor_class, read_ahead_ops\n"
        "from rlgraph.graph.loader import load_pipeline\n"
        "from rlgraph import compile\n"
        f"plan = compile(load_pipeline({str(ROOT / 'examples' / 'grpo.py')!r})[0], [])\n"
        "read_ahead_ops(plan)\n"
        "ray.remote(concurrency_groups={'control': 1, READ_AHEAD: 1})(actor_class())\n"
        "print(sorted(m for m in ('torch', 'tensordict', 'transfer_queue', 'transformers', 'safetensors') "
        "if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_call_queued_behind_another_runs_only_right_after_that_one_ended_well():
    """`GroupWorker._check_after`: a call queued behind the step before's (`rlgraph.runtime.window`)
    names that call; the worker refuses it unless its last call was that one and ended well, and every
    call counts as not ended well until it has."""
    from types import SimpleNamespace

    from rlgraph.errors import CallOrderError

    worker = SimpleNamespace(group="actor", rank=0, _ended_well="step_0/generate/0")
    GroupWorker._check_after(worker, "step_0/generate/0", "generate", 1)
    assert worker._ended_well == ""  # running: not ended well (yet)
    with pytest.raises(CallOrderError, match=r"op 'generate' at step 2 on worker actor\[0\] was queued behind call "
                                             r"step_1/generate/0, which did not end well"):
        GroupWorker._check_after(worker, "step_1/generate/0", "generate", 2)
    GroupWorker._check_after(worker, "", "generate", 2)  # a call sent on its own runs whatever came before
