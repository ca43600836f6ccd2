"""`TrainEngine`: the mini-batch loop shared by update_actor and update_critic, whatever the backend.

One call of `train` is one training step of one rank:

    for each epoch:
        shuffle this rank's rows (generator seeded seed + dp_rank)
        for each mini-batch (mini_batch_size rows):
            global_tokens, global_seqs = all-reduce of this mini-batch's valid tokens and sequences
            for each micro-batch (micro_batch_size rows):
                loss = loss_fn(model, micro_batch, global_tokens=..., global_seqs=...)
                backward(loss * world_size)       # DDP and DeepSpeed average over ranks; we want the sum
            clip the global grad norm, one optimizer step
    one LR-scheduler step

Because every micro-batch loss is already divided by the *global* counts, the sum over
micro-batches and ranks of the gradients is the gradient of the global mean: dp=2 on two
halves of a batch updates the weights exactly as dp=1 on the whole batch does.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import defaultdict
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import Tensor

from rlgraph.ops.train.engine.config import EngineConfig, EngineError
from rlgraph.ops.train.engine.dist import all_reduce_sum

__all__ = ["TrainEngine", "LossFn", "STATE_FORMAT", "valid_counts"]

STATE_FORMAT = "rlgraph.engine.v1"

# loss_fn(model, micro_batch, global_tokens=int, global_seqs=int) -> (loss, metrics)
LossFn = Callable[..., "tuple[Tensor, Mapping[str, Any]]"]


class TrainEngine:
    """A model, its optimizer, its LR schedule and (for dp > 1) its process group. Build with `create_engine`."""

    config: EngineConfig
    rank: int
    world_size: int
    module: torch.nn.Module  # the unwrapped model
    optimizer: torch.optim.Optimizer  # the torch AdamW that owns the LR (under ZeRO: of this rank's partition)
    scheduler: torch.optim.lr_scheduler.LambdaLR
    optimizer_steps: int  # optimizer steps taken by this engine (restored by load_state_dict)
    sharded_state: bool  # state_dict() differs per rank (ZeRO >= 1): save every rank's, not just rank 0's

    # ------------------------------------------------------------------ backend hooks
    @property
    def model(self) -> Any:
        """What `loss_fn` gets and calls: the wrapped model (DDP or DeepSpeed). Attributes live on `module`."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    def _accumulating(self, last: bool) -> contextlib.AbstractContextManager:
        """Context of one micro-batch's forward and backward; `last` ends the mini-batch."""
        return contextlib.nullcontext()

    def _backward(self, loss: Tensor) -> None:
        raise NotImplementedError

    def _optimizer_step(self) -> float:
        """Reduce gradients if not done yet, clip, step, zero the gradients; return the global grad norm."""
        raise NotImplementedError

    def weights(self) -> dict[str, Tensor]:
        """The full model state_dict (unwrapped; gathered under ZeRO-3), for weight sync to generation."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and scheduler as plain dicts of str keys, tensors and numbers (checkpointable)."""
        raise NotImplementedError

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def after_train(self) -> None:
        """Called at the end of every `train` on every rank (FSDP2: refresh the serving copy)."""

    # ------------------------------------------------------------------ shared
    @property
    def steps(self) -> int:
        """Training steps done (completed `train` calls): the LR schedule's position."""
        return self.scheduler.last_epoch

    @property
    def lr(self) -> float:
        """The LR the next optimizer step uses."""
        return float(self.optimizer.param_groups[0]["lr"])

    def train(self, batch: Mapping[str, Tensor], loss_fn: LossFn, mini_batch_size: int, micro_batch_size: int,
              epochs: int = 1, seed: int | None = None, token_key: str = "response_mask",
              shuffle: bool = True, max_tokens_per_micro_batch: int = 0,
              length_key: str = "") -> list[dict[str, float]]:
        """One training step on this rank's share of the batch; returns one metrics dict per optimizer step.

        `batch` maps column names to tensors whose first dimension is the sample (this rank's
        rows of the padded batch). Every rank must hold the same number of mini-batches.
        `loss_fn(model, micro_batch, global_tokens=..., global_seqs=...)` returns ``(loss,
        metrics)`` with the loss already divided by the global counts of the mini-batch (valid
        tokens in `token_key`, and sequences with at least one valid token, so padding rows count
        in neither; both are at least 1). Each epoch reshuffles the rows with a generator seeded
        ``seed + dp_rank`` (one generator per call, so epochs differ); with no `seed`, it is
        ``config.seed + steps * world_size``, which never repeats across steps or ranks.

        With `max_tokens_per_micro_batch`, a mini-batch's micro-batches are instead the fewest parts
        whose tokens (the row lengths in column `length_key`, a ``[rows]`` tensor) fit the budget,
        balanced by length, as many on every rank (`rlgraph.ops.train.engine.balance`); the losses are
        normalised by global counts, so the result does not depend on how rows are grouped.

        Metrics per optimizer step: `loss` (the mini-batch's global loss, equal on every rank),
        `grad_norm` (global, before clipping), `lr`, and the mean over this rank's micro-batches
        of each metric `loss_fn` returned. The LR scheduler steps once, at the end.
        """
        rows = _rows(batch)
        if token_key not in batch:
            raise EngineError(f"token_key {token_key!r} is not in the batch (columns: {sorted(batch)}); pass the "
                              f"name of the 0/1 mask of valid tokens")
        if mini_batch_size < 1 or micro_batch_size < 1 or epochs < 1:
            raise EngineError(f"mini_batch_size, micro_batch_size and epochs must be >= 1, got {mini_batch_size}, "
                              f"{micro_batch_size} and {epochs}")
        num_mini = self._agree_on_mini_batches(rows, mini_batch_size)
        if seed is None:
            seed = self.config.seed + self.steps * self.world_size
        generator = torch.Generator().manual_seed(seed + self.rank)
        tokens_per_row, seq_per_row = valid_counts(batch[token_key])
        if max_tokens_per_micro_batch > 0 and length_key not in batch:
            raise EngineError(f"max_tokens_per_micro_batch needs the rows' token counts: length_key {length_key!r} "
                              f"is not in the batch (columns: {sorted(batch)})")
        lengths = batch[length_key].reshape(rows).tolist() if max_tokens_per_micro_batch > 0 else None

        self.module.train()
        out: list[dict[str, float]] = []
        local_losses: list[Tensor] = []
        for _epoch in range(epochs):
            order = torch.randperm(rows, generator=generator) if shuffle else torch.arange(rows)
            mini_batches = order.split(mini_batch_size)
            # one all-reduce per epoch for the normalisers of all its mini-batches
            counts = torch.stack([torch.stack([tokens_per_row[mb].sum(), seq_per_row[mb].sum()])
                                  for mb in mini_batches]).to(torch.int64)
            counts = all_reduce_sum(counts, self.world_size).clamp_(min=1).tolist()
            assert len(mini_batches) == num_mini
            splits = self._micro_batches(mini_batches, micro_batch_size, max_tokens_per_micro_batch, lengths)
            for mb_rows, micro_batches, (global_tokens, global_seqs) in zip(mini_batches, splits, counts):
                loss_sum = torch.zeros((), dtype=torch.float64)
                metric_sums: dict[str, float] = defaultdict(float)
                for i, micro_rows in enumerate(micro_batches):
                    micro = {k: v[micro_rows].to(self.device, non_blocking=True) for k, v in batch.items()}
                    with self._accumulating(last=i == len(micro_batches) - 1):
                        loss, metrics = _call_loss(loss_fn, self.model, micro, global_tokens, global_seqs)
                        self._backward(loss * self.world_size)
                    loss_sum += loss.detach().to("cpu", torch.float64)
                    for k, v in metrics.items():
                        metric_sums[k] += float(v)
                lr = self.lr
                grad_norm = self._optimizer_step()
                local_losses.append(loss_sum)
                out.append({"loss": 0.0, "grad_norm": float(grad_norm), "lr": lr, "micro_batches": len(micro_batches),
                            **{k: v / len(micro_batches) for k, v in metric_sums.items()}})
        global_losses = all_reduce_sum(torch.stack(local_losses), self.world_size).tolist()
        for record, loss in zip(out, global_losses):
            record["loss"] = loss
        with warnings.catch_warnings():  # a call whose steps were all skipped (non-finite) still counts
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            self.scheduler.step()
        self.after_train()
        return out

    def _micro_batches(self, mini_batches: tuple[Tensor, ...], micro_batch_size: int, budget: int,
                       lengths: list[int] | None) -> list[list[Tensor]]:
        """Each mini-batch's micro-batches (row indices): `micro_batch_size` rows each, or by token budget
        with the same count on every rank (one all-reduce per round, usually one round)."""
        if not budget or lengths is None:
            return [list(mb.split(micro_batch_size)) for mb in mini_batches]
        from rlgraph.ops.train.engine.balance import token_micro_batches

        want = [1] * len(mini_batches)
        while True:  # counts never fall below `want`, so when the maximum equals it every rank has it
            parts = [token_micro_batches([lengths[i] for i in mb.tolist()], budget, min_count=w)
                     for mb, w in zip(mini_batches, want)]
            counts = [len(p) for p in parts]
            agreed = counts if self.world_size == 1 else \
                _all_reduce_max(torch.tensor(counts, dtype=torch.int64), self.world_size).tolist()
            if agreed == counts and (self.world_size == 1 or agreed == want):
                return [[mb[torch.tensor(q, dtype=torch.long)] for q in p] for mb, p in zip(mini_batches, parts)]
            want = agreed

    def _agree_on_mini_batches(self, rows: int, mini_batch_size: int) -> int:
        """Check on every rank at once (no rank raises alone and leaves the others waiting) that
        each rank's rows split into the same number of whole mini-batches."""
        table = torch.zeros(self.world_size, 2, dtype=torch.int64)
        table[self.rank] = torch.tensor([rows, mini_batch_size])
        table = all_reduce_sum(table, self.world_size).tolist()
        problems = [f"rank {r} has {n} rows, not a multiple of mini_batch_size {m}"
                    for r, (n, m) in enumerate(table) if n % m]
        if problems:
            raise EngineError("cannot split the batch into whole mini-batches: " + "; ".join(problems) +
                              "; pad the batch to a multiple of dp * mini_batch_size (the rlgraph runtime does)")
        counts = [n // m for n, m in table]
        if len(set(counts)) > 1:
            detail = ", ".join(f"rank {r}: {c} ({n} rows / {m})" for r, (c, (n, m)) in enumerate(zip(counts, table)))
            raise EngineError(f"ranks got different numbers of mini-batches ({detail}); every rank must take the "
                              f"same number of optimizer steps: split the padded batch evenly over the ranks")
        return counts[self.rank]


def valid_counts(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per row of a ``[rows, ...]`` token mask: its valid (non-zero) tokens, and 1 if it has any: what
    the loss's normalisers (`TrainEngine.train`'s global tokens and sequences) count."""
    valid = mask.reshape(mask.shape[0], -1) != 0
    return valid.sum(dim=1), valid.any(dim=1).long()


def _all_reduce_max(t: Tensor, world_size: int) -> Tensor:
    import torch.distributed as dist

    from rlgraph.ops.train.engine.dist import collective_device

    moved = t.to(collective_device())
    dist.all_reduce(moved, op=dist.ReduceOp.MAX)
    return moved.cpu()


def _rows(batch: Mapping[str, Tensor]) -> int:
    if not batch:
        raise EngineError("train got an empty batch (no columns)")
    sizes = {}
    for k, v in batch.items():
        if not isinstance(v, Tensor) or v.dim() == 0:
            raise EngineError(f"batch column {k!r} is a {type(v).__name__}, not a tensor with a sample dimension; "
                              f"pass only per-sample tensors to train")
        sizes[k] = v.shape[0]
    if len(set(sizes.values())) > 1:
        raise EngineError(f"batch columns disagree on the number of rows: {sizes}")
    rows = next(iter(sizes.values()))
    if rows == 0:
        raise EngineError("train got a batch with no rows")
    return rows


def _call_loss(loss_fn: LossFn, model: Any, micro: dict[str, Tensor], global_tokens: int,
               global_seqs: int) -> tuple[Tensor, Mapping[str, Any]]:
    result = loss_fn(model, micro, global_tokens=global_tokens, global_seqs=global_seqs)
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], Tensor)
            and isinstance(result[1], Mapping)):
        raise EngineError(f"loss_fn {getattr(loss_fn, '__name__', loss_fn)!r} must return (loss tensor, metrics "
                          f"dict), got {type(result).__name__}")
    return result


def plain_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer.state_dict()` with the per-parameter keys as strings (checkpoints take str keys only)."""
    sd = optimizer.state_dict()
    return {"state": {str(k): v for k, v in sd["state"].items()},
            "param_groups": [dict(g) for g in sd["param_groups"]]}


def load_plain_optimizer_state(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    groups = []
    for g in state["param_groups"]:
        g = dict(g)
        if isinstance(g.get("betas"), list):  # JSON turns tuples into lists
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    optimizer.load_state_dict({"state": {int(k): v for k, v in state["state"].items()}, "param_groups": groups})


def check_state(state: Mapping[str, Any], expect: Mapping[str, Any]) -> None:
    """Refuse a state saved by another format, backend or partitioning, naming both values."""
    if state.get("format") != STATE_FORMAT:
        raise EngineError(f"not an engine state: format {state.get('format')!r}, expected {STATE_FORMAT!r}")
    bad = [f"{k}: saved {state.get(k)!r}, this engine {v!r}" for k, v in expect.items() if state.get(k) != v]
    if bad:
        raise EngineError("engine state does not fit this engine (" + "; ".join(bad) + "); restore with the "
                          "backend, ZeRO stage and dp size it was saved with")


def iter_params_with_grad(module: torch.nn.Module) -> Iterator[Tensor]:
    return (p for p in module.parameters() if p.grad is not None)


def trainable_parameters(module: torch.nn.Module) -> list[Tensor]:
    """The parameters the optimizer steps (frozen ones, e.g. the base weights under LoRA, left out)."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise EngineError("the model has no trainable parameters (every requires_grad is False)")
    return params


def model_state(module: torch.nn.Module) -> dict[str, Tensor]:
    """What a checkpoint keeps of the model: all of it, or only the trainable parameters when some are
    frozen (LoRA: the adapters; the frozen base is the model directory's)."""
    if all(p.requires_grad for p in module.parameters()):
        return module.state_dict()
    return {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}


def load_model_state(module: torch.nn.Module, state: Mapping[str, Tensor]) -> None:
    """`model_state`'s inverse: a partial state must cover every trainable parameter."""
    if all(p.requires_grad for p in module.parameters()):
        module.load_state_dict(state)
        return
    missing = sorted(n for n, p in module.named_parameters() if p.requires_grad and n not in state)
    unexpected = sorted(set(state) - {n for n, _ in module.named_parameters()})
    if missing or unexpected:
        raise EngineError(f"the saved weights do not fit this model's trainable parameters (missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]}): restore with the same LoRA settings it was saved with")
    module.load_state_dict(state, strict=False)
