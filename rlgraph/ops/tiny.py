"""Tiny policies for the bundled examples and tests: build, warm start, cache.

`prepare_tiny_policy` is what the examples' ``prepare`` hook calls before a run: when
``actor.model_path`` holds no model yet, it builds a tiny Qwen2-style model with the character
tokenizer and gives it a short, open supervised warm start on the example's task, so that RL
starts from a model that is sometimes right. It runs once per path (a file lock keeps parallel
runs from racing) and never downloads anything.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Callable

from filelock import FileLock

from rlgraph.ops.models import build_tiny_model, sft_warmstart
from rlgraph.ops.tasks import make_rows, sft_examples

__all__ = ["build_once", "prepare_tiny_policy"]


def build_once(path: str | Path, build: Callable[[Path], None]) -> Path:
    """Make `path` (``~`` expanded) by calling ``build(tmp)`` once: a no-op when `path` already holds a
    model (``config.json``); a file lock keeps parallel runs from racing; `build` writes into
    ``<path>.partial``, renamed to `path` only when complete."""
    out = Path(path).expanduser()
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if (out / "config.json").is_file():  # another run made it while we waited
            return out
        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        build(tmp)
        tmp.rename(out)
    return out


def prepare_tiny_policy(model_path: str, task: str, sft_steps: int, seed: int = 0, sft_rows: int = 2048,
                        lr: float = 3e-3, hidden_size: int = 64, num_layers: int = 2) -> Path:
    """Make `model_path` a tiny policy warmed up on `task` (no-op if a model is already there)."""

    def build(tmp: Path) -> None:
        start = time.time()
        build_tiny_model(tmp, hidden_size=hidden_size, num_layers=num_layers, seed=seed)
        if sft_steps > 0:
            m = sft_warmstart(tmp, sft_examples(make_rows(task, sft_rows, seed=seed, split="train")),
                              steps=sft_steps, lr=lr, seed=seed)
            print(f"rlgraph: tiny policy for task {task!r}: {sft_steps} warm-start steps, answer loss "
                  f"{m.loss_first:.2f} -> {m.loss_last:.2f}, {time.time() - start:.0f}s -> {model_path}", flush=True)

    return build_once(model_path, build)
