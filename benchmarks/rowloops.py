"""Issue 25 item 3: the per-row Python loops of a step, before and after vectorising, at B x n = 1,024.

Each row of the table times one helper on 1,024 rows shaped like the GRPO example's (prompts of
4-8 tokens, responses of 1-16 tokens, a 64-token vocabulary) against the per-row loop it
replaced (kept below as the reference; the tests check both give the same values): rows per
second of each, alternated, median of the repeats. The log-prob helpers still bound their
temporary memory: they take blocks of rows whose `[rows, T, V]` temporary stays under
`rlgraph.ops.algos.core.ROWS_ELEMENTS` elements (one row at a time for long responses with a
large vocabulary, as before).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch

from benchmarks import common

ROWS = 1024
VOCAB = 64


# --------------------------------------------------------------------------- the loops replaced
def split_rows_loop(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    response_lengths: Sequence[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    prompts, responses = [], []
    for i, r in enumerate(response_lengths):
        length = int(attention_mask[i].sum())
        p = length - int(r)
        prompts.append(input_ids[i, :p])
        responses.append(input_ids[i, p:length])
    return prompts, responses


def logprobs_loop(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    rows = []
    for row_logits, row_ids in zip(logits, token_ids):
        chosen = row_logits.gather(-1, row_ids.unsqueeze(-1)).squeeze(-1)
        rows.append(chosen - torch.logsumexp(row_logits, dim=-1))
    return torch.stack(rows)


def entropy_loop(logits: torch.Tensor) -> torch.Tensor:
    rows = []
    for row in logits:
        p = torch.softmax(row, dim=-1)
        rows.append(torch.logsumexp(row, dim=-1) - (p * row).sum(dim=-1))
    return torch.stack(rows)


def response_columns_loop(prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor],
                          is_padding: Sequence[bool], log_probs: Sequence[torch.Tensor] | None) -> dict[str, list]:
    out: dict[str, list] = {k: [] for k in ("prompts", "responses", "response_mask", "input_ids", "attention_mask",
                                            "position_ids", "rollout_log_probs")}
    for i, (p, r) in enumerate(zip(prompts, responses)):
        seq = torch.cat([p, r]).long()
        out["prompts"].append(p.long())
        out["responses"].append(r.long())
        out["response_mask"].append(torch.full((len(r),), 0 if is_padding[i] else 1, dtype=torch.long))
        out["input_ids"].append(seq)
        out["attention_mask"].append(torch.ones(len(seq), dtype=torch.long))
        out["position_ids"].append(torch.arange(len(seq), dtype=torch.long))
        out["rollout_log_probs"].append(log_probs[i].float() if log_probs is not None else torch.zeros(len(r)))
    return out


def left_pad_loop(prompts: Sequence[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for j, p in enumerate(prompts):
        ids[j, width - len(p):] = p
        mask[j, width - len(p):] = 1
    return ids, mask


def cut_loop(tokens: torch.Tensor, stop: set[int]) -> list[torch.Tensor]:
    out = []
    for row in tokens:
        length = len(row)
        for k, t in enumerate(row.tolist()):
            if t in stop:
                length = k + 1
                break
        out.append(row[:length].clone())
    return out


def convert_loop(values: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.as_tensor(v).to(dtype) for v in values]


# --------------------------------------------------------------------------- inputs
def rows(n: int = ROWS, seed: int = 0) -> dict[str, Any]:
    """`n` prompt/response rows as the data plane hands them to an op (right-padded)."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(4, 9, (n,), generator=g).tolist()
    rlen = torch.randint(1, 17, (n,), generator=g).tolist()
    prompts = [torch.randint(3, VOCAB, (p,), generator=g) for p in plen]
    responses = [torch.randint(3, VOCAB, (r,), generator=g) for r in rlen]
    width = max(a + b for a, b in zip(plen, rlen))
    input_ids = torch.zeros(n, width, dtype=torch.long)
    attention_mask = torch.zeros(n, width, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, :len(p) + len(r)] = torch.cat([p, r])
        attention_mask[i, :len(p) + len(r)] = 1
    R = max(rlen)
    logits = torch.randn(n, R, VOCAB, generator=g)
    ids = torch.randint(0, VOCAB, (n, R), generator=g)
    return {"prompts": prompts, "responses": responses, "input_ids": input_ids, "attention_mask": attention_mask,
            "rlen": rlen, "logits": logits, "ids": ids, "padding": [i % 50 == 0 for i in range(n)],
            "log_probs": [torch.randn(r, generator=g) for r in rlen],
            "generated": torch.randint(0, VOCAB, (n, 16), generator=g)}  # what generate returns, before the cut


