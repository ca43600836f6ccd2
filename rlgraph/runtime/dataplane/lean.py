"""Process start-up without the work nobody uses: tensordict imported without torch._dynamo.

tensordict (which TransferQueue imports in every process that touches the data plane: the driver,
each worker, the data source, TQ's controller and each storage unit) marks three of its functions
for ``torch.compile`` at import time, with ``torch.compiler.allow_in_graph`` and
``assume_constant_result``. Each of these imports ``torch._dynamo``, and with it sympy and triton:
about 1.3 s of CPU per process, on a 2-core machine where start-up is CPU-bound. rlgraph never
compiles tensordict code, so importing this module imports tensordict with those two markers as
no-ops; nothing else changes (``torch.compile`` of a model works as before; tensordict's functions
only lose the marker that lets ``torch.compile`` trace through them).

It must be imported before anything else imports tensordict in a process:

- `rlgraph.runtime.dataplane.tq` imports it first (the driver, the workers, the data source);
- TQ's controller and storage units are Ray actors whose classes Ray unpickles before any rlgraph
  module is imported; `rlgraph.runtime.dataplane.guard` makes them subclasses with `LeanImports`
  as their first base, and unpickling a class imports its bases' modules in order, so this module
  runs before TQ's.

``RLGRAPH_LEAN_TENSORDICT=0`` (in the environment of ``rlgraph run``; the workers of a Ray that
rlgraph starts inherit it, a cluster's nodes need it in their own environment) imports tensordict
as it is, for code that ``torch.compile``s tensordict's own functions. Measured in
docs/performance.md (start-up).
"""

from __future__ import annotations

import os
import sys

__all__ = ["SWITCH", "LeanImports", "import_tensordict"]

SWITCH = "RLGRAPH_LEAN_TENSORDICT"  # "0": import tensordict as it is (its torch.compile markers included)

_MARKERS = ("allow_in_graph", "assume_constant_result")


def import_tensordict() -> None:
    """Import tensordict with ``torch.compile``'s import-time markers as no-ops (once; nothing
    happens if it is already imported, or if torch lacks the markers)."""
    if "tensordict" in sys.modules:
        return
    if os.environ.get(SWITCH, "1") == "0":  # as tensordict itself does it (and pays for it)
        import tensordict  # noqa: F401

        return
    import torch.compiler

    saved = {name: getattr(torch.compiler, name) for name in _MARKERS if hasattr(torch.compiler, name)}
    for name in saved:
        setattr(torch.compiler, name, _unmarked)
    try:
        import tensordict  # noqa: F401
    finally:
        for name, fn in saved.items():
            setattr(torch.compiler, name, fn)


def _unmarked(fn):  # type: ignore[no-untyped-def]
    return fn


class LeanImports:
    """A first base for a class Ray ships by value to a fresh process (TQ's actors): unpickling it
    imports this module, hence tensordict the lean way, before the class's other bases."""


import_tensordict()
