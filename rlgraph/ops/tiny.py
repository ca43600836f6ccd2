"""Tiny policies for the bundled examples and tests: build, warm start, cache, evaluate.

`prepare_tiny_policy` is what the examples' ``prepare`` hook calls before a run: when
``actor.model_path`` holds no model yet, it builds a tiny Qwen2-style model with the character
tokenizer and gives it a short, open supervised warm start on the example's task, so that RL
starts from a model that is sometimes right. It runs once per path (a file lock keeps parallel
runs from racing) and never downloads anything.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from rlgraph.ops.data.tasks import make_rows, sft_examples
from rlgraph.ops.assets import build_once

__all__ = ["prepare_tiny_policy", "evaluate"]


def prepare_tiny_policy(model_path: str, task: str, sft_steps: int, seed: int = 0, sft_rows: int = 2048,
                        lr: float = 3e-3, hidden_size: int = 64, num_layers: int = 2) -> Path:
    """Make `model_path` a tiny policy warmed up on `task` (no-op if a model is already there)."""

    def build(tmp: Path) -> None:
        from rlgraph.ops.models import build_tiny_model, sft_warmstart  # torch: only when the model is made

        start = time.time()
        build_tiny_model(tmp, hidden_size=hidden_size, num_layers=num_layers, seed=seed)
        if sft_steps > 0:
            m = sft_warmstart(tmp, sft_examples(make_rows(task, sft_rows, seed=seed, split="train")),
                              steps=sft_steps, lr=lr, seed=seed)
            print(f"rlgraph: tiny policy for task {task!r}: {sft_steps} warm-start steps, answer loss "
                  f"{m.loss_first:.2f} -> {m.loss_last:.2f}, {time.time() - start:.0f}s -> {model_path}", flush=True)

    return build_once(model_path, build)


def evaluate(model: Any, tokenizer: Any, rows: Sequence[Mapping[str, Any]], temperature: float = 0.0,
             max_new_tokens: int = 4, seed: int = 0, batch_size: int = 64) -> float:
    """Mean score of `model` on `rows` with HF ``generate``: greedy when `temperature` is 0,
    else sampling at that temperature (seeded). Scored by `rlgraph.ops.reward.functions.compute_score`."""
    import torch

    from rlgraph.ops.models import encode_prompt
    from rlgraph.ops.reward.functions import compute_score

    pad = tokenizer.pad_token_id
    total = 0.0
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            prompts = [encode_prompt(tokenizer, r["prompt"]) for r in chunk]
            width = max(map(len, prompts))
            input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left-padded
            attention_mask = (input_ids != pad).long()
            sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 \
                else dict(do_sample=False)
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                                 pad_token_id=pad, eos_token_id=tokenizer.eos_token_id, **sampling)
            for r, ids in zip(chunk, out[:, width:]):
                text = tokenizer.decode(ids, skip_special_tokens=True)
                s = compute_score(r["data_source"], text, r["reward_model"]["ground_truth"], r.get("extra_info"))
                total += float(s["score"] if isinstance(s, dict) else s)
    return total / max(1, len(rows))
