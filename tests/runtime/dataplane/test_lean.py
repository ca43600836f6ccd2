"""rlgraph.runtime.dataplane.lean: tensordict imported without torch._dynamo, in every process of
the data plane (the driver and workers through `tq`, TQ's own actors through `LeanImports`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid

import pytest
import ray

# the probe's actor class is defined here, in a module workers cannot import: ship it by value
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _fresh(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_the_data_plane_imports_tensordict_without_dynamo_and_leaves_torch_as_it_was():
    got = _fresh("""
        import sys, torch.compiler
        before = torch.compiler.allow_in_graph, torch.compiler.assume_constant_result
        import rlgraph.runtime.dataplane.tq  # TransferQueue, hence tensordict
        after = torch.compiler.allow_in_graph, torch.compiler.assume_constant_result
        print("tensordict" in sys.modules, "torch._dynamo" in sys.modules, before == after)
    """)
    assert got == "True False True"


def test_without_it_tensordict_imports_dynamo():
    # the cost `lean` removes is real: should tensordict stop importing torch._dynamo, this module can go
    assert _fresh("import sys, tensordict; print('torch._dynamo' in sys.modules)") == "True"


def test_torch_compile_still_works_after_the_lean_import():
    got = _fresh("""
        import torch
        import rlgraph.runtime.dataplane.lean
        from tensordict import TensorDict
        f = torch.compile(lambda x: x * 2 + 1, backend="eager")
        td = TensorDict({"a": torch.ones(3)}, batch_size=[3])
        print(f(torch.ones(2)).tolist(), td["a"].sum().item())
    """)
    assert got == "[3.0, 3.0] 3.0"


class _Probe:
    def modules(self) -> tuple[bool, bool]:
        return "tensordict" in sys.modules, "torch._dynamo" in sys.modules


@pytest.mark.ray
def test_tq_actor_classes_import_tensordict_lean_in_their_own_process(ray_cluster):
    from rlgraph.runtime.dataplane import guard

    cls = guard.guarded_actor_class(ray.remote(num_cpus=0)(_Probe), guard.new_secret())
    # an env of its own: a fresh process, never one another test's actor or task warmed up
    probe = cls.options(num_cpus=0, runtime_env={"env_vars": {"RLGRAPH_TEST_PROBE": uuid.uuid4().hex}}).remote()
    try:
        assert ray.get(probe.modules.remote(), timeout=120) == (True, False)
    finally:
        ray.kill(probe)
