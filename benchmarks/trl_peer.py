"""rlgraph against TRL's GRPOTrainer, side by side on the GRPO example's task.

Both train the same warm-started tiny policy (examples/grpo.py's, built once by its `prepare`)
on the same generated addition prompts with the same reward function, and each measured run is a
process of its own (`rlgraph run ...`; `python -m benchmarks.trl_grpo ...`), so start-up counts
the same way. Runs alternate between the two (rlgraph, TRL, rlgraph, TRL, ...), so the machine's
noise falls on both alike; the table gives the median over runs of each run's seconds per step (the
median time between consecutive steps' ends, the first steps left out: with steps in flight this is
what a user waits per step, shorter than a step's own span), start-up (process start to the first
step's start), total wall time, and the reward gain (mean of the last 5 steps minus the first 5)
per minute of training (first step's start to last step's end).

Settings matched: prompts per step (and the mini-batch: the whole batch, one optimizer step per
training step), samples per prompt (8), response length (4 tokens),
temperature 1, learning rate 3e-4 constant, AdamW without weight decay, gradient clip 1, PPO
clip 0.2, the k3 KL loss with coefficient 0.001, token-mean
loss over the batch, GRPO's group normalisation, the seed; old log-probs from the update's own
forward in both (TRL: `num_iterations=1`; rlgraph's compiler leaves the old_logprob pass out
when the update makes one optimizer step per step). Not matched exactly (what each does):
- the prompts' order: each shuffles the same 1,024 generated rows with its own sampler;
- threads: TRL runs in one process with torch's default threads (2 here); rlgraph's actor has
  the torch threads of its worker group's CPUs, 2 in the example (every op is on the policy's
  group, which holds both cores);
- malloc: rlgraph's worker keeps the memory its tensors free for its next pass
  (``trainer.malloc_keep_mb``, `rlgraph.runtime.malloc`); TRL runs with glibc's defaults, as a
  user's script does (``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` would set the same);
- processes: rlgraph runs the actor (which runs the reward, the reference pass and the advantage
  inside generation's call) and TransferQueue's controller (which hosts the storage unit and the
  data source) as processes of their own, and the asynchronous example a rollout worker too; TRL
  is one process.

"rlgraph, reward pool" is examples/grpo_reward_pool.py: the same pipeline with the reward and the
advantage on a worker group of their own (one CPU, and one for the actor), the layout for a slow
reward or a cluster. "rlgraph, unfused" is the synchronous example with ``trainer.fuse_ops=false``:
the reward, the reference pass and the advantage dispatched as calls of their own instead of
riding in generation's call (issue 25, item 2: the hand-offs that fusing removes). "vs TRL" is
against TRL with its default threads, the threads rlgraph's actor computes with.

The second table splits each step into its phases, in the same runs (issue 25, item 7): for
rlgraph, each op's busy time per step from its metrics (and the part of it spent reading and
writing the data plane); for TRL, the time its step spends in the same work, timed around the
trainer's own methods (`benchmarks.trl_grpo`): the same passes in one process with the same
threads.

    .venv/bin/python -m benchmarks.run trl_peer     # needs pip install 'rlgraph[bench]'
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from rlgraph.runtime.metrics import read_metrics

N = 8
POOL = "rlgraph, reward pool"  # examples/grpo_reward_pool.py: the reward and the advantage on a group of their own
UNFUSED = "rlgraph, unfused"  # trainer.fuse_ops=false: every op dispatched on its own
SETTINGS = [(16, 45, 5), (32, 35, 5), (64, 25, 5)]  # (prompts per step, steps, first steps left out of s/step)
# the phases compared (item 7): rlgraph's op -> the same work in TRL's step (benchmarks.trl_grpo's phase_s)
PHASES = {"generate": "generate", "ref": "ref", "reward": "reward", "update_actor": "update"}
# the decode of the responses to text is in TRL's _generate and in rlgraph's reward op: these rows compare
# the same work on both sides (TRL's generate less its decode; TRL's reward plus its decode)
NO_DECODE, WITH_DECODE = "generate, TRL's decode left out", "reward, TRL's decode added"
ROWS = ["generate", NO_DECODE, "ref", "reward", WITH_DECODE, "update_actor"]
QUICK = [(4, 3, 0)]


def _model() -> str:
    """The example's warm-started policy, built once (what `rlgraph run examples/grpo.py` does first)."""
    from rlgraph.graph.loader import load_pipeline
    from rlgraph.ops.tiny import prepare_tiny_policy

    pipe, _ = load_pipeline(str(common.ROOT / "examples" / "grpo.py"))
    model = str(Path(pipe.config["actor"]["model_path"]).expanduser())
    prepare_tiny_policy(model, "add", 100, seed=0)
    return model


