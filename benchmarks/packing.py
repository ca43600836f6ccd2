"""Item 15: padding-free packing and token-budget micro-batches on skewed response lengths.

One `update_actor` call (forward, backward, optimizer step, with a KL loss and the entropy bonus) on
16 samples whose responses are 8..1,024 tokens (log-uniform, so most are short and a few long,
as RL rollouts are) after 32-token prompts, through the policy worker exactly as the runtime
calls it, in two set-ups:

- padded: micro-batches of 4 samples in verl's layout (prompts left-padded, responses right-padded
  to the longest of the batch);
- packed: ``actor.packing=true`` with ``actor.max_tokens_per_micro_batch=4096``: each micro-batch's
  samples end to end in one row, no padding token computed.

Each runs in a fresh process (peak = its peak resident memory during the call minus its size
before). The two give the same loss and gradients (tests/ops/train/test_actor_options.py checks
them to 1e-5); here the loss is printed for both.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from typing import Any

from benchmarks import common

ROWS, PROMPT, SHORTEST, LONGEST = 16, 32, 8, 1024
MODEL = dict(vocab_size=32000, hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=6,
             num_key_value_heads=2)


def lengths(rows: int, longest: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [int(round(math.exp(rng.uniform(math.log(SHORTEST), math.log(longest))))) for _ in range(rows)]


def child(mode: str, longest: int, model: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlgraph.graph.plan import OpBatching
    from rlgraph.ops.models import char_tokenizer
    from rlgraph.ops.train.actor import ActorWorker
    from rlgraph.runtime.invoke import OpContext

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        Qwen2ForCausalLM(Qwen2Config(**model, pad_token_id=0)).save_pretrained(tmp)
        char_tokenizer().save_pretrained(tmp)
        resp = lengths(ROWS, longest)
        packing = mode == "packed"
        config = {"actor": {"model_path": tmp, "packing": packing}, "rollout": {"temperature": 1.0},
                  "trainer": {"seed": 0}}
        batching = OpBatching(dp=1, samples_per_rank=ROWS, rank_mini_batch=[ROWS, ROWS], micro_batch_size=4,
                              epochs=1, updates_per_step=1)
        ctx = OpContext(op="update_actor", group="actor", rank=0, dp=1, step=0, chunk=0, seed=1,
                        rows=tuple(range(ROWS)), is_padding=(False,) * ROWS, config=config, batching=batching,
                        lengths={"response_len": tuple(resp)},
                        group_impls=("rlgraph.ops.train.actor:ActorWorker.update_actor",))
        worker = ActorWorker()
        worker.setup(ctx)
    g = torch.Generator().manual_seed(2)
    width, R = PROMPT + max(resp), max(resp)
    ids = torch.zeros(ROWS, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    response_mask = torch.zeros(ROWS, R, dtype=torch.long)
    for i, r in enumerate(resp):
        ids[i, :PROMPT + r] = torch.randint(8, model["vocab_size"], (PROMPT + r,), generator=g)
        mask[i, :PROMPT + r] = 1
        response_mask[i, :r] = 1
    advantages = torch.randn(ROWS, R, generator=g) * response_mask
    update = dict(lr=1e-5, weight_decay=0.0, grad_clip=1.0, lr_warmup_steps=0, backend="torch", zero_stage=0,
                  loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                  loss_mode="vanilla", entropy_coeff=0.001, use_kl_loss=True, kl_loss_coef=0.001,
                  kl_loss_type="low_var_kl", tis_cap=0.0, decoupled_cap=0.0)
    before = common.reset_peak_rss()
    t0 = time.time()
    out = worker.update_actor(ids, mask, mask.cumsum(1) - 1, ids[:, :R], response_mask, advantages,
                              ref_log_prob=torch.zeros(ROWS, R), ctx=ctx,
                              max_tokens_per_micro_batch=4096 if packing else 0, **update)
    seconds = time.time() - t0
    m = out["actor_metrics"]
    return {"mode": mode, "seconds": seconds, "peak_bytes": common.peak_rss() - before, "loss": m["loss"],
            "tokens": m["forward_tokens"] if packing else m["padded_tokens"], "real": int(mask.sum()),
            "micro_batches": m["micro_batches"]}


def run(quick: bool = False, argv: list[str] | None = None, **_: Any) -> common.Section:
    longest = 64 if quick else LONGEST
    model = {**MODEL, "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
             "vocab_size": 512} if quick else MODEL
    spec = json.dumps(model)
    res = {mode: common.run_child("benchmarks.packing", [mode, str(longest), spec]) for mode in ("padded", "packed")}
    pad, pk = res["padded"], res["packed"]
    t = common.Table(["layout", "micro-batches", "tokens computed", "real tokens", "step s", "peak MiB", "loss"])
    for r in (pad, pk):
        t.add(r["mode"], r["micro_batches"], r["tokens"], r["real"], r["seconds"], r["peak_bytes"] / 2**20, r["loss"])
    resp = lengths(ROWS, longest)
    intro = (f"One `update_actor` call on {ROWS} samples of a {PROMPT}-token prompt and responses of {min(resp)}.."
             f"{max(resp)} tokens (log-uniform between {SHORTEST} and {longest}; mean {sum(resp) / len(resp):.0f}) on a "
             f"random-initialised Qwen2-style model ({model['num_hidden_layers']} layers, hidden {model['hidden_size']}, "
             f"vocabulary {model['vocab_size']:,}). *padded*: micro-batches of 4 samples in verl's padded layout; "
             f"*packed*: `actor.packing=true`, `actor.max_tokens_per_micro_batch=4096`. Each in a fresh process.")
    notes = (f"Packed computes {pk['tokens'] / max(pad['tokens'], 1):.2f}x the tokens of padded "
             f"({pad['tokens'] / max(pk['tokens'], 1):.1f}x fewer), is {pad['seconds'] / max(pk['seconds'], 1e-9):.2f}x "
             f"as fast and peaks at {pk['peak_bytes'] / max(pad['peak_bytes'], 1):.2f}x the memory, with the same loss "
             f"({pad['loss']:.6g} vs {pk['loss']:.6g}).")
    return common.Section("packing", "15. Padding-free packing on skewed lengths", intro, [t], notes,
                          command=common.command_line(argv))


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]))))
        return
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    print(run(quick=args.quick, argv=["packing"] + (["--quick"] if args.quick else [])).markdown())


if __name__ == "__main__":
    main()
