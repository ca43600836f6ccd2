"""The data plane: one table per step, written and read by workers.

`DataPlane` / `DataPlaneClient` are the small interface of our own; `TransferQueueDataPlane`
and `RayObjectStoreDataPlane` implement it with the same semantics (see `base` for them).
"""

from rlgraph.runtime.dataplane.errors import DataPlaneDied, DataPlaneError

# The rest is imported on first use. The interface (`base`) imports torch, which the driver's start
# must not wait for (`rlgraph.runtime.actor`); the backends bring more: TransferQueue brings
# tensordict and torch._dynamo (about a second of a process's start), and a worker needs its
# backend only once it connects, which it does beside loading its model (`rlgraph.runtime.fleet`).
_LAZY = {
    "ColumnData": "base", "DataPlane": "base", "DataPlaneClient": "base", "DataPlaneHandle": "base",
    "assemble_rows": "base", "count_locality": "base", "counted_apart": "base",
    "locality_bytes_in_this_process": "base", "payload_bytes_in_this_process": "base",
    "RayObjectStoreDataPlane": "ray_store", "RayObjectStoreHandle": "ray_store",
    "TransferQueueConfig": "tq", "TransferQueueDataPlane": "tq", "TransferQueueHandle": "tq",
    "check_tq_resources": "tq", "tq_resource_problems": "tq",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # found directly from now on
    return value


__all__ = [
    "ColumnData",
    "DataPlane",
    "DataPlaneClient",
    "DataPlaneDied",
    "DataPlaneError",
    "DataPlaneHandle",
    "assemble_rows",
    "count_locality",
    "counted_apart",
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