def _rlgraph(example: str, batch: int, steps: int, out: Path, seed: int, *overrides: str) -> dict[str, Any]:
    cmd = [str(common.ROOT / ".venv" / "bin" / "rlgraph"), "run", str(common.ROOT / "examples" / example), "-o",
           str(out), "--overwrite", "--steps", str(steps), f"data.batch_size={batch}", f"actor.mini_batch_size={batch}", f"trainer.seed={seed}",
           "trainer.logger=[jsonl]", *overrides]
    t0 = time.time()
    log_file = out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("w") as log:
        proc = subprocess.run(cmd, cwd=common.ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    metrics = out / "metrics.jsonl"
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"rlgraph run failed:\n{log_file.read_text()[-3000:]}")
    records = read_metrics(metrics)
    # each step's end by the driver's clock: polling the file (every 20 ms) would round each gap between
    # ends to a multiple of the poll, and the median of such gaps jumps by whole polls (82 or 102 ms)
    ends = [r["timing/step_end"] for r in records]
    phases = [{op: (r.get(f"timing/{op}/busy_s", 0.0), r.get(f"timing/{op}/io_s", 0.0)) for op in PHASES}
              for r in records]
    for p in phases:  # rlgraph's generate does not decode, its reward does
        p[NO_DECODE], p[WITH_DECODE] = p["generate"], p["reward"]
    return {"ends": ends, "first_step_s": records[0]["timing/step_s"], "reward": [r["score/mean"] for r in records],
            "wall": wall, "startup": ends[0] - t0 - records[0]["timing/step_s"], "phases": phases}


def _trl(model: str, batch: int, steps: int, out: Path, seed: int, threads: int = 0) -> dict[str, Any]:
    """One TRL run; `threads`: torch's threads in its process (0: torch's default, the machine's cores)."""
    cmd = [sys.executable, "-m", "benchmarks.trl_grpo", "--model", model, "--batch", str(batch), "--n", str(N),
           "--steps", str(steps), "--out", str(out / "steps.jsonl"), "--seed", str(seed)]
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    t0 = time.time()
    proc = subprocess.run(cmd + ["--t0", str(t0)], cwd=common.ROOT, capture_output=True, text=True, env=env)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"TRL run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    lines = [json.loads(ln) for ln in (out / "steps.jsonl").read_text().splitlines() if ln.strip()]
    head, recs = lines[0], lines[1:]
    return {"ends": [r["t_end"] for r in recs], "first_step_s": recs[0]["t_end"] - recs[0]["t_begin"],
            "reward": [r.get("reward", float("nan")) for r in recs], "wall": wall, "startup": recs[0]["t_begin"] - head["t0"],
            "phases": [_trl_phases(r.get("phase_s", {})) for r in recs]}


def _trl_phases(phase_s: dict[str, float]) -> dict[str, tuple[float, float]]:
    """One TRL step's phases (`benchmarks.trl_grpo`), as rlgraph's: (seconds, 0 for the data plane)."""
    out = {op: (phase_s.get(name, float("nan")), 0.0) for op, name in PHASES.items()}
    decode = phase_s.get("decode", float("nan"))
    out[NO_DECODE] = (out["generate"][0] - decode, 0.0)
    out[WITH_DECODE] = (out["reward"][0] + decode, 0.0)
    return out


def _per_step(x: dict[str, Any], skip: int) -> float:
    """Seconds per step as a user sees them: the time between consecutive steps' ends (with steps in
    flight, a step's own span is longer than this), median over the steps after the first `skip`."""
    gaps = [b - a for a, b in zip(x["ends"], x["ends"][1:])][max(skip - 1, 0):]
    return statistics.median(gaps) if gaps else x["first_step_s"]


def _phase(xs: list[dict[str, Any]], op: str, skip: int, io: bool = False) -> float:
    """Median over runs of each run's median seconds per step in phase `op` (its data-plane part: `io`)."""
    per_run = [statistics.median(p[op][1 if io else 0] for p in x["phases"][skip:] or x["phases"]) for x in xs]
    return statistics.median(per_run)


