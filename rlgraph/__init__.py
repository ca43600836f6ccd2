"""rlgraph: declare an RL post-training pipeline, compile it to a checked plan, run it on Ray.

    from rlgraph import Pipeline, WorkerGroup, op, T, compile
    plan = compile(pipeline, ["data.batch_size=45"])

The names below are imported when first used (PEP 562): a process that needs only part of
rlgraph (a data-plane actor, the reaper) does not build the compiler's models on import.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from rlgraph import imports
from rlgraph.errors import ConfigError, DeclarationError, PipelineError, PlanError, RLGraphError
from rlgraph.version import __version__

imports.install()  # transformers' import table read back, not rebuilt, in every process (rlgraph.imports)

if TYPE_CHECKING:
    from rlgraph.graph.columns import ColumnType, T
    from rlgraph.graph.compile import compile_pipeline as compile
    from rlgraph.graph.config import Param
    from rlgraph.graph.dsl import Batching, Cluster, DataSource, OpSpec, Pipeline, WorkerGroup, op, op_spec
    from rlgraph.graph.plan import Plan, load_plan

_LAZY = {  # name -> (module, attribute)
    "ColumnType": ("rlgraph.graph.columns", "ColumnType"),
    "T": ("rlgraph.graph.columns", "T"),
    "compile": ("rlgraph.graph.compile", "compile_pipeline"),
    "Param": ("rlgraph.graph.config", "Param"),
    **{name: ("rlgraph.graph.dsl", name)
       for name in ("Batching", "Cluster", "DataSource", "OpSpec", "Pipeline", "WorkerGroup", "op", "op_spec")},
    "Plan": ("rlgraph.graph.plan", "Plan"),
    "load_plan": ("rlgraph.graph.plan", "load_plan"),
}

__all__ = [
    "Batching",
    "Cluster",
    "ColumnType",
    "ConfigError",
    "DataSource",
    "DeclarationError",
    "OpSpec",
    "Param",
    "Pipeline",
    "PipelineError",
    "Plan",
    "PlanError",
    "RLGraphError",
    "T",
    "WorkerGroup",
    "__version__",
    "compile",
    "load_plan",
    "op",
    "op_spec",
    "visualize",
]


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'rlgraph' has no attribute {name!r}") from None
    value = getattr(import_module(module), attribute)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def visualize(pipeline_or_plan, filename: str = "pipeline.svg", overrides=()):
    """Draw a pipeline (compiled first) or a plan; the format comes from the extension."""
    from rlgraph.graph.viz import visualize as _visualize

    return _visualize(pipeline_or_plan, filename, overrides)
