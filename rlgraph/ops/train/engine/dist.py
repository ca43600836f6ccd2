"""The process group of a data-parallel worker group: one Ray actor (one process) per rank.

The runner gives every rank of a group the same free port on the group's first node; each
actor calls `init_distributed` before it builds its engine. All traffic stays on
`master_addr` (127.0.0.1 for a one-node cluster).
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from rlgraph.ops.train.engine.config import EngineError

__all__ = ["init_distributed", "free_port", "all_reduce_sum", "collective_device"]

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (for a rendezvous you start right away)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_distributed(rank: int, world_size: int, master_addr: str = "127.0.0.1", master_port: int | None = None,
                     backend: str = "gloo", timeout_s: float = 600.0, local_rank: int = 0,
                     always: bool = False) -> bool:
    """Join this process to the group's default process group; returns whether one exists afterwards.

    Sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment in any case:
    DeepSpeed reads them even for one process. With ``world_size == 1`` the process group is
    only created when `always` is true (the torch backend needs none; DeepSpeed does, and its
    engine asks for one). `local_rank` is the device index inside this process: 0 for Ray
    actors, which see only their own GPU. With a loopback `master_addr`, gloo is pinned to the
    loopback interface (GLOO_SOCKET_IFNAME) so no traffic leaves the machine. Calling it again
    with the same rank and world size is a no-op; with others it raises.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise EngineError(f"init_distributed needs 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise EngineError(
                f"this process already belongs to a process group as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, not rank {rank} of {world_size}; one process is one rank of one group")
        return True
    if master_port is None:
        if world_size > 1:
            raise EngineError("init_distributed with world_size > 1 needs master_port: the same free port on every "
                              "rank (pick it once, e.g. with free_port(), and hand it to all ranks)")
        master_port = free_port(master_addr)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    if world_size == 1 and not always:
        return False
    if backend == "gloo" and master_addr in _LOOPBACK:
        # gloo connects ranks on the interface its hostname resolves to, which may be external even
        # when the rendezvous is on 127.0.0.1; all ranks are on this machine, so use loopback
        loopback = next((name for _, name in socket.if_nameindex() if name in ("lo", "lo0")), None)
        if loopback is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    return True


def collective_device() -> torch.device:
    """Where a collective's tensors must be: the GPU under NCCL, the CPU under gloo."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(t: torch.Tensor, world_size: int) -> torch.Tensor:
    """Sum `t` over the ranks in place (no-op for one rank). NCCL needs it on the GPU, gloo on the CPU."""
    if world_size == 1:
        return t
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else t.device
    moved = t.to(device)
    dist.all_reduce(moved, op=dist.ReduceOp.SUM)
    if moved is not t:
        t.copy_(moved)
    return t
