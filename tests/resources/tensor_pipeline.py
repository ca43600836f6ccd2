"""A PPO-shaped pipeline of plain tensor functions (no models), for runtime tests.

gen (per group, seeded per chunk) -> score (per sample) and values (per sample, other group,
reads the state produced by update) -> adv (barrier, whitening over real rows) -> update
(barrier; state `w` read by gen in the same group and by values in another group).

Padding rows score 1000, so a metric that included them would show it.
"""

import os
import tempfile
from pathlib import Path

import torch

from rlgraph import Cluster, DataSource, Param, Pipeline, T, WorkerGroup, op, op_spec

L = "len"


class CountSource:
    """Prompts are 1-D float tensors of seeded random length; the position is checkpointable."""

    def __init__(self, config, seed):
        self.seed = seed
        self.position = 0
        self.fail_at = int(config.get("fail_at", -1))  # a batch starting here raises (tests of a failing source)

    def next_batch(self, batch_size):
        if self.position == self.fail_at:
            raise RuntimeError(f"the source was told to fail at position {self.position}")
        rows = []
        for i in range(batch_size):
            g = torch.Generator().manual_seed(self.seed * 100_003 + self.position + i)
            n = int(torch.randint(1, 6, (1,), generator=g))
            rows.append(torch.rand(n, generator=g))
        self.position += batch_size
        return {"x": rows}

    def next_val_batch(self, batch_size):
        return {"x": [torch.ones(3) for _ in range(batch_size)]}

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = int(state["position"])


@op(outputs={"y": T.float32(L), "mask": T.int64(L)}, granularity="group", group="actor",
    group_size_param="n")
def gen(x: T.float32("xlen"), w: T.float32().state(), *, n: int = 2, fail_step: int = -1, ctx=None):
    if ctx.step == fail_step:
        raise ValueError("gen was told to fail")
    g = torch.Generator().manual_seed(ctx.seed)
    weight = 1.0 if w is None else float(w)
    ys = [row * weight + torch.rand(row.shape, generator=g) for row in x]
    return {"y": ys, "mask": [torch.ones(len(v), dtype=torch.int64) for v in ys]}


@op(outputs={"token_level_scores": T.float32(L)}, group="reward")
def score(y: T.float32(L), mask: T.int64(L), is_padding: T.bool(), *, micro_batch_size: int = 3):
    return _score(y, mask, is_padding)


def _score(y, mask, is_padding):
    s = torch.zeros_like(y)
    last = mask.sum(dim=1) - 1
    per_row = torch.where(is_padding, torch.full_like(last, 1000, dtype=y.dtype), (y * mask).sum(dim=1) / 10)
    s[torch.arange(len(y)), last.clamp(min=0)] = per_row
    return {"token_level_scores": s}


class ClosingScore:
    """`score` as a worker class that says when it was closed: a file named by its run's seed and its
    process in CLOSED_DIR (tests of the end of a run)."""

    def setup(self, ctx):
        self.seed = ctx.seed

    def score(self, y, mask, is_padding, *, micro_batch_size: int = 3):
        return _score(y, mask, is_padding)

    def close(self):
        CLOSED_DIR.mkdir(parents=True, exist_ok=True)
        (CLOSED_DIR / f"{self.seed}-{os.getpid()}").touch()


CLOSED_DIR = Path(tempfile.gettempdir()) / "rlgraph-test-closed"
closing_score = op_spec(score).with_(impl=f"{__name__}:ClosingScore.score", impl_file=__file__)


@op(outputs={"values": T.float32(L)}, group="critic")
def values(y: T.float32(L), mask: T.int64(L), w: T.float32().state(), *, micro_batch_size: int = 4):
    weight = 0.0 if w is None else float(w)
    return {"values": (y.cumsum(dim=1) * 0.1 + weight) * mask}


@op(outputs={"advantages": T.float32(L), "advantage_metrics": T.json().metric()}, granularity="batch",
    group="adv")
def adv(token_level_scores: T.float32(L), values: T.float32(L), mask: T.int64(L), is_padding: T.bool()):
    real = (~is_padding).unsqueeze(1) * mask
    a = token_level_scores - values
    mean = (a * real).sum() / real.sum()
    std = (((a - mean) ** 2) * real).sum().div(real.sum()).sqrt()
    return {"advantages": (a - mean) / (std + 1e-6) * real,
            "advantage_metrics": {"raw_mean": float(mean)}}


@op(outputs={"update_metrics": T.json().metric(), "w": T.float32().state()}, granularity="batch", group="actor")
def update(advantages: T.float32(L), mask: T.int64(L), w: T.float32().state(), *, lr: float = 0.1):
    prev = 1.0 if w is None else float(w)
    step = float((advantages * mask).abs().sum() / mask.sum().clamp(min=1))
    new = prev + lr * step
    return {"update_metrics": {"w": new, "adv_abs": step}, "w": torch.tensor(new)}


pipeline = Pipeline(
    name="tensor_ppo",
    source=DataSource(columns={"x": T.float32("xlen")}, impl=CountSource,
                      params={"fail_at": Param(int, -1, "a batch starting at this position raises")}),
    ops=[gen, score, values, adv, update],
    groups=[WorkerGroup("actor", num_cpus=0.5), WorkerGroup("reward", num_cpus=0.5),
            WorkerGroup("critic", num_cpus=0.5), WorkerGroup("adv", num_cpus=0.25)],
    cluster=Cluster(cpus_per_node=8),
    config={"data": {"batch_size": 5}, "gen": {"n": 2}, "trainer": {"steps": 3}},
    summaries={"token_level_scores": "score"},
    validation=["token_level_scores"],
)
