"""Do the bundled examples learn? Each one, with its defaults, for 3 seeds, on this machine.

    .venv/bin/python -m benchmarks.learning                    # every example, seeds 0 1 2 (about 55 min on 2 cores)
    .venv/bin/python -m benchmarks.learning ppo --seeds 0      # one example, one seed

Each run is `rlgraph run examples/<name>.py trainer.seed=S` in a fresh process (its own local
Ray), timed from the command's start to its exit, start-up and the model's warm start included
(the warm-started model is cached in ~/.cache/rlgraph/models after the first run). The target
(issue 16): the mean reward (``score/mean``) of the last 3 steps at least 0.2 above that of the
first 3, within 10 minutes, for every seed. The results go to ``benchmarks/results/learning.json``
(the doc tests compare docs/examples.md and the quick start with it) and to the table between
the ``bench:learning`` markers in docs/examples.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import common
from rlgraph.runtime.metrics import read_metrics

EXAMPLES = ("grpo", "grpo_async", "ppo", "ppo_rm", "dapo", "agent_tools", "agent_guess")
SEEDS = (0, 1, 2)
GAIN, MINUTES = 0.2, 10.0  # the target: +0.2 mean reward within 10 minutes
RESULTS = common.ROOT / "benchmarks" / "results" / "learning.json"
DOC = common.ROOT / "docs" / "examples.md"
KEY = "score/mean"
# dapo trains on the groups its filter kept (neither all right nor all wrong), so its score says
# little about accuracy: its reward is the rule score over every sample its rounds generated
KEYS = {"dapo": "generated/acc/mean"}


def key_of(example: str) -> str:
    """The metric whose gain is measured for `example`."""
    return KEYS.get(example, KEY)


def default_steps(example: str) -> int:
    """The example's trainer.steps, as `rlgraph run` compiles it without overrides."""
    import rlgraph
    from rlgraph.graph.loader import load_pipeline

    pipeline, ref = load_pipeline(str(common.ROOT / "examples" / f"{example}.py"))
    return int(rlgraph.compile(pipeline, [], pipeline_ref=ref).config["trainer"]["steps"])


def run_one(example: str, seed: int, out_root: Path) -> dict:
    out = out_root / f"{example}-seed{seed}"
    cmd = [str(Path(sys.executable).with_name("rlgraph")), "run", f"examples/{example}.py", "-o", str(out),
           "--overwrite", f"trainer.seed={seed}"]  # a benchmark run replaces the last one
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=common.ROOT, capture_output=True, text=True, timeout=3600)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return summarize(example, seed, out, wall)


def summarize(example: str, seed: int, out: Path, wall_s: float) -> dict:
    """One run's entry: the first/last 3 and 10 steps' mean reward, and the first and last steps'
    headline values (what the quick start's sample output shows)."""
    records = read_metrics(out / "metrics.jsonl")
    scores = [r[key_of(example)] for r in records]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    first, last = mean(scores[:3]), mean(scores[-3:])
    head = ("score/mean", "reward/mean", "response_length/mean")
    return {"example": example, "seed": seed, "steps": len(scores), "wall_s": round(wall_s, 1),
            "first3": round(first, 4), "last3": round(last, 4), "gain": round(last - first, 4),
            "first10": round(mean(scores[:10]), 4), "last10": round(mean(scores[-10:]), 4),
            "shown": {str(r["step"]): {k: r[k] for k in head if k in r}
                      for r in (records[0], records[1], records[-1])},
            "passed": last - first >= GAIN and wall_s <= MINUTES * 60}


# per example, the metrics drawn per block of steps (seed 0): the reward, and for the mixed reward its sources
BLOCK_KEYS = {"ppo_rm": (("score/mean", "combined score"),
                         ("combine_rewards/combine_rewards_metrics/rule_scores/mean", "rule score (accuracy)"),
                         ("combine_rewards/combine_rewards_metrics/rm_scores/mean", "reward model (mean logit)")),
              "dapo": (("generated/acc/mean", "accuracy, every generated sample"),
                       ("acc/mean", "accuracy, the trained samples"),
                       ("refill/rounds", "generation rounds per step"))}
BLOCK = 50


