"""rlgraph: declare an RL post-training pipeline, compile it to a checked plan, run it on Ray.

    from rlgraph import Pipeline, WorkerGroup, op, T, compile
    plan = compile(pipeline, ["data.batch_size=45"])
"""

from rlgraph.errors import ConfigError, DeclarationError, PipelineError, PlanError, RLGraphError
from rlgraph.graph.columns import ColumnType, T
from rlgraph.graph.compile import compile_pipeline as compile
from rlgraph.graph.config import Param
from rlgraph.graph.dsl import Batching, Cluster, DataSource, OpSpec, Pipeline, WorkerGroup, op, op_spec
from rlgraph.graph.plan import Plan, load_plan
from rlgraph.version import __version__

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
    "compile",
    "load_plan",
    "op",
    "op_spec",
    "visualize",
]


def visualize(pipeline_or_plan, filename: str = "pipeline.svg", overrides=()):
    """Draw a pipeline (compiled first) or a plan; the format comes from the extension."""
    from rlgraph.graph.viz import visualize as _visualize

    return _visualize(pipeline_or_plan, filename, overrides)
