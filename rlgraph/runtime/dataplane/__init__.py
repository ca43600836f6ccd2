"""The data plane: one table per step, written and read by workers.

`DataPlane` / `DataPlaneClient` are the small interface of our own; `TransferQueueDataPlane`
and `RayObjectStoreDataPlane` implement it with the same semantics (see `base` for them).
"""

from rlgraph.runtime.dataplane.base import (
    ColumnData,
    DataPlane,
    DataPlaneClient,
    DataPlaneDied,
    DataPlaneError,
    DataPlaneHandle,
    assemble_rows,
    locality_bytes_in_this_process,
    payload_bytes_in_this_process,
)
from rlgraph.runtime.dataplane.ray_store import RayObjectStoreDataPlane, RayObjectStoreHandle
from rlgraph.runtime.dataplane.tq import (
    TransferQueueConfig,
    TransferQueueDataPlane,
    TransferQueueHandle,
    check_tq_resources,
    tq_resource_problems,
)

__all__ = [
    "ColumnData",
    "DataPlane",
    "DataPlaneClient",
    "DataPlaneDied",
    "DataPlaneError",
    "DataPlaneHandle",
    "assemble_rows",
    "locality_bytes_in_this_process",
    "payload_bytes_in_this_process",
    "RayObjectStoreDataPlane",
    "RayObjectStoreHandle",
    "TransferQueueConfig",
    "TransferQueueDataPlane",
    "TransferQueueHandle",
    "check_tq_resources",
    "tq_resource_problems",
]
