"""A GRPO-shaped pipeline of plain tensor functions whose generator streams its groups.

gen (one call per rank, all of its groups; yields each group as it "finishes": groups sleep in
proportion to a seeded length, so they finish out of order) -> score (per sample, 2 rows per call)
-> adv (per group, vectorised) -> update (barrier; state `w` read by gen next step). lp (per sample,
on the actor, reading only gen's columns and `w`, as old_logprob does) is fused into gen's calls.
"""

import os
import time

import torch

from rlgraph import Batching, Cluster, DataSource, Pipeline, T, WorkerGroup, op

L = "len"


class Prompts:
    def __init__(self, config, seed):
        self.seed, self.position = seed, 0

    def next_batch(self, batch_size):
        rows = []
        for i in range(batch_size):
            g = torch.Generator().manual_seed(self.seed * 7919 + self.position + i)
            rows.append(torch.rand(int(torch.randint(1, 5, (1,), generator=g)), generator=g))
        self.position += batch_size
        return {"x": rows}

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = int(state["position"])


@op(outputs={"y": T.float32(L), "mask": T.int64(L), "gen_metrics": T.json().metric()}, granularity="group",
    group="actor", group_size_param="n", batching=Batching(micro_batch="micro_batch_size", per_rank=True))
def gen(x: T.float32("xlen"), uid: T.int64(), w: T.float32().state(), *, n: int = 2,
        micro_batch_size: int = 1, delay_s: float = 0.05, fail_step: int = -1, fail_once_file: str = "",
        ctx=None):
    """Each group takes `delay_s` x its seeded prompt length (1-4); groups are yielded as they finish."""
    weight = 1.0 if w is None else float(w)
    groups: dict[int, list[int]] = {}
    for i, u in enumerate(uid.tolist()):
        groups.setdefault(u, []).append(i)
    lengths = ctx.lengths["xlen"]
    order = sorted(groups, key=lambda u: (0 if ctx.is_padding[groups[u][0]] else lengths[groups[u][0]], u))
    start = time.time()
    for k, u in enumerate(order):
        rows = groups[u]
        if ctx.step == fail_step and k == 1:
            if not fail_once_file:
                raise ValueError("gen was told to fail after its first part")
            if not os.path.exists(fail_once_file):  # fail the first try only
                open(fail_once_file, "w").close()
                raise ValueError("gen was told to fail once after its first part")
        length = lengths[rows[0]]
        time.sleep(0 if ctx.is_padding[rows[0]] else delay_s * length)
        g = torch.Generator().manual_seed(ctx.seed + u)
        ys = [x[i, :length] * weight + torch.rand(length, generator=g) for i in rows]
        yield rows, {"y": ys, "mask": [torch.ones(length, dtype=torch.int64) for _ in rows]}
    return {"gen_metrics": {"groups": len(order), "seconds": time.time() - start}}


@op(outputs={"lp": T.float32(L), "lp_metrics": T.json().metric()}, group="actor")
def lp(y: T.float32(L), mask: T.int64(L), w: T.float32().state(), *, micro_batch_size: int = 5,
       fail_step: int = -1, fail_once_file: str = "", ctx=None):
    """A forward pass on gen's rows (fused into gen's calls): 5 rows per chunk."""
    if ctx.step == fail_step and ctx.chunk == 1:
        if not fail_once_file:
            raise ValueError("lp was told to fail")
        if not os.path.exists(fail_once_file):
            open(fail_once_file, "w").close()
            raise ValueError("lp was told to fail once")
    weight = 1.0 if w is None else float(w)
    return {"lp": torch.log1p(y.abs()) * mask * weight, "lp_metrics": {"rows": len(y), "chunk": ctx.chunk}}


@op(outputs={"token_level_scores": T.float32(L)}, group="reward")
def score(y: T.float32(L), mask: T.int64(L), *, micro_batch_size: int = 2):
    s = torch.zeros_like(y)
    last = (mask.sum(dim=1) - 1).clamp(min=0)
    s[torch.arange(len(y)), last] = (y * mask).sum(dim=1) / 10
    return {"token_level_scores": s}


@op(outputs={"advantages": T.float32(L), "adv_metrics": T.json().metric()}, granularity="group", group="reward",
    vectorised=True, cost=0.2)
def adv(token_level_scores: T.float32(L), mask: T.int64(L), uid: T.int64(), ctx=None):
    """Vectorised: one body call for every ready group, with one metrics record per group (`ctx.chunks`);
    cheap (cost < 1), so its ready groups go out in one call."""
    total = (token_level_scores * mask).sum(dim=1)
    out = torch.zeros_like(token_level_scores)
    for u in uid.unique():
        rows = uid == u
        out[rows] = ((total[rows] - total[rows].mean()).unsqueeze(1) * mask[rows])
    records, at = [], 0
    for n in ctx.chunks:
        records.append({"total": float(total[at:at + n].sum()), "groups_count": 1, "chunk_rows_max": n})
        at += n
    return {"advantages": out, "adv_metrics": records}


@op(outputs={"update_metrics": T.json().metric(), "w": T.float32().state()}, granularity="batch", group="actor")
def update(advantages: T.float32(L), mask: T.int64(L), lp: T.float32(L), w: T.float32().state(), *,
           lr: float = 0.1):
    prev = 1.0 if w is None else float(w)
    new = prev + lr * float((advantages * mask).abs().sum() / mask.sum().clamp(min=1)) + 1e-3 * float(lp.sum())
    return {"update_metrics": {"w": new}, "w": torch.tensor(new)}


pipeline = Pipeline(
    name="stream_tensors",
    source=DataSource(columns={"x": T.float32("xlen")}, impl=Prompts),
    ops=[gen, lp, score, adv, update],
    groups=[WorkerGroup("actor", num_cpus=0.5), WorkerGroup("reward", num_cpus=0.5)],
    cluster=Cluster(cpus_per_node=8),
    config={"data": {"batch_size": 6}, "gen": {"n": 2}, "trainer": {"steps": 2}},
    summaries={"token_level_scores": "score"},
)