def blocks_table(out_root: Path, examples: list[str]) -> common.Table | None:
    """Seed 0 of each example: the mean of each metric per block of BLOCK steps (from the run's metrics.jsonl)."""
    rows = []
    width = 0
    for ex in examples:
        path = out_root / f"{ex}-seed0" / "metrics.jsonl"
        if not path.is_file():
            continue
        records = read_metrics(path)
        for key, label in BLOCK_KEYS.get(ex, ((KEY, "score"),)):
            vals = [r[key] for r in records if key in r]
            means = [sum(vals[i:i + BLOCK]) / len(vals[i:i + BLOCK]) for i in range(0, len(vals), BLOCK)]
            width = max(width, len(means))
            rows.append((f"`{ex}.py`", label, vals[0], means))
    if not rows:
        return None
    t = common.Table(["example", "metric", "step 0", *[f"steps {i * BLOCK}-{(i + 1) * BLOCK - 1}" for i in range(width)]],
                     title=f"Seed 0: the mean per block of {BLOCK} steps")
    for ex, label, first, means in rows:
        t.add(ex, label, first, *means, *[float("nan")] * (width - len(means)))
    return t


def section(results: list[dict], out_root: Path | None = None) -> common.Section:
    t = common.Table(["example", "steps", "seed", "first 3 steps", "last 3 steps", "gain", "wall time (min)",
                      "+0.2 in 10 min"])
    for r in results:
        t.add(f"`{r['example']}.py`", r["steps"], r["seed"], r["first3"], r["last3"], r["gain"],
              round(r["wall_s"] / 60, 1), r["passed"])
    worst = min(results, key=lambda r: r["gain"])
    slowest = max(results, key=lambda r: r["wall_s"])
    intro = (f"Every bundled example with its defaults, `trainer.seed` 0, 1 and 2, one run at a time: the mean "
             f"reward (`{KEY}`; for `dapo.py`, whose trained samples are chosen by its filter, the rule score "
             f"of every sample it generated, `{KEYS['dapo']}`) of the first 3 and the last 3 steps, and the wall "
             f"time of the whole "
             f"`rlgraph run` (start-up included). Target: a gain of at least +{GAIN} within {MINUTES:.0f} minutes.")
    notes = (f"All {len(results)} runs {'clear' if all(r['passed'] for r in results) else 'do NOT all clear'} the "
             f"target. Smallest gain: {worst['gain']:+.3f} (`{worst['example']}.py`, seed {worst['seed']}); "
             f"longest run: {slowest['wall_s'] / 60:.1f} min (`{slowest['example']}.py`, seed {slowest['seed']}).")
    tables = [t]
    per_block = blocks_table(out_root, list(dict.fromkeys(r["example"] for r in results))) if out_root else None
    if per_block is not None:
        tables.append(per_block)
    return common.Section("learning", "Learning with margin: every example, 3 seeds", intro, tables, notes,
                          command=".venv/bin/python -m benchmarks.learning")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.learning", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("examples", nargs="*", help=f"examples to run (default all: {', '.join(EXAMPLES)})")
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    p.add_argument("--out", type=Path, default=common.ROOT / "runs" / "learning", help="run directories")
    p.add_argument("--summarize", action="store_true",
                   help="run nothing: recompute the entries from their run directories (wall times kept)")
    args = p.parse_args(argv)
    unknown = sorted(set(args.examples) - set(EXAMPLES))
    if unknown:
        p.error(f"unknown examples {unknown}; choose from {', '.join(EXAMPLES)}")
    old = {(r["example"], r["seed"]): r for r in json.loads(RESULTS.read_text())} if RESULTS.exists() else {}
    if args.summarize:
        old = {k: summarize(k[0], k[1], args.out / f"{k[0]}-seed{k[1]}", r["wall_s"]) for k, r in old.items()}
        _write(old, args.out)
        return 0
    for ex in args.examples or EXAMPLES:
        for seed in args.seeds:
            print(f"== {ex} seed {seed} ({default_steps(ex)} steps)", flush=True)
            r = run_one(ex, seed, args.out)
            print(f"   {r['first3']:.3f} -> {r['last3']:.3f} ({r['gain']:+.3f}) in {r['wall_s'] / 60:.1f} min"
                  f"{'' if r['passed'] else '  BELOW TARGET'}", flush=True)
            old[(ex, seed)] = r
            _write(old, args.out)
    return 0


def _write(entries: dict, out_root: Path) -> None:
    results = [entries[k] for k in sorted(entries, key=lambda k: (EXAMPLES.index(k[0]), k[1])) if k[0] in EXAMPLES]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    common.write_section(section(results, out_root), DOC)


if __name__ == "__main__":
    sys.exit(main())