STOP = {1, 2}  # the stop tokens of the cut: EOS and one more, about 1 in 32 of the 64-token vocabulary


def _convert_args(values: list[torch.Tensor]) -> tuple:
    """`invoke._convert`'s arguments for the generate op's ``responses`` output of `values`."""
    import rlgraph
    from rlgraph.graph.loader import load_pipeline

    plan = rlgraph.compile(load_pipeline(str(common.ROOT / "examples" / "grpo.py"))[0], [])
    return plan, plan.op("generate"), "responses", values, len(values), {"response_len": [len(v) for v in values]}


def _rate(fn: Callable[[], Any], n: int, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return n / statistics.median(times)


def run(quick: bool = False, argv: list[str] | None = None, **_: Any) -> common.Section:
    from rlgraph.ops.algos.core import entropy_from_logits, logprobs_from_logits
    from rlgraph.ops.rollout.parts import cut_lengths, response_columns
    from rlgraph.ops.train.sequences import pack, repack
    from rlgraph.rows import left_pad
    from rlgraph.runtime.invoke import _convert

    n, repeats = (128, 3) if quick else (ROWS, 9)
    d = rows(n)
    convert_args = _convert_args(d["responses"])
    cases = [
        ("split + pack a forward's rows (sequences.repack)",
         lambda: pack(*split_rows_loop(d["input_ids"], d["attention_mask"], d["rlen"]), 0),
         lambda: repack(d["input_ids"], d["attention_mask"], d["rlen"], 0)),
        ("log-probs from logits (core.logprobs_from_logits)",
         lambda: logprobs_loop(d["logits"], d["ids"]), lambda: logprobs_from_logits(d["logits"], d["ids"])),
        ("entropy from logits (core.entropy_from_logits)",
         lambda: entropy_loop(d["logits"]), lambda: entropy_from_logits(d["logits"])),
        ("generate's response columns (parts.response_columns)",
         lambda: response_columns_loop(d["prompts"], d["responses"], d["padding"], d["log_probs"]),
         lambda: response_columns(d["prompts"], d["responses"], d["padding"], d["log_probs"])),
        ("generate's left-padded prompt batch (parts.left_pad)",
         lambda: left_pad_loop(d["prompts"], 0), lambda: left_pad(d["prompts"], 0)),
        ("responses cut at the first stop token (parts.cut_lengths)",
         lambda: cut_loop(d["generated"], STOP),
         lambda: [row[:k] for row, k in zip(d["generated"], cut_lengths(d["generated"], STOP))]),
        ("an op's per-row output list checked and typed (invoke._convert)",
         lambda: convert_loop(d["responses"], torch.long),
         lambda: _convert(*convert_args)),
    ]
    t = common.Table(["helper", "rows", "per-row loop rows/s", "vectorised rows/s", "speed-up"])
    for name, before, after in cases:
        slow, fast = [], []
        for _ in range(2):  # alternated: the machine's noise falls on both
            slow.append(_rate(before, n, repeats))
            fast.append(_rate(after, n, repeats))
        s, f = statistics.median(slow), statistics.median(fast)
        t.add(name, n, s, f, f / s)
        print(f"  {name}: {s:,.0f} -> {f:,.0f} rows/s", flush=True)
    t.print()
    return common.Section("rowloops", "13. Per-row loops, vectorised", __doc__.split("\n\n", 1)[1], [t], "",
                          common.command_line(argv if argv is not None else ["rowloops"] + (["--quick"] if quick else [])))
