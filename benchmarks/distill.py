"""On-policy distillation vs GRPO on the same weak student (`examples/distill.py`), 3 seeds each.

Three ways to train the student, each for STEPS steps with seeds 0, 1, 2, one run at a time:

- distill: the per-token reverse-KL advantage to the teacher (``stages.advantage("distill")``);
- GRPO: the task reward alone (``examples/distill.py:grpo``);
- mix: distillation plus the task reward's GRPO advantage (``algorithm.distill_task_weight=1``).

The student's accuracy is the mean reward of its samples (``score/mean``, sampled at temperature
1); the teacher's is measured the same way (sampling at temperature 1) on the prompts the student trains on.
Target: distillation reaches 90% of the teacher's accuracy (5-step moving average) in at most half
the steps GRPO alone needs. Writes docs/img/distill.svg and its section of docs/examples.md.

    .venv/bin/python -m benchmarks.distill            # about 10 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common

DOC = common.ROOT / "docs" / "examples.md"
SVG = common.ROOT / "docs" / "img" / "distill.svg"
MODES = {"distill": ("examples/distill.py", []), "GRPO": ("examples/distill.py:grpo", []),
         "mix (distill + GRPO)": ("examples/distill.py", ["algorithm.distill_task_weight=1"])}
SEEDS = (0, 1, 2)
STEPS = 100
WINDOW = 5


def run_one(ref: str, extra: list[str], seed: int, steps: int, out: Path) -> list[dict[str, Any]]:
    cmd = [str(Path(sys.executable).with_name("rlgraph")), "run", ref, "-o", str(out), "--overwrite",
           f"trainer.seed={seed}", f"--steps={steps}", *extra]
    proc = subprocess.run(cmd, cwd=common.ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def teacher_accuracy(rows: int = 256) -> float:
    """The teacher's mean reward sampling at temperature 1 on the prompts the student trains on (the student's
    measure: `score/mean` is over the training prompts)."""
    from rlgraph.graph.loader import load_pipeline
    from rlgraph.ops.data.tasks import make_rows
    from rlgraph.ops.models import load_causal_lm, load_tokenizer
    from rlgraph.ops.tiny import evaluate

    from rlgraph.graph.compile import compile_pipeline
    from rlgraph.runtime.runner import prepare

    pipeline, ref = load_pipeline(str(common.ROOT / "examples" / "distill.py"))
    prepare(compile_pipeline(pipeline, [], ref))  # builds the student and the teacher (once; cached)
    path = str(Path(pipeline.config["teacher"]["model_path"]).expanduser())
    return evaluate(load_causal_lm(path), load_tokenizer(path, padding_side="left"),
                    make_rows("add", rows, seed=7, split="train"), temperature=1.0, seed=0)


def smoothed(values: list[float], window: int = WINDOW) -> list[float]:
    return [statistics.mean(values[max(0, k + 1 - window):k + 1]) for k in range(len(values))]


def first_reaching(curve: list[float], target: float) -> int | None:
    return next((k for k, v in enumerate(curve) if v >= target), None)


def chart(curves: dict[str, list[list[float]]], minutes: dict[str, list[list[float]]], target: float,
          teacher: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for mode, runs in curves.items():
        n = min(len(r) for r in runs)
        mean = [statistics.mean(r[k] for r in runs) for k in range(n)]
        lo = [min(r[k] for r in runs) for k in range(n)]
        hi = [max(r[k] for r in runs) for k in range(n)]
        line, = axes[0].plot(range(n), mean, label=mode)
        axes[0].fill_between(range(n), lo, hi, alpha=0.15, color=line.get_color())
        t = [statistics.mean(m[k] for m in minutes[mode]) for k in range(n)]
        axes[1].plot(t, mean, label=mode, color=line.get_color())
    for ax, xlabel in zip(axes, ("step", "minutes (mean of the seeds)")):
        ax.axhline(teacher, color="black", lw=0.8, ls=":", label=f"teacher {teacher:.2f}")
        ax.axhline(target, color="grey", lw=0.8, ls="--", label=f"90% of the teacher {target:.2f}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"student accuracy ({WINDOW}-step mean)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle("On-policy distillation vs GRPO on the same student (3 seeds: mean, min-max band)")
    fig.tight_layout()
    SVG.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(SVG)
    plt.close(fig)


def run(steps: int = STEPS, seeds: tuple[int, ...] = SEEDS, out_root: Path | None = None,
        argv: list[str] | None = None) -> common.Section:
    out_root = out_root or common.ROOT / "runs" / "distill"
    teacher = teacher_accuracy()
    target = 0.9 * teacher
    curves: dict[str, list[list[float]]] = {}
    minutes: dict[str, list[list[float]]] = {}
    t = common.Table(["training", "seed", "accuracy first 5 steps", f"accuracy last 5 steps",
                      "step reaching 90% of the teacher", "minutes to it", "run minutes"])
    reached: dict[str, list[int | None]] = {}
    for mode, (ref, extra) in MODES.items():
        for seed in seeds:
            t0 = time.time()
            recs = run_one(ref, extra, seed, steps, out_root / f"{mode.split()[0]}-seed{seed}")
            wall = time.time() - t0
            scores = smoothed([r["score/mean"] for r in recs])
            elapsed = [sum(r["timing/step_s"] for r in recs[:k + 1]) / 60 for k in range(len(recs))]
            curves.setdefault(mode, []).append(scores)
            minutes.setdefault(mode, []).append(elapsed)
            k = first_reaching(scores, target)
            reached.setdefault(mode, []).append(k)
            raw = [r["score/mean"] for r in recs]
            t.add(mode, seed, statistics.mean(raw[:5]), statistics.mean(raw[-5:]), "-" if k is None else k,
                  "-" if k is None else elapsed[k], wall / 60)
            print(f"  {mode} seed {seed}: {raw[0]:.2f} -> {statistics.mean(raw[-5:]):.2f}, 90% at step {k}", flush=True)
    chart(curves, minutes, target, teacher)

    last = {mode: statistics.mean(statistics.mean(c[-5:]) for c in curves[mode]) for mode in curves}
    if any(k is None for k in reached["distill"]):
        verdict = (f"not met: distillation did not reach it within {steps} steps on every seed (GRPO "
                   f"{'neither' if any(k is None for k in reached['GRPO']) else 'did'}); after {steps} steps the mean "
                   f"accuracy is " + ", ".join(f"{m} {v:.3f}" for m, v in last.items()))
    else:
        d = max(k for k in reached["distill"] if k is not None)
        g = max(steps if k is None else k for k in reached["GRPO"])
        verdict = ("met" if d <= g / 2 else "not met") + f": distillation's slowest seed at step {d}, GRPO's at " + (
            f"step {g}" if all(k is not None for k in reached["GRPO"]) else f"> {steps} (some seeds never)")
    intro = (f"`examples/distill.py`: the same weak student (2 layers, 100 warm-start steps) trained {steps} steps "
             f"by on-policy distillation from the 4-layer teacher, by GRPO alone, and by both, seeds "
             f"{', '.join(map(str, seeds))}. Accuracy is the mean reward of the student's samples at temperature 1; "
             f"the teacher's, measured the same way on the training prompts, is {teacher:.3f}, so the target is "
             f"{target:.3f}. Target: distillation reaches it in at most half the steps GRPO alone needs ({verdict}).\n\n"
             f"![distillation vs GRPO](img/distill.svg)")
    notes = ("Why distillation is not faster here: the teacher is nearly deterministic on these prompts, so a token "
             "the student samples that the teacher would not write has a teacher log-prob around -10 and a "
             "per-token advantage that dominates its batch (`reverse_kl/mean` stays near 3 nats per token, "
             "moving little); the single-sample reverse-KL estimate is that noisy. The answers are one to three "
             "tokens, so GRPO's one reward per sample is almost as dense a signal. Adding the task reward's "
             "advantage (mix) does not change that within these steps. Each distillation step costs one teacher "
             "forward on the samples (its own worker group, streamed per group like the reference).")
    return common.Section("distill", "On-policy distillation vs GRPO, 3 seeds", intro, [t], notes,
                          command=".venv/bin/python -m benchmarks.distill")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.distill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    args = p.parse_args(argv)
    common.write_section(run(args.steps, tuple(args.seeds)), DOC)
    print(f"wrote {DOC} and {SVG}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
