"""The worker actor: one per data-parallel rank of a worker group, running that group's ops.

A call carries metadata only (op name, step, chunk index, row ids, padding tags); the worker
reads the op's input columns from the data plane itself, calls the body, writes the outputs
back, and returns a small `CallResult` (timing span, metrics, per-row summaries of a few
columns for accuracy metrics). Tensors never travel through the driver.

State columns (policy weights) stay in the worker that produced them; the driver moves them
between groups as Ray object references when producer and consumer are not colocated.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from rlgraph.graph.plan import Plan
from rlgraph.runtime.dataplane import RowBatch
from rlgraph.runtime.invoke import Invoker, OpError
from rlgraph.runtime.trace import Span

__all__ = ["CallResult", "GroupWorker", "SUMMARIES"]

# Per-row summaries returned to the driver (a float per row, metadata-sized), for accuracy
# metrics over real rows: column -> metric name. Sums over the response tokens.
SUMMARIES = {"token_level_scores": "score", "token_level_rewards": "reward", "response_mask": "response_length"}


@dataclass
class CallResult:
    """What a worker returns for one call: small by construction."""

    span: Span
    metrics: dict[str, Any] = field(default_factory=dict)  # metric columns the op produced
    summaries: dict[str, dict[int, float]] = field(default_factory=dict)  # column -> row -> sum over tokens
    batch_values: dict[str, Any] = field(default_factory=dict)  # batch-level data outputs
    dropped: dict[int, tuple[str, bool]] = field(default_factory=dict)  # row -> (reason, whole group?)


def _row_sums(value: Any) -> list[float]:
    if isinstance(value, torch.Tensor):
        return value.reshape(value.shape[0], -1).float().sum(dim=1).tolist()
    return [float(torch.as_tensor(v).float().sum()) for v in value]


class GroupWorker:
    """Body of the Ray actor (wrapped with ``ray.remote`` by the runner, so it is testable as is)."""

    def __init__(self, plan_json: str, group: str, rank: int, dp: int, handle: Any) -> None:
        os.environ.setdefault("TQ_NUM_THREADS", "2")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no per-load bars in every worker's log
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        self.plan = Plan.model_validate_json(plan_json)
        self.group, self.rank, self.dp = group, rank, dp
        self.client = handle.connect()
        self.invoker: Invoker | None = None  # made by setup(), once the group's rendezvous is known

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port on it (asked of rank 0 for its group)."""
        import socket

        import ray

        addr = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
            return addr, s.getsockname()[1]

    def setup(self, master_addr: str, master_port: int) -> str:
        """Import the group's op bodies and instantiate its worker classes (all ranks at once:
        their setup may join a process group)."""
        self.invoker = Invoker(self.plan, self.group, self.rank, self.dp, master_addr, master_port)
        return f"{self.group}[{self.rank}] pid {os.getpid()}"

    def run_chunk(self, op_name: str, step: int, partition: str, chunk: int, rows: Sequence[int],
                  uids: Sequence[int], is_padding: Sequence[bool],
                  batch_inputs: dict[str, Any] | None = None, fault: str | None = None) -> CallResult:
        """Run `op_name` on `rows`. `fault` is the runner's fault-injection hook (tests): ``raise``
        makes the call fail before the body runs; ``kill`` / ``kill_after`` end this actor's
        process before the body runs / after the outputs are written."""
        start = time.time()
        op = self.plan.op(op_name)
        rows = tuple(rows)
        if fault == "kill":
            os._exit(17)
        try:
            sample_inputs = [c for c in op.inputs if self.plan.columns[c].level == "sample"]
            inputs = self.client.get(RowBatch(partition, rows), sample_inputs) if sample_inputs and rows else {}
            if fault == "raise":
                raise RuntimeError(f"injected failure in {op_name} step {step} chunk {chunk}")
            out = self.invoker.call(op, step, chunk, rows, is_padding, inputs, batch_inputs)
        except Exception as e:
            keys = list(uids[:8]) + (["..."] if len(uids) > 8 else [])
            detail = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])
            raise OpError(
                f"op {op_name!r} failed on worker {self.group}[{self.rank}] at step {step} (chunk {chunk}, "
                f"{len(rows)} rows, sample uids {keys}): {type(e).__name__}: {e}\n{detail}"
            ) from None
        put = {c: v for c, v in out.items()
               if self.plan.columns[c].level == "sample" and self.plan.columns[c].kind == "data"
               and self.plan.columns[c].stored}
        if put and rows:
            self.client.put(partition, rows, put)
        if fault == "kill_after":
            os._exit(17)
        dropped = dict(self.invoker.last_dropped)
        real = [i for i, p in enumerate(is_padding) if not p and i not in dropped]
        summaries = {}
        for c in SUMMARIES:
            if c in out:
                sums = _row_sums(out[c]) if real else []
                summaries[c] = {rows[i]: sums[i] for i in real}
        result = CallResult(
            span=Span(op=op_name, group=self.group, rank=self.rank, step=step, chunk=chunk, rows=len(rows),
                      start=start, end=time.time()),
            metrics={c: v for c, v in out.items() if self.plan.columns[c].kind == "metric"},
            summaries=summaries,
            batch_values={c: v for c, v in out.items()
                          if self.plan.columns[c].level == "batch" and self.plan.columns[c].kind == "data"},
            dropped={rows[i]: why for i, why in dropped.items()},
        )
        return result

    # ------------------------------------------------------------------ state
    def export_state(self, column: str) -> Any:
        return self.invoker.state.get(column)

    def import_state(self, column: str, value: Any) -> None:
        self.invoker.state[column] = value

    def state_columns(self) -> dict[str, Any]:
        return dict(self.invoker.state)

    def load_state_columns(self, values: dict[str, Any]) -> None:
        self.invoker.state.update(values)

    def instance_states(self) -> dict[str, Any]:
        """``state_dict()`` of every worker-class instance that has one (checkpoints)."""
        return {k: inst.state_dict() for k, inst in self.invoker.instances.items()
                if callable(getattr(inst, "state_dict", None))}

    def load_instance_states(self, states: dict[str, Any]) -> None:
        for k, st in states.items():
            inst = self.invoker.instances.get(k)
            if inst is not None and callable(getattr(inst, "load_state_dict", None)):
                inst.load_state_dict(st)

    def has_instance_state(self) -> bool:
        """Whether a worker class here keeps state beyond its op calls (a ``state_dict``)."""
        return any(callable(getattr(inst, "state_dict", None)) for inst in self.invoker.instances.values())

    def ping(self) -> bool:
        return True

    def close(self) -> None:
        self.client.close()
