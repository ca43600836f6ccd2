"""Pass 3, prune: decide which columns the data plane stores.

A column is stored when some op reads it, the pipeline lists it in ``outputs``, or it is a
metric. Other outputs are dropped as soon as their op returns: they never cost a put.
The system columns ``uid`` and ``is_padding`` are always stored (padding and metrics need them).
"""

from __future__ import annotations

from rlgraph.graph.build import BuiltGraph
from rlgraph.graph.dsl import SYSTEM_COLUMNS

__all__ = ["prune"]


def prune(g: BuiltGraph) -> dict[str, bool]:
    """Column name -> stored? for every column some node produces."""
    consumed = {attrs["column"] for _, _, attrs in g.dag.edges(data=True)}
    keep = set(g.pipeline.outputs) | set(SYSTEM_COLUMNS)
    return {
        col: col in consumed or col in keep or g.column_types[col].kind == "metric"
        for col in g.producers
    }
