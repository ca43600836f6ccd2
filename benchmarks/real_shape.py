"""Item 16: GRPO end to end on a model of Qwen2.5-0.5B's shape, the training-engine options off and on.

`examples/grpo_real_shape.py` (a random-initialised model of Qwen2.5-0.5B's architecture and
151,936-token vocabulary, saved by its prepare hook; no download) runs a few steps under the sync
schedule, so each stage's time is its own:

- plain: `actor.backend=torch`, dp=1, full fine-tuning, padded micro-batches, a reference model;
- FSDP2 + packing + LoRA: dp=2 with `actor.backend=fsdp2`, `actor.packing=true`,
  `actor.max_tokens_per_micro_batch=2048`, `actor.lora_rank=16` (the reference is the same model
  with the adapters off).

The step breakdown comes from the metrics (`timing/<op>/span_s`, `/io_s`, `timing/state_sync_s`);
the peak memory of every worker process is its peak resident memory (VmHWM) when the run ends.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common

CONFIGS = {
    "plain (torch, dp=1, full FT, padded)": [],
    "LoRA r=16 (torch, dp=1)": ["actor.lora_rank=16", "actor.lora_alpha=32", "actor.lr=1e-5"],
    "FSDP2 dp=2 + packing + LoRA r=16": ["groups.actor.dp=2", "actor.backend=fsdp2", "actor.packing=true",
                                         "actor.max_tokens_per_micro_batch=2048", "actor.lora_rank=16",
                                         "actor.lora_alpha=32", "actor.lr=1e-5"],
}


def run_config(extra: list[str], steps: int, plane: Any, quick: bool) -> dict[str, Any]:
    import ray

    from rlgraph.graph.compile import compile_pipeline
    from rlgraph.graph.loader import load_pipeline
    from rlgraph.runtime.runner import Runner, prepare

    pipeline, ref = load_pipeline(str(common.ROOT / "examples" / "grpo_real_shape.py"))
    overrides = ["trainer.seed=0", "trainer.schedule=sync", *extra]
    if quick:  # a cut-down model of the same width and vocabulary, a short answer
        from rlgraph.ops.models import build_once, build_shaped_model

        path = build_once("~/.cache/rlgraph/models/qwen2.5-0.5b-shape-random-2layers",
                          lambda tmp: build_shaped_model(tmp, num_layers=2))
        overrides += [f"actor.model_path={path}", "rollout.max_new_tokens=4"]
    plan = compile_pipeline(pipeline, overrides, ref)
    prepare(plan)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        with Runner(plan, common.quiet_runner_options(Path(tmp), steps=steps, schedule="sync"), plane) as r:
            start_s = time.time() - t0
            records = r.run()
            fleet = r.fleet
            named = [(f"{g}_{k}", w) for g, ws in fleet.workers.items() for k, w in enumerate(ws)]
            pids = ray.get([w.__ray_call__.remote(lambda self: os.getpid()) for _, w in named])
            peaks = {name: common.peak_rss(pid) for (name, _), pid in zip(named, pids)}
    return {"records": records, "start_s": start_s, "peaks": peaks}


def breakdown(records: list[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds per step of each part (steps after the first, which pays for lazy starts)."""
    rs = records[1:] or records

    def mean(f):
        return statistics.mean(f(r) for r in rs)

    def op(r, name, key="span_s"):
        return r.get(f"timing/{name}/{key}", 0.0)

    out = {"generate": mean(lambda r: op(r, "generate")),
           "log-probs (old, ref)": mean(lambda r: op(r, "old_logprob") + op(r, "ref")),
           "update": mean(lambda r: op(r, "update_actor")),
           "data moves": mean(lambda r: sum(v for k, v in r.items() if k.endswith("/io_s"))),
           "weight sync": mean(lambda r: r.get("timing/state_sync_s", 0.0)),
           "step": mean(lambda r: r["timing/step_s"])}
    return out


def run(quick: bool = False, steps: int | None = None, argv: list[str] | None = None, **_: Any) -> common.Section:
    steps = steps or (1 if quick else 3)
    plane = common.plane("transferqueue")
    parts = ["generate", "log-probs (old, ref)", "update", "data moves", "weight sync", "step"]
    t = common.Table(["config", *[f"{p} s" for p in parts], "tokens computed / padded", "peak MiB per worker"])
    for name, extra in CONFIGS.items():
        res = run_config(extra, steps, plane, quick)
        b = breakdown(res["records"])
        last = res["records"][-1]
        fwd, padded = last.get("update_actor/actor_metrics/forward_tokens"), last.get(
            "update_actor/actor_metrics/padded_tokens")
        ratio = f"{fwd / padded:.2f}" if fwd and padded else "-"
        peaks = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in sorted(res["peaks"].items()))
        t.add(name, *[b[p] for p in parts], ratio, peaks)
        print(f"  {name}: step {b['step']:.1f}s, peaks {peaks}", flush=True)
    from rlgraph.ops.models import REAL_SHAPES

    dims = REAL_SHAPES["qwen2.5-0.5b"]
    intro = (f"`examples/grpo_real_shape.py`: GRPO through the whole pipeline on a random-initialised model of "
             f"Qwen2.5-0.5B's shape ({dims['num_hidden_layers']} layers, hidden {dims['hidden_size']}, vocabulary "
             f"{dims['vocab_size']:,}; float32 in the workers), 2 prompts x n=4 per step, 16 new tokens, gradient "
             f"checkpointing, sync schedule, {steps} steps (the first left out of the means). Seconds per step of "
             f"each part: the op's span (generate; old_logprob + ref; update_actor), the calls' time reading and "
             f"writing the data plane, the state sync between steps; then the update's tokens computed over "
             f"the padded batch's, and each worker process's peak resident memory.")
    notes = ("On one CPU the sharded run does the same work on two processes of one machine, so its time is not a "
             "speed-up; what it shows is the memory per process (the optimizer state and gradients of the LoRA "
             "adapters only, the base weights sharded) and that the whole graph runs unchanged with every option "
             "on. The reference pass of the LoRA run reuses the policy's weights (adapters off) instead of a "
             "second model.")
    return common.Section("real_shape", "16. A 0.5B-shape model end to end", intro, [t], notes,
                          command=common.command_line(argv))


if __name__ == "__main__":
    import sys

    print(run(quick="--quick" in sys.argv, argv=["real_shape"] + sys.argv[1:]).markdown())
