"""Item 5: padding rows and wasted tokens per step, minimal padding rows vs copying real samples.

Compiles `examples/ppo.py` (actor and critic mini-batches, so both terms count) over dp,
mini-batch and `n` combinations, and reads the plan's padding: `m = lcm(dp..., mini*n...)`,
the padded batch and the padding rows. A padding row of ours is one prompt token and one response
token (`response_mask = 0`), so it wastes 2 tokens of compute; a peer that fills the batch with
copies of real samples wastes a real sample's tokens per row (and pollutes group statistics).
"""

from __future__ import annotations

import math
from typing import Any

from benchmarks import common

PROMPT_TOKENS = 128
RESPONSE_MEDIAN, RESPONSE_SIGMA = 256, 0.75
REAL_TOKENS = PROMPT_TOKENS + RESPONSE_MEDIAN * math.exp(RESPONSE_SIGMA ** 2 / 2)  # mean of a log-normal
OUR_TOKENS = 2


def run(quick: bool = False, argv: list[str] | None = None, **_: Any) -> common.Section:
    from rlgraph.graph.compile import compile_pipeline
    from rlgraph.graph.loader import load_pipeline

    ppo, ref = load_pipeline(str(common.ROOT / "examples" / "ppo.py"))
    batch = 45
    dps = [1, 2, 3] if quick else [1, 2, 3, 4, 8]
    minis = [4, 5] if quick else [4, 5, 8]
    ns = [4] if quick else [4, 8]
    t = common.Table(["dp", "mini-batch (prompts)", "n", "samples", "multiple m", "padded", "padding rows",
                      "padding %", "wasted tokens (ours)", "wasted tokens (copies)", "copies / ours"])
    total_ours = total_copies = 0.0
    rows = 0
    for n in ns:
        for mini in minis:
            for dp in dps:
                plan = compile_pipeline(ppo, [f"data.batch_size={batch}", f"rollout.n={n}", f"groups.actor.dp={dp}",
                                              f"actor.mini_batch_size={mini}", f"critic.mini_batch_size={mini}",
                                              "cluster.cpus_per_node=64"], ref)
                b = plan.batch
                ours, copies = b.pad_rows * OUR_TOKENS, b.pad_rows * REAL_TOKENS
                total_ours += ours
                total_copies += copies
                rows += 1
                t.add(dp, mini, n, b.global_batch, b.multiple, b.padded_batch, b.pad_rows,
                      f"{100 * b.pad_rows / b.padded_batch:.1f}%", ours, round(copies),
                      float("nan") if not ours else copies / ours)
    t.print()
    intro = f"""
`examples/ppo.py` compiled with {batch} prompts per step and the actor's and critic's
mini-batches equal, over dp of the actor group, mini-batch size and `n`: the padding the compiler
chooses (the plan's `batch`), and the tokens the padding rows cost per step. Ours: {OUR_TOKENS}
tokens per padding row (one prompt token, one response token with `response_mask = 0`: no loss, no
gradient, no change to group statistics). Copies: filling the same rows with copies of real
samples costs a real sample's tokens each: {PROMPT_TOKENS} prompt tokens + a log-normal response
(median {RESPONSE_MEDIAN}, sigma {RESPONSE_SIGMA}: mean {REAL_TOKENS - PROMPT_TOKENS:.0f}), {REAL_TOKENS:.0f}
tokens per row, and biases the statistics of the copied groups.
"""
    notes = (f"Over the {rows} combinations: {total_ours:,.0f} wasted tokens with minimal padding rows vs "
             f"{total_copies:,.0f} with copies ({total_copies / max(total_ours, 1):.0f}x). Mini-batch sizes "
             f"that divide one another keep `m`, and so the padding, small.")
    return common.Section("padding", "5. Padding", intro, [t], notes,
                          common.command_line(argv if argv is not None else ["padding"] + (["--quick"] if quick else [])))