def _gain(rewards: list[float]) -> float:
    k = min(5, max(1, len(rewards) // 2))
    return statistics.mean(rewards[-k:]) - statistics.mean(rewards[:k])


def run(quick: bool = False, argv: list[str] | None = None, runs: int = 2, svg: Path | None = None) -> common.Section:
    """Measure; `svg`: where to draw the chart of seconds per step (and a PNG beside it)."""
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit("benchmarks.trl_peer needs TRL: pip install 'rlgraph[bench]'") from None
    model = _model()
    settings = QUICK if quick else SETTINGS
    runs = 1 if quick else runs
    table = common.Table(["prompts x n", "trainer", "s/step (median)", "vs TRL", "start-up s", "wall s",
                          "reward gain", "gain per minute"], title="GRPO on the addition task, alternating runs")
    chart: dict[str, list[float]] = {}
    phases = common.Table(["prompts x n", "phase", "rlgraph s/step", "of it data plane", "TRL s/step",
                           "rlgraph vs TRL"],
                          title="Each phase's time per step (median), in the same runs")
    with tempfile.TemporaryDirectory() as tmp:
        for batch, steps, skip in settings:
            got: dict[str, list[dict[str, Any]]] = {"rlgraph": [], POOL: [], UNFUSED: [], "rlgraph async k=1": [],
                                                    "TRL": []}
            for r in range(runs):
                for name in got:
                    out = Path(tmp) / f"{name.replace(' ', '_').replace(',', '')}-{batch}-{r}"
                    if name.startswith("TRL"):
                        got[name].append(_trl(model, batch, steps, out, seed=r))
                    else:
                        example = {POOL: "grpo_reward_pool.py", "rlgraph async k=1": "grpo_async.py"}.get(name, "grpo.py")
                        got[name].append(_rlgraph(example, batch, steps, out, r,
                                                  *(["trainer.fuse_ops=false"] if name == UNFUSED else [])))
                    print(f"  {batch}x{N} {name} run {r}: {_per_step(got[name][-1], skip):.3f} s/step", flush=True)
            trl_step = statistics.median(_per_step(x, skip) for x in got["TRL"])
            for name, xs in got.items():
                step = statistics.median(_per_step(x, skip) for x in xs)
                chart.setdefault(name, []).append(step)
                gain = statistics.median(_gain(x["reward"]) for x in xs)
                # training minutes: from the first step's start to the last step's end
                train_min = statistics.median(x["ends"][-1] - x["ends"][0] + x["first_step_s"] for x in xs) / 60
                table.add(f"{batch} x {N}", name, step, step / trl_step, statistics.median(x["startup"] for x in xs),
                          statistics.median(x["wall"] for x in xs), gain, gain / train_min if train_min else float("nan"))
            for op in ROWS:
                ours, theirs = _phase(got["rlgraph"], op, skip), _phase(got["TRL"], op, skip)
                phases.add(f"{batch} x {N}", op, ours, _phase(got["rlgraph"], op, skip, io=True), theirs,
                           ours / theirs if theirs else float("nan"))
    table.print()
    phases.print()
    intro = __doc__.split("\n\n", 1)[1].split("    .venv")[0].strip()
    if svg is not None:
        from benchmarks.charts import bar_chart

        bar_chart(svg, "GRPO on the addition task: seconds per step", [f"{b} prompts x {N}" for b, _, _ in settings],
                  chart, note="lower is better; TRL's GRPOTrainer against rlgraph, alternating runs")
        intro += f"\n\n![seconds per step, rlgraph and TRL](img/{Path(svg).name})"
    return common.Section(
        "trl", "11. Against a sequential peer: TRL's GRPOTrainer",
        intro,
        [table, phases],
        notes=("Targets (issue 25): synchronous rlgraph at most 1.3x TRL's s/step at every batch size; start-up "
               "to the first step at most 8 s; the asynchronous example (k=1) a higher reward gain per minute "
               "than TRL; each phase no slower per sample than the same pass in one process with the same threads "
               "(TRL: two, as rlgraph's actor). The phase table: rlgraph's op calls' busy time per step (generate, ref, reward, "
               "update_actor; 'of it data plane': the calls' own gets and puts), against the time TRL's step spends "
               "in the same work (its _generate, the reference model's log-probs, the reward function, and the step "
               "less its rollout phase: loss, backward and optimizer). Decoding the responses to text falls in TRL's "
               "_generate (its tokenizer's batch_decode, timed apart) and in rlgraph's reward op: the rows "
               f"'{NO_DECODE}' and '{WITH_DECODE}' compare the same work on both sides."),
        command=common.command_line(argv or ["trl_peer"]),
    )


if __name__ == "__main__":
    run(quick="--quick" in sys.argv, argv=sys.argv[1:])
