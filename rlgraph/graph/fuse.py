"""Pass 7, fuse: run a worker group's ops that follow each other as one dispatched call per chunk.

Ops of one group share its actors, so when ``ref`` reads nothing but what ``generate`` just
wrote on the actor, dispatching it as a call of its own only adds a round trip through the
driver: the actor finishes generating, the driver learns of it, marks the rows ready and sends
the next call. A *fused chain* removes that: the leader's call carries its followers, and the
worker runs each follower on the call's rows right after the leader, reading the leader's
outputs from its own memory (`rlgraph.runtime.dataplane.local`). A column goes to the data
plane only when something outside the chain may read it (another group, or a later op on another
rank); one read only inside the chain never leaves the worker (a summary needs no plane: the
worker sends each row's sum with the call's result).

An op F follows leader L (``OpPlan.fused_into``) when all of these hold:

- ``trainer.fuse_ops`` is true (the default);
- F runs on L's worker group, and every data column it reads is written by the data source or by
  an op of L's chain (L or an earlier follower), at least one by the chain, or is read by an op of
  the chain (then it was ready when L's call started): F can start as soon as L's call has written
  its rows, with nothing more from another group;
- F is a forward pass on its rows: it writes no state, has no mini-batches (not an update), is
  not a barrier, not streaming, not one call per rank, drops no rows and is not part of dynamic
  sampling's rounds; the state it reads (the policy's weights for ``old_logprob``), L reads too,
  with the same lag (and not a partial-rollout L, which may switch weights mid-call), so the
  version L's call was given is the one F must see, and no op before F in the chain writes it;
- or F *closes* the chain: a barrier, an op with mini-batches or one that writes state (the
  update), which does not stream, drop rows, run one call per rank or belong to dynamic
  sampling's rounds, after a leader that makes one call per step (one call per rank, on a group
  of one rank). Its one chunk is then the leader's, every row of the step, as unfused; it runs
  after the rollout ops on the same worker, which in a synchronous step is exactly when the
  driver would have sent it, less the hand-off. A failed call whose chain writes state is
  restored from a checkpoint, not run again (`rlgraph.runtime.scheduler.repair_for`), as a
  failed update always was;
- L is not a barrier, drops no rows, is not part of dynamic sampling's rounds, and either runs
  one call per rank (``per_rank``: then F comes right after it on that rank anyway) or nothing
  on another pool reads its outputs. (A leader of many chunks feeding another pool keeps its
  chunks back to back, so that pool starts on them as early as before.) F's own outputs reach
  other pools when the call ends, as they would have with F run right after L on that rank; a
  leader that does not stream its parts hands its rows on at the call's end too, after F.
- a per-group F (advantage-like, whole groups per chunk) follows only an L whose chunks hold whole
  groups: a per-group L, or a per-sample L cut into micro-batches of whole groups (a multiple of
  the group size n, not one call per rank). So the reward's call can carry the advantage.

F's chunks are then L's chunks, each split into F's own micro-batches (`make_chunks` with
``within``), so every schedule makes the same calls on the same rows: ``stream == sync`` holds.
Where L has one chunk (one rank of a per-rank L) F's chunks are those it has unfused, and results
equal an unfused run's; where L has several, F's micro-batches restart at each of L's chunks, so
chunk boundaries (and with them per-chunk seeds and padding widths) may differ from an unfused run.
A step that skips F (validation, a warm-up) runs L alone; a step that skips L runs F on its own.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from rlgraph.graph.plan import ColumnPlan, OpPlan

__all__ = ["fused_leaders"]


def fused_leaders(ops: Sequence[OpPlan], columns: Mapping[str, ColumnPlan], source_columns: Sequence[str],
                  pool_of: Mapping[str, str], round_ops: Sequence[str], enabled: bool = True,
                  group_size: int = 1) -> dict[str, str]:
    """Follower -> its chain's leader, for every op that runs inside another op's calls ({} if none)."""
    if not enabled:
        return {}
    by_name = {o.name: o for o in ops}
    source, rounds = set(source_columns), set(round_ops)
    leader_of: dict[str, str] = {}  # op -> its chain's leader (a leader is its own)
    chain_reads: dict[str, set[str]] = {}  # leader -> the columns its chain's ops read (ready at its call's start)
    out: dict[str, str] = {}
    writes_state: dict[str, set[str]] = {}  # leader -> the state columns its chain's followers write
    for f in sorted(ops, key=lambda o: o.stage):  # producers come in earlier stages
        if not _may_follow(f, rounds):
            continue
        closes = _updates(f, columns)  # then it may only close a chain
        producers = {columns[c].producer for c in f.inputs if c not in source}
        if not producers or any(p not in by_name for p in producers):
            continue
        name = _chain_of(f, producers, by_name, leader_of, chain_reads, columns)
        if not name:
            continue
        lead = by_name[name]
        if lead.group != f.group:
            continue
        if lead.name not in leader_of and not _can_lead(lead, columns, pool_of, by_name, rounds):
            continue
        if closes and not _one_call_per_step(lead):
            continue
        if set(f.state_inputs) & writes_state.get(lead.name, set()):
            continue  # it would see the value this step's call just wrote, not the one before it
        if f.mode == "group" and not _whole_groups(lead, group_size):
            continue
        if any(columns[c].level != "sample" for c in f.inputs):
            continue
        if not set(f.state_inputs) <= set(lead.state_inputs) or (f.state_inputs and f.lag != lead.lag):
            continue
        if f.state_inputs and lead.params.get("partial") and not f.params.get("partial"):
            continue  # partial rollout: the leader may switch to newer weights mid-call
        leader_of.setdefault(lead.name, lead.name)
        leader_of[f.name] = lead.name
        chain_reads.setdefault(lead.name, set(lead.inputs)).update(f.inputs)
        out[f.name] = lead.name
        writes_state.setdefault(lead.name, set()).update(c for c in f.outputs if columns[c].kind == "state")
    return out


def _chain_of(f: OpPlan, producers: set[str], by_name: Mapping[str, OpPlan], leader_of: Mapping[str, str],
              chain_reads: Mapping[str, set[str]], columns: Mapping[str, ColumnPlan]) -> str:
    """The chain whose leader's call F can run in: every column F reads, but the source's, is written
    by an op of that chain (one at least) or read by one (so ready when the call starts); "" if none."""
    for lead in dict.fromkeys(leader_of.get(p, p) for p in sorted(producers)):
        reads = chain_reads.get(lead) or set(by_name[lead].inputs)
        written = {p for p in producers if leader_of.get(p, p) == lead and by_name[p].group == f.group}
        if written and all(columns[c].producer in written or c in reads
                           for c in f.inputs if columns[c].producer in producers):
            return lead
    return ""


def _whole_groups(lead: OpPlan, group_size: int) -> bool:
    """Every chunk of `lead` holds whole groups (rows of a group are contiguous, from row 0)."""
    if lead.mode == "group":
        return True
    if lead.mode != "stream" or lead.batching.per_rank:
        return False
    size = lead.batching.micro_batch_size
    return not size or size % max(group_size, 1) == 0


def _may_follow(f: OpPlan, rounds: set[str]) -> bool:
    """F may run inside another op's call at all: it does not drop rows, stream, run one call per
    rank or belong to dynamic sampling's rounds."""
    return not (f.drops or f.streams or f.name in rounds or f.batching.per_rank)


def _updates(f: OpPlan, columns: Mapping[str, ColumnPlan]) -> bool:
    """F is not a forward pass on its rows (a barrier, mini-batches, state written: an update), so it
    may only close a chain whose leader makes one call per step."""
    return (f.mode == "barrier" or f.batching.mini_batch_samples is not None
            or any(columns[c].kind == "state" for c in f.outputs))


def _one_call_per_step(lead: OpPlan) -> bool:
    """`lead` makes one call per step: one per rank, on a group of one rank (so its chain's one chunk
    holds every row of the step, what a barrier follower needs)."""
    return lead.batching.per_rank and lead.batching.dp == 1


def _can_lead(lead: OpPlan, columns: Mapping[str, ColumnPlan], pool_of: Mapping[str, str],
              by_name: Mapping[str, OpPlan], rounds: set[str]) -> bool:
    if lead.mode == "barrier" or lead.drops or lead.name in rounds:
        return False
    if lead.batching.per_rank:
        return True
    readers = {r for c in lead.outputs for r in columns[c].consumers}
    return all(pool_of[by_name[r].group] == pool_of[lead.group] for r in readers if r in by_name)
