"""On-policy distillation vs GRPO on the same weak student (`examples/distill.py`), 3 seeds each.

Four ways to train the student, with seeds 0, 1, 2, one run at a time:

- distill: GKD's dense loss, the Jensen-Shannon divergence to the teacher's whole next-token
  distribution at every sampled position (the example as it is: ``teacher.top_k``, ``actor.distill_coef``);
- distill (sampled token): the per-token reverse-KL advantage of the sampled token alone
  (``algorithm.distill_kl_weight=1``, no top-k), Thinking Machines' recipe;
- GRPO: the task reward alone (``examples/distill.py:grpo``, 16 prompts x 8), run twice as many steps;
- GRPO (64 x 2): the same on distillation's batch shape, 64 prompts x 2 (as many samples);
- mix: GKD plus the task reward's GRPO advantage (``algorithm.distill_task_weight=1``).

The student's accuracy is the mean reward of its samples (``score/mean``, sampled at temperature
1); the teacher's is measured the same way (sampling at temperature 1) on the prompts the student trains on.
Target: distillation reaches 90% of the teacher's accuracy (5-step moving average) in at most half
the steps GRPO alone needs. Writes docs/img/distill.svg and its section of docs/examples.md.

    .venv/bin/python -m benchmarks.distill            # about 30 minutes on 2 cores
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
SAMPLED = ["teacher.top_k=0", "actor.distill_coef=0", "algorithm.distill_kl_weight=1"]
# mode -> (pipeline, overrides, steps as a multiple of --steps)
MODES = {"distill": ("examples/distill.py", [], 1), "distill (sampled token)": ("examples/distill.py", SAMPLED, 1),
         "GRPO": ("examples/distill.py:grpo", [], 2),
         "GRPO (64 x 2)": ("examples/distill.py:grpo", ["data.batch_size=64", "rollout.n=2",
                                                         "actor.mini_batch_size=64"], 1),
         "mix (distill + GRPO)": ("examples/distill.py", ["algorithm.distill_task_weight=1"], 1)}
SEEDS = (0, 1, 2)
STEPS = 150
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
    for mode, (ref, extra, times) in MODES.items():
        for seed in seeds:
            t0 = time.time()
            slug = mode.split(" (")[0] + ("-sampled" if "sampled" in mode else "") + ("-64x2" if "64 x 2" in mode
                                                                                         else "")
            recs = run_one(ref, extra, seed, steps * times, out_root / f"{slug}-seed{seed}")
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
    grpo_steps = steps * MODES["GRPO"][2]

    def mean_step(mode: str, cap: int) -> tuple[float, bool]:
        """Mean over the seeds of the first step at the target (a seed that never reached it counts as `cap`),
        and whether every seed reached it."""
        ks = reached[mode]
        return statistics.mean(cap if k is None else k for k in ks), all(k is not None for k in ks)

    d, d_all = mean_step("distill", steps)
    g, g_all = mean_step("GRPO", grpo_steps)
    never = sum(k is None for k in reached["GRPO"])
    g_text = f"{g:.0f}" if g_all else (f"{g:.0f} or later ({never} of {len(seeds)} seeds never reached it in "
                                       f"{grpo_steps} steps, counted as {grpo_steps})")
    if not d_all:
        verdict = (f"not met: distillation did not reach it within {steps} steps on every seed; after {steps} steps "
                   "the mean accuracy is " + ", ".join(f"{m} {v:.3f}" for m, v in last.items()))
    else:
        verdict = (("met" if d <= g / 2 else "not met") + f": distillation reaches it at step {d:.0f} on average over "
                   f"the seeds (slowest {max(reached['distill'])}), GRPO at step {g_text}; "
                   f"{d:.0f} / {g:.0f} = {d / g:.2f} of GRPO's steps")
    intro = (f"`examples/distill.py`: the same student (4 layers, 100 warm-start steps) trained by on-policy "
             f"distillation from the teacher (the same model warm-started 800 steps) in two ways, by GRPO alone (on "
             f"two batch shapes) and by GKD plus GRPO, seeds {', '.join(map(str, seeds))}; every run samples 128 "
             f"responses a step; {steps} steps each, GRPO (16 x 8) {grpo_steps}. Accuracy is "
             f"the mean reward of the student's samples at temperature 1; the teacher's, measured the same way on the "
             f"training prompts, is {teacher:.3f}, so the target is {target:.3f}. Target: distillation reaches it in "
             f"at most half the steps GRPO alone needs ({verdict}).\n\n"
             f"![distillation vs GRPO](img/distill.svg)")
    notes = ("Batch shapes: GRPO's advantage compares each sample with the others of its prompt, so it samples 16 "
             "prompts x 8; the teacher's signal is per token and needs no group, so distillation spends the same 128 "
             "samples on 64 prompts x 2, and sees each of the task's prompts 4x as often. `GRPO (64 x 2)` is GRPO on "
             "that shape, to show that the shape alone is not what makes distillation faster. "
             "`distill` is GKD's dense loss: at every position the student sampled, the Jensen-Shannon divergence "
             "(`actor.distill_beta=0.5`) between its next-token distribution and the teacher's, over the teacher's "
             "top-k tokens plus the rest of the vocabulary as one outcome (`teacher.top_k=64` covers this 57-token "
             "vocabulary whole). `distill (sampled token)` uses only the sampled token's log-probs, the reverse-KL "
             "advantage `log p_teacher - log p_student`: the teacher is nearly deterministic here, so a token it "
             "would not write scores about -10 and that single-sample estimate is noisy; it learns at about GRPO's "
             "pace. The mix is slower than distillation alone: on groups of 2 samples GRPO's advantage is +-0.71 "
             "or 0 per sample, a coarse signal added to the dense one. Each distillation step costs one teacher "
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
