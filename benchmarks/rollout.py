"""Item 7: generation on CPU, transformers against vLLM, side by side on the same prompts and weights.

One generate call per step, as a rollout rank makes it (`Invoker.stream`, the calling convention,
without Ray): all of the step's prompts, `n` samples each. Per configuration both backends run
the same seeded steps after a warm-up call; the table gives the mean seconds per step, the time
until the first group is handed on (what lets rewards start while the rest decodes) and the
ratio. The task model is the GRPO example's warm-started tiny policy (its answers end after 2-3
tokens); the untrained tiny model rarely emits EOS, so its responses run to `max_new_tokens`
and measure decoding itself. Needs vLLM (`bash scripts/setup.sh --vllm=cpu`).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import common


@dataclass(frozen=True)
class Config:
    label: str
    model: str  # "task" (warm-started) or "random"
    prompts: int
    n: int
    max_new_tokens: int


def configs(quick: bool) -> list[Config]:
    if quick:
        return [Config("random model, 4 prompts x 2, 8 tokens", "random", 4, 2, 8)]
    return [
        Config("GRPO example step: task model, 16 prompts x 8, 4 tokens", "task", 16, 8, 4),
        Config("random model, 16 prompts x 8, 32 tokens", "random", 16, 8, 32),
        Config("random model, 32 prompts x 8, 128 tokens", "random", 32, 8, 128),
    ]


def _models(root: Path) -> dict[str, str]:
    from rlgraph.ops.models import build_tiny_model
    from rlgraph.ops.tiny import prepare_tiny_policy

    return {"task": str(prepare_tiny_policy(str(root / "task"), "add", sft_steps=100)),
            "random": str(build_tiny_model(root / "random", seed=0))}


def _plan(model: str, backend: str, cfg: Config) -> Any:
    import rlgraph
    from rlgraph.graph.loader import load_pipeline

    pipeline, ref = load_pipeline(str(common.ROOT / "examples" / "grpo.py"))
    return rlgraph.compile(pipeline, [f"actor.model_path={model}", f"rollout.backend={backend}",
                                      f"data.batch_size={cfg.prompts}", f"rollout.n={cfg.n}",
                                      f"rollout.max_new_tokens={cfg.max_new_tokens}", "actor.mini_batch_size=1",
                                      f"rollout.micro_batch_size={cfg.prompts}"], pipeline_ref=ref)


def _rows(model: str, cfg: Config) -> tuple[list[Any], list[bool]]:
    import torch

    from rlgraph.ops.models import encode_prompt, load_tokenizer
    from rlgraph.ops.data.tasks import make_rows

    tok = load_tokenizer(model)
    heads = [torch.tensor(encode_prompt(tok, r["prompt"])) for r in make_rows("add", cfg.prompts, seed=5)]
    return [h for h in heads for _ in range(cfg.n)], [False] * (cfg.prompts * cfg.n)


def time_backend(model: str, backend: str, cfg: Config, steps: int) -> dict[str, float]:
    from rlgraph.runtime.invoke import Invoker

    plan = _plan(model, backend, cfg)
    inv = Invoker(plan, "actor", 0, 1)
    op = plan.op("generate")
    rows, pad = _rows(model, cfg)
    try:
        list(inv.stream(op, 0, 0, list(range(len(rows))), pad, {"prompt_ids": rows}))  # warm-up (engine start)
        totals, firsts, tokens = [], [], []
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            first = None
            n_tokens = 0
            for positions, cols in inv.stream(op, step, 0, list(range(len(rows))), pad, {"prompt_ids": rows}):
                first = first if first is not None else time.perf_counter() - t0
                n_tokens += sum(len(r) for r in cols["responses"])
            totals.append(time.perf_counter() - t0)
            firsts.append(first)
            tokens.append(n_tokens)
    finally:
        for inst in inv.instances.values():
            getattr(inst, "close", lambda: None)()
    return {"step_s": statistics.mean(totals), "first_s": statistics.mean(firsts),
            "tokens": statistics.mean(tokens)}


def run(quick: bool = False, argv: list[str] | None = None, **_: Any) -> common.Section:
    from rlgraph.ops.rollout.vllm_engine import vllm_available

    if not vllm_available():
        raise SystemExit("the rollout benchmark needs vLLM: bash scripts/setup.sh --vllm=cpu")
    steps = 2 if quick else 5
    t = common.Table(["config", "tokens / step", "hf s / step", "vllm s / step", "hf / vllm",
                      "hf first part s", "vllm first part s"])
    with tempfile.TemporaryDirectory() as tmp:
        models = _models(Path(tmp))
        for cfg in configs(quick):
            hf = time_backend(models[cfg.model], "hf", cfg, steps)
            vl = time_backend(models[cfg.model], "vllm", cfg, steps)
            t.add(cfg.label, vl["tokens"], hf["step_s"], vl["step_s"], hf["step_s"] / vl["step_s"], hf["first_s"],
                  vl["first_s"])
            print(f"  {cfg.label}: hf {hf['step_s']:.3f}s vllm {vl['step_s']:.3f}s", flush=True)
    t.print()
    intro = f"""
Generation time per step on this machine's CPU, transformers (`rollout.backend=hf`) against vLLM's
CPU build (`vllm`), on the same prompts and weights, {steps} seeded steps each after a warm-up call
(vLLM's engine start, 15-30 s, is paid once per run and is not in the table). A step is one
generate call holding all the step's prompts; "first part" is when its first finished group (vLLM)
or micro-batch (HF, here one micro-batch of all prompts) was handed on. The task model is the
GRPO example's warm-started tiny policy; the random one runs every response to its token limit.
"""
    return common.Section("rollout", "7. Generation: transformers vs vLLM on CPU", intro, [t], "",
                          common.command_line(argv if argv is not None else ["rollout"] + (["--quick"] if quick else [])))
