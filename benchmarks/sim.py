"""A simulated cluster: ops that hold their worker (one simulated GPU) for a modelled time.

The pipeline has GRPO's shape (generate -> reward, old_logprob, ref -> advantage per group ->
update barrier) on disjoint resource pools. Each sample's response length is drawn from a
log-normal (long-tailed, as in real generation), seeded by (trainer.seed, step, row), so the
`stream` and `sync` schedules and the driver's lower bound all see the same draws. A call then
sleeps for the time the cost model gives its rows:

- generate (per group, `micro_batch_size` prompts per call): decoding a batch lasts as long as
  its longest response: ``gen_prefill_s + gen_token_s * max(length)``; with ``streaming=True``
  (a rollout engine with continuous batching) one call per rank decodes all of its groups at
  once and hands each on when its longest sample is done (``gen_prefill_s + gen_token_s *
  max(length of the group)`` after the call starts), the call ending with the last;
- reward, old_logprob, ref (per sample): a forward pass over the call's tokens:
  ``fwd_call_s + fwd_token_s * sum(length)`` (ref and the reward model cost the same);
- advantage (per group): ``adv_call_s``;
- update (barrier, split over the train pool's ranks): ``upd_token_s * sum(length of the shard)``.

Every time is multiplied by ``time_scale``. Sleeping uses no CPU, so one 2-core machine stands in
for a cluster; Ray gets many logical CPUs and each worker is one slot of its pool.

`lower_bound` computes, from the same draws and the plan's fixed chunks, the critical path and
a per-pool bound (earliest start + load / slots + shortest remaining path, over subsets of the
pool's calls); no schedule on these pools can beat their maximum. `simulate` runs the runtime's
own scheduler (`rlgraph.runtime.scheduler`: ops in plan order, chunks in row order, the least-loaded
idle rank; `sync` opens a stage when the previous ones finished) with zero overhead. It runs it
with one call per chunk (``batch_calls=False``): the runtime batches ready chunks into one call
to save the per-call round trip this model leaves out, and in a model without that cost batching
can only lose balance (a stream schedule then came out 0.4-1.9% longer than sync in two of the
tested cases).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rlgraph import Batching, Cluster, DataSource, Pipeline, T, WorkerGroup, op, op_spec
from rlgraph.seeds import stable_seed

R = "response_len"


# --------------------------------------------------------------------------- cost model
@dataclass(frozen=True)
class Cost:
    median_len: int = 256
    sigma: float = 0.75  # log-normal sigma of response lengths: the tail's heaviness
    max_len: int = 4096
    gen_prefill_s: float = 0.02
    gen_token_s: float = 0.0008  # one decode step of a micro-batch
    fwd_call_s: float = 0.005
    fwd_token_s: float = 0.00004  # forward (prefill) per token: 20x cheaper than a decode step
    adv_call_s: float = 0.002
    upd_token_s: float = 0.00012  # forward + backward per token, per rank
    time_scale: float = 1.0

    def params(self) -> dict[str, Any]:
        return dict(self.__dict__)


def response_length(seed: int, step: int, row: int, median_len: int, sigma: float, max_len: int) -> int:
    """The simulated response length of `row` at `step` (the same in every process)."""
    g = torch.Generator().manual_seed(stable_seed("sim-len", seed, step, row))
    z = float(torch.randn((), generator=g))
    return int(min(max_len, max(1, round(median_len * math.exp(sigma * z)))))


def lengths_for(seed: int, step: int, rows: Sequence[int], is_padding: Sequence[bool], c: Cost) -> list[int]:
    return [1 if pad else response_length(seed, step, r, c.median_len, c.sigma, c.max_len)
            for r, pad in zip(rows, is_padding)]


def op_seconds(name: str, lengths: Sequence[int], c: Cost) -> float:
    """Modelled duration of a call of op `name` on rows of these lengths (one rank's share)."""
    if not lengths:
        return 0.0
    if name == "generate":
        t = c.gen_prefill_s + c.gen_token_s * max(lengths)
    elif name in ("reward", "old_logprob", "ref"):
        t = c.fwd_call_s + c.fwd_token_s * sum(lengths)
    elif name == "advantage":
        t = c.adv_call_s
    elif name == "update":
        t = c.upd_token_s * sum(lengths)
    else:
        raise KeyError(name)
    return t * c.time_scale


def _cost(config: dict) -> Cost:
    return Cost(**{k: type(getattr(Cost, k))(v) for k, v in config.get("generate", {}).items()
                   if k in Cost.__dataclass_fields__})


def _sleep_for(name: str, ctx: Any, lengths: Sequence[int]) -> float:
    t = op_seconds(name, lengths, _cost(ctx.config))
    time.sleep(t)
    return t


# --------------------------------------------------------------------------- source and ops
class SimPrompts:
    """Prompts of 8 tokens; their content does not matter to the cost model."""

    def __init__(self, config: dict, seed: int) -> None:
        self.seed = seed

    def next_batch(self, batch_size: int) -> dict[str, list]:
        return {"prompt_ids": [torch.arange(1, 9, dtype=torch.int64) + i for i in range(batch_size)]}


source = DataSource(columns={"prompt_ids": T.int64("prompt_len")}, impl=SimPrompts)
SIM = T.float32().metric()
# the policy: written by the update, read by generation (a step later, or up to max_staleness more)
WEIGHTS = T.opaque(doc="simulated policy version").state()


def group_finish_times(rows: Sequence[int], uids: Sequence[int], lens: Sequence[int], is_padding: Sequence[bool],
                       c: Cost) -> list[tuple[float, list[int]]]:
    """Continuous batching: when each group of a call (positions in `rows`) is done, earliest first."""
    groups: dict[int, list[int]] = {}
    for k, r in enumerate(rows):
        groups.setdefault(uids[r], []).append(k)
    out = []
    for ks in groups.values():
        done = 0.0 if is_padding[rows[ks[0]]] else op_seconds("generate", [lens[rows[k]] for k in ks], c)
        out.append((done, ks))
    return sorted(out, key=lambda x: (x[0], x[1][0]))


@op(outputs={"responses": T.int64(R), "gen_sim": SIM}, granularity="group", group="rollout",
    group_size_param="n", batching=Batching(micro_batch="micro_batch_size", per_rank=True))
def generate_groups(prompt_ids: T.int64("prompt_len"), uid: T.int64(), weights: WEIGHTS = None, *, n: int = 4,
                    micro_batch_size: int = 2,
                    median_len: int = 256, sigma: float = 0.75, max_len: int = 4096, gen_prefill_s: float = 0.02,
                    gen_token_s: float = 0.0008, fwd_call_s: float = 0.005, fwd_token_s: float = 0.00004,
                    adv_call_s: float = 0.002, upd_token_s: float = 0.00012, time_scale: float = 1.0, ctx=None):
    """A rollout engine with continuous batching: all of the rank's groups decode at once, each is
    handed on when its longest sample is done (the call ends with the last)."""
    c = _cost(ctx.config)
    lens = lengths_for(int(ctx.config["trainer"]["seed"]), ctx.step, ctx.rows, ctx.is_padding, c)
    uids = uid.tolist()
    start = time.time()
    for done, ks in group_finish_times(range(len(ctx.rows)), uids, lens, ctx.is_padding, c):
        time.sleep(max(0.0, start + done - time.time()))
        yield ks, {"responses": [torch.full((lens[k],), 7, dtype=torch.int64) for k in ks]}
    return {"gen_sim": time.time() - start}


@op(outputs={"responses": T.int64(R), "gen_sim": SIM}, granularity="group", group="rollout",
    group_size_param="n")
def generate(prompt_ids: T.int64("prompt_len"), weights: WEIGHTS = None, *, n: int = 4, micro_batch_size: int = 2,
             median_len: int = 256, sigma: float = 0.75, max_len: int = 4096, gen_prefill_s: float = 0.02,
             gen_token_s: float = 0.0008, fwd_call_s: float = 0.005, fwd_token_s: float = 0.00004,
             adv_call_s: float = 0.002, upd_token_s: float = 0.00012, time_scale: float = 1.0, ctx=None):
    """Responses of drawn lengths; sleeps as long as the longest (decoding a batch)."""
    c = _cost(ctx.config)
    lens = lengths_for(int(ctx.config["trainer"]["seed"]), ctx.step, ctx.rows, ctx.is_padding, c)
    t = _sleep_for("generate", ctx, lens)
    return {"responses": [torch.full((n_,), 7, dtype=torch.int64) for n_ in lens], "gen_sim": t}


def _fwd(name: str, responses: torch.Tensor, ctx: Any) -> tuple[torch.Tensor, float]:
    lens = list(ctx.lengths.get(R, [responses.shape[1]] * responses.shape[0]))
    t = _sleep_for(name, ctx, lens)
    return torch.zeros(responses.shape, dtype=torch.float32), t


@op(outputs={"token_level_scores": T.float32(R), "reward_sim": SIM}, group="reward")
def reward(responses: T.int64(R), *, micro_batch_size: int = 8, ctx=None):
    out, t = _fwd("reward", responses, ctx)
    return {"token_level_scores": out, "reward_sim": t}


@op(outputs={"old_log_probs": T.float32(R), "old_sim": SIM}, group="train")
def old_logprob(responses: T.int64(R), *, micro_batch_size: int = 8, ctx=None):
    out, t = _fwd("old_logprob", responses, ctx)
    return {"old_log_probs": out, "old_sim": t}


@op(outputs={"ref_log_prob": T.float32(R), "ref_sim": SIM}, group="ref")
def ref(responses: T.int64(R), *, micro_batch_size: int = 8, ctx=None):
    out, t = _fwd("ref", responses, ctx)
    return {"ref_log_prob": out, "ref_sim": t}


@op(outputs={"advantages": T.float32(R)}, granularity="group", group="cpu")
def advantage(token_level_scores: T.float32(R), uid: T.int64(), *, micro_batch_size: int = 4, ctx=None):
    _sleep_for("advantage", ctx, [1])
    return {"advantages": token_level_scores}


@op(outputs={"update_metrics": T.json().metric(), "weights": WEIGHTS}, granularity="batch", group="train")
def update(responses: T.int64(R), old_log_probs: T.float32(R), ref_log_prob: T.float32(R),
           advantages: T.float32(R), ctx=None):
    lens = list(ctx.lengths.get(R, [responses.shape[1]] * responses.shape[0]))
    t = _sleep_for("update", ctx, lens)
    return {"update_metrics": {"sim_s": t}, "weights": {"step": ctx.step}}


OPS = [generate, reward, old_logprob, ref, advantage, update]


def pipeline(pools: int = 4, rollout_dp: int = 4, train_dp: int = 2, cpus_per_node: float = 64,
             streaming: bool = False) -> Pipeline:
    """GRPO-shaped simulated pipeline on `pools` disjoint GPU pools (2, 3 or 4) plus a CPU pool
    (`streaming`: generation by continuous batching, handing on each group as it finishes):

    - 2: rollout | train (old_logprob, ref, reward model, update);
    - 3: rollout | train (old_logprob, ref, update) | reward model;
    - 4: rollout | train (old_logprob, update) | ref | reward model.

    Colocated ops share one worker group rather than naming a shared `pool`: the runner tracks
    idle ranks per group, so groups on one pool could run at the same time.
    """
    if pools not in (2, 3, 4):
        raise ValueError("pools must be 2, 3 or 4")
    ops = [generate, advantage, update, old_logprob]
    ops.append(reward if pools >= 3 else _regroup(reward, "train"))
    ops.append(ref if pools >= 4 else _regroup(ref, "train"))
    ops = sorted(ops, key=lambda o: [f.__name__ for f in OPS].index(_name(o)))
    # the rollout may run up to trainer.max_staleness steps ahead of the update (default 0)
    ops[0] = op_spec(generate_groups if streaming else generate).with_(name="generate", stale_ok=True)
    groups = [WorkerGroup("rollout", dp=rollout_dp, num_cpus=0.1), WorkerGroup("train", dp=train_dp, num_cpus=0.1),
              WorkerGroup("cpu", dp=1, num_cpus=0.1)]
    if pools >= 3:
        groups.append(WorkerGroup("reward", dp=1, num_cpus=0.1))
    if pools >= 4:
        groups.append(WorkerGroup("ref", dp=1, num_cpus=0.1))
    return Pipeline(name=f"sim{pools}", source=source, ops=ops, groups=groups,
                    cluster=Cluster(num_nodes=1, cpus_per_node=cpus_per_node, gpus_per_node=0),
                    config={"data": {"batch_size": 16}}, summaries={"token_level_scores": "score"})


def _name(o: Any) -> str:
    from rlgraph import OpSpec, op_spec

    return o.name if isinstance(o, OpSpec) else op_spec(o).name


def _regroup(fn: Any, group: str) -> Any:
    from rlgraph import op_spec

    return op_spec(fn).with_(group=group)


# --------------------------------------------------------------------------- the bound
@dataclass
class Job:
    op: str
    index: int
    pool: str
    width: int  # ranks it holds at once (barriers: all of the group's)
    dur: float
    preds: list[int]
    rows: frozenset[int] = frozenset()
    parts: dict[int, float] | None = None  # a streaming call: row -> when it is handed on (from the start)


def _avail(p: Job, j: Job) -> float:
    """How long after `p` starts the rows `j` needs from it exist: its end, or their parts' times."""
    if p.parts is None:
        return p.dur
    return max(p.parts[r] for r in p.rows & j.rows)


def step_layout(plan: Any, step: int) -> tuple[list[int], list[bool]]:
    """Row group ids and padding tags as the source lays them out (docs/runtime.md)."""
    b = plan.batch
    rows = b.padded_batch_warmup if step < b.critic_warmup else b.padded_batch
    prompts, n = b.batch_size, b.n
    uid0 = step * rows
    uids = [uid0 + p for p in range(prompts) for _ in range(n)]
    uids += [uid0 + prompts + i for i in range(rows - prompts * n)]
    return uids, [False] * (prompts * n) + [True] * (rows - prompts * n)


def jobs_for_step(plan: Any, step: int) -> list[Job]:
    """The step's op calls (the runtime's fixed chunks) with modelled durations and dependencies."""
    from rlgraph.runtime.scheduler import make_chunks

    c = _cost(plan.config)
    seed = int(plan.config["trainer"]["seed"])
    uids, pad = step_layout(plan, step)
    lens = lengths_for(seed, step, range(len(uids)), pad, c)
    groups = {g.name: g for g in plan.groups}
    jobs: list[Job] = []
    producer_chunks: dict[str, list[tuple[set[int], int]]] = {}  # column -> (rows, job id)
    for o in plan.ops:  # plan order is topological
        g = groups[o.group]
        for ch in make_chunks(o, uids):
            rows = set(ch.rows)
            preds = sorted({j for col in o.inputs for (rs, j) in producer_chunks.get(col, []) if rs & rows})
            parts = None
            if o.mode == "barrier":
                shards = [ch.rows[r * len(ch.rows) // g.dp:(r + 1) * len(ch.rows) // g.dp] for r in range(g.dp)]
                dur, width = max(op_seconds(o.name, [lens[i] for i in s], c) for s in shards), g.dp
            elif o.streams:
                times = group_finish_times(ch.rows, uids, lens, pad, c)
                parts = {ch.rows[k]: t for t, ks in times for k in ks}
                dur, width = max(t for t, _ in times), 1
            else:
                dur, width = op_seconds(o.name, [lens[i] for i in ch.rows], c), 1
            jobs.append(Job(o.name, ch.index, g.pool, width, dur, preds, frozenset(rows), parts))
            for col in o.outputs:
                producer_chunks.setdefault(col, []).append((rows, len(jobs) - 1))
    return jobs


def lower_bound(plan: Any, jobs: list[Job]) -> dict[str, float]:
    """Critical path, per-pool bound, and their maximum (a lower bound on the step's makespan)."""
    head = [0.0] * len(jobs)
    for i, j in enumerate(jobs):  # a job starts once the rows it reads exist (parts: before its producer ends)
        head[i] = max((head[p] + _avail(jobs[p], j) for p in j.preds), default=0.0)
    succs: list[list[int]] = [[] for _ in jobs]
    for i, j in enumerate(jobs):
        for p in j.preds:
            succs[p].append(i)
    tail = [0.0] * len(jobs)  # the least work left after a job ends (a successor may start before)
    for i in reversed(range(len(jobs))):
        tail[i] = max((max(0.0, _avail(jobs[i], jobs[s]) - jobs[i].dur + jobs[s].dur + tail[s]) for s in succs[i]),
                      default=0.0)
    cp = max(head[i] + jobs[i].dur + tail[i] for i in range(len(jobs)))
    slots = {p.name: len(p.bundles) for p in plan.pools}
    pool_lb, busiest, busiest_load = 0.0, "", 0.0
    for pool in sorted({j.pool for j in jobs}):
        ids = [i for i, j in enumerate(jobs) if j.pool == pool]
        load = sum(jobs[i].dur * jobs[i].width for i in ids) / slots[pool]
        if load > busiest_load:
            busiest, busiest_load = pool, load
        for a in sorted({head[i] for i in ids}):
            sub = [i for i in ids if head[i] >= a - 1e-12]
            for b in sorted({tail[i] for i in sub}):
                s = [i for i in sub if tail[i] >= b - 1e-12]
                pool_lb = max(pool_lb, a + sum(jobs[i].dur * jobs[i].width for i in s) / slots[pool] + b)
    return {"critical_path": cp, "pool_bound": pool_lb, "busiest_pool": busiest,
            "busiest_load": busiest_load, "bound": max(cp, pool_lb)}


def simulate(plan: Any, step: int, schedule: str) -> float:
    """Makespan of the runtime's own scheduler (`StepScheduler`) with zero overhead: an event
    simulation in which each call holds its rank for its modelled duration."""
    import heapq

    from rlgraph.runtime.scheduler import StepScheduler

    c = _cost(plan.config)
    uids, pad = step_layout(plan, step)
    lens = lengths_for(int(plan.config["trainer"]["seed"]), step, range(len(uids)), pad, c)
    sched = StepScheduler(plan, uids, pad, step, schedule, batch_calls=False)
    events: list[tuple[float, int, Any, Any]] = []  # (time, tie-break, call, rows of a part or None: the end)
    now, k = 0.0, 0
    while not sched.finished:
        for call in sched.next_calls():
            if plan.op(call.chunk.op).streams:
                times = group_finish_times(call.rows, uids, lens, pad, c)
                for t, ks in times:
                    heapq.heappush(events, (now + t, k, call, [call.rows[x] for x in ks]))
                    k += 1
                end = now + max(t for t, _ in times)
            else:
                end = now + op_seconds(call.chunk.op, [lens[i] for i in call.rows], c)
            heapq.heappush(events, (end, k, call, None))
            k += 1
        now, _, call, rows = heapq.heappop(events)
        if rows is not None:
            sched.rows_done(call.chunk.op, rows)
        else:
            sched.call_done(call)
    return now


def simulate_steps(plan: Any, steps: int, schedule: str) -> dict[str, Any]:
    """`steps` steps of the runtime's own scheduler and cross-step window (`StepScheduler`,
    `Window`, up to ``trainer.max_staleness`` + 1 steps in flight) with zero overhead: an event
    simulation in which each call holds its rank for its modelled duration and weight syncs are
    instant. Returns the makespan, each pool's idle fraction and each step's staleness (how many
    updates behind the trained policy its rollout policy was)."""
    import heapq

    from rlgraph.runtime.scheduler import Slots, StepScheduler
    from rlgraph.runtime.window import Window

    c = _cost(plan.config)
    seed = int(plan.config["trainer"]["seed"])
    depth = int(plan.config["trainer"].get("max_staleness", 0)) + 1
    state_ops = plan.state_ops()
    window = Window(plan, {g.name: any(o in state_ops for o in g.ops) for g in plan.groups})
    slots = Slots(plan)
    layout = {}
    events: list[tuple[float, int, Any, Any, Any]] = []  # (time, tie-break, step key, call, part rows or None)
    busy = {p.name: 0.0 for p in plan.pools}
    read: dict[int, int | None] = {}  # step -> producer step of the weights its rollout read
    now, k, admitted = 0.0, 0, 0
    while admitted < steps or window.live:
        while admitted < steps and len(window.live) < depth:
            uids, pad = step_layout(plan, admitted)
            layout[admitted] = (uids, pad, lengths_for(seed, admitted, range(len(uids)), pad, c))
            window.admit(admitted, StepScheduler(plan, uids, pad, admitted, schedule, slots=slots,
                                                 gated=window.gated_ops(), batch_calls=False))
            admitted += 1
        synced = True
        while synced:  # weight syncs are instant here: apply them, then open what they unblock
            synced = False
            for gate in window.gates():
                if gate.sync is not None:
                    window.holds(*gate.sync)
                    synced = True
                else:
                    window.live[gate.key].open(gate.op)
                    if gate.op == "generate":
                        read[gate.key.step] = window.held.get(("weights", "rollout"))
        for key in sorted(window.live):
            uids, pad, lens = layout[key.step]
            for call in window.live[key].next_calls():
                pool = plan.group(plan.op(call.chunk.op).group).pool
                if plan.op(call.chunk.op).streams:
                    times = group_finish_times(call.rows, uids, lens, pad, c)
                    for t, ks in times:
                        heapq.heappush(events, (now + t, k, key, call, [call.rows[x] for x in ks]))
                        k += 1
                    dur = max(t for t, _ in times)
                else:
                    dur = op_seconds(call.chunk.op, [lens[i] for i in call.rows], c)
                busy[pool] += dur
                heapq.heappush(events, (now + dur, k, key, call, None))
                k += 1
        done = list(window.pop_done())
        if not events:
            if done or (admitted < steps and len(window.live) < depth):
                continue
            raise RuntimeError(f"simulated steps {sorted(window.live)} cannot make progress: "
                               f"{ {s: window.live[s].unfinished() for s in window.live} }")
        now, _, key, call, rows = heapq.heappop(events)
        sched = window.live[key]
        if rows is not None:
            sched.rows_done(call.chunk.op, rows)
        elif sched.call_done(call) and sched.op_finished(call.chunk.op):
            window.produced(call.chunk.op, key.step)
    idle = {p.name: 1 - busy[p.name] / (now * len(p.bundles)) for p in plan.pools if busy[p.name] or p.name != "cpu"}
    # policy versions: the weights written by the update of step s are version s + 1 (0: initial)
    staleness = [t - (read[t] + 1 if read.get(t) is not None else 0) for t in range(steps)]
    return {"makespan": now, "idle": idle, "staleness": staleness}
