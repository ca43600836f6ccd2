"""Issue 25 item 5: how the runtime's own cost per step grows with rows and bytes.

A GRPO-shaped pipeline whose ops do no model work (`gen` writes responses of a fixed length,
`score` puts a score on the last token, `adv` normalises per group, `update` reads everything and
keeps a number as its state), on three groups (actor, reward, advantage: a reward pool beside the
policy, as in examples/grpo_reward_pool.py), run on Ray and TransferQueue like any pipeline. `score` and `adv` are vectorised, as the
example's reward and advantage ops are: one body call for all the chunks (groups) of a call.
Each body measures its own time and reports it once per call (``timing/<op>/body_s``); a step's
runtime overhead is its time between step ends minus the sum of its bodies' times: data-plane
puts and gets, calls, scheduling, the driver's bookkeeping. The first two steps (warm-up) and the
last (no next step being admitted beside it) are left out.

The sweep runs rows (B x n) from 64 to 4,096 at 16-token responses, and responses from 16 to
2,048 tokens at 256 rows; column bytes per step are what the workers put and got (their spans'
byte counts). A least-squares fit ``overhead = fixed + per_row x rows + per_byte x bytes`` over
all points splits the overhead into its three parts; a second fit with squared terms says
whether anything grows faster than linearly (its squared terms' share of the largest point).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import common
from rlgraph import Cluster, DataSource, Pipeline, T, WorkerGroup, op

R = "response_len"
N = 8
PROMPT = 8
ROWS = [64, 256, 1024, 4096]  # B x n, at 16-token responses
LENGTHS = [16, 128, 512, 2048]  # response tokens, at 256 rows
QUICK_ROWS, QUICK_LENGTHS = [64, 256], [16, 128]
SVG = common.ROOT / "docs" / "img" / "overhead.svg"


class Prompts:
    """Prompts of `PROMPT` tokens; nothing to load."""

    def __init__(self, config: dict, seed: int) -> None:
        self.position = 0

    def next_batch(self, batch_size: int) -> dict[str, list]:
        self.position += batch_size
        return {"prompt_ids": [torch.arange(PROMPT) for _ in range(batch_size)]}

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def _timed(t0: float) -> dict[str, float]:
    return {"body_s": time.perf_counter() - t0}


@op(outputs={"responses": T.int64(R), "response_mask": T.int64(R), "gen_metrics": T.json().metric()},
    granularity="group", group="actor", group_size_param="n", cost=5.0)
def gen(prompt_ids: T.int64("prompt_len"), *, n: int = N, length: int = 16, micro_batch_size: int = 8, ctx=None):
    t0 = time.perf_counter()
    rows = prompt_ids.shape[0]
    g = torch.Generator().manual_seed(ctx.seed)
    responses = torch.randint(3, 100, (rows, length), generator=g)
    return {"responses": responses, "response_mask": torch.ones(rows, length, dtype=torch.int64),
            "gen_metrics": _timed(t0)}


@op(outputs={"token_level_scores": T.float32(R), "score_metrics": T.json().metric()}, group="reward", cost=0.5,
    vectorised=True)
def score(responses: T.int64(R), response_mask: T.int64(R), *, micro_batch_size: int = 64):
    t0 = time.perf_counter()
    s = torch.zeros(responses.shape, dtype=torch.float32)
    s[:, -1] = (responses[:, 0] % 2).float()
    return {"token_level_scores": s, "score_metrics": _timed(t0)}


@op(outputs={"advantages": T.float32(R), "adv_metrics": T.json().metric()}, granularity="group", group="advantage",
    cost=0.2, vectorised=True)
def adv(token_level_scores: T.float32(R), response_mask: T.int64(R), *, micro_batch_size: int = 1, ctx=None):
    """Normalised per group, all the call's groups at once (as the GRPO example's advantage op)."""
    t0 = time.perf_counter()
    per_row = token_level_scores.sum(dim=1)
    sizes = tuple(ctx.chunks) or (len(per_row),)
    if len(set(sizes)) == 1 and sizes[0] > 1:  # groups of one size: one pass over a [groups, n] view
        g = per_row.view(len(sizes), sizes[0])
        a = ((g - g.mean(dim=1, keepdim=True)) / (g.std(dim=1, keepdim=True) + 1e-6)).reshape(-1)
    else:
        a = torch.cat([(x - x.mean()) / (x.std() + 1e-6) if len(x) > 1 else x * 0 for x in per_row.split(sizes)])
    return {"advantages": a.unsqueeze(1) * response_mask, "adv_metrics": _timed(t0)}


@op(outputs={"update_metrics": T.json().metric(), "w": T.float32().state()}, granularity="batch", group="actor",
    cost=3.0)
def update(responses: T.int64(R), response_mask: T.int64(R), advantages: T.float32(R), w: T.float32().state()):
    t0 = time.perf_counter()
    total = float((advantages * response_mask).sum()) + float(responses.float().mean())
    prev = 0.0 if w is None else float(w)
    return {"update_metrics": _timed(t0), "w": torch.tensor(prev + 1e-3 * total)}


pipeline = Pipeline(
    name="overhead",
    source=DataSource(columns={"prompt_ids": T.int64("prompt_len")}, impl=Prompts),
    ops=[gen, score, adv, update],
    groups=[WorkerGroup("actor", num_cpus=1), WorkerGroup("reward", num_cpus=1),
            WorkerGroup("advantage", num_cpus=0.5)],
    cluster=Cluster(cpus_per_node=8),
    config={"data": {"batch_size": 8}, "gen": {"n": N}, "trainer": {"steps": 10}},
)


def measure(rows: int, length: int, steps: int, plane: Any) -> dict[str, float]:
    """Median per-step time, body time and column bytes of `steps` steps (the first two and the
    last left out)."""
    import rlgraph
    from rlgraph.runtime.runner import Runner

    plan = rlgraph.compile(pipeline, [f"data.batch_size={rows // N}", f"gen.length={length}",
                                      f"gen.micro_batch_size={rows // N}", f"score.micro_batch_size={max(64, rows // 4)}"])
    with tempfile.TemporaryDirectory() as tmp:
        with Runner(plan, common.quiet_runner_options(Path(tmp), steps=steps + 3), plane) as runner:
            recs = runner.run()
            spans = runner.all_spans
    ends = [r for r in recs[2:-1]]
    per_step, body, moved = [], [], []
    by_step: dict[int, int] = {}
    for s in spans:
        by_step[s.step] = by_step.get(s.step, 0) + s.local_bytes + s.cross_node_bytes
    for r in ends:
        per_step.append(r["timing/step_s"])
        body.append(sum(v for k, v in r.items() if k.startswith("timing/") and k.endswith("/body_s")))
        moved.append(by_step.get(r["step"], 0))
    step_s, body_s = statistics.median(per_step), statistics.median(body)
    return {"rows": rows, "length": length, "step_s": step_s, "body_s": body_s, "overhead_s": step_s - body_s,
            "bytes": statistics.median(moved)}


def fit(points: list[dict[str, float]]) -> dict[str, float]:
    """Least squares: overhead = fixed + per_row x rows + per_byte x bytes; and with squared terms."""
    x = torch.tensor([[1.0, p["rows"], p["bytes"]] for p in points], dtype=torch.float64)
    y = torch.tensor([[p["overhead_s"]] for p in points], dtype=torch.float64)
    coef = torch.linalg.lstsq(x, y).solution.flatten().tolist()
    pred = (x @ torch.tensor(coef, dtype=torch.float64).unsqueeze(1)).flatten()
    worst = max(abs(float(a) - float(b)) / max(float(b), 1e-9) for a, b in zip(pred, y.flatten()))
    x2 = torch.cat([x, x[:, 1:2] ** 2, x[:, 2:3] ** 2], dim=1)
    scale = x2.abs().max(dim=0).values.clamp(min=1e-30)
    coef2 = (torch.linalg.lstsq(x2 / scale, y).solution.flatten() / scale).tolist()
    big = max(range(len(points)), key=lambda i: float(y[i]))
    squared = (coef2[3] * float(x2[big, 3]) + coef2[4] * float(x2[big, 4])) / float(y[big])
    return {"fixed_s": coef[0], "per_row_s": coef[1], "per_byte_s": coef[2], "worst_residual": worst,
            "squared_share": squared}


def run(quick: bool = False, argv: list[str] | None = None, steps: int | None = None,
        svg: Path | None = SVG) -> common.Section:
    steps = steps or (2 if quick else 10)
    plane = common.plane("transferqueue")
    grid = [(r, 16) for r in (QUICK_ROWS if quick else ROWS)]
    grid += [(256 if not quick else 64, n) for n in (QUICK_LENGTHS if quick else LENGTHS) if n != 16]
    points = []
    for rows, length in grid:
        p = measure(rows, length, steps, plane)
        points.append(p)
        print(f"  {rows} rows x {length} tokens: step {p['step_s'] * 1000:.1f} ms, bodies {p['body_s'] * 1000:.1f} ms, "
              f"{p['bytes'] / 1e6:.1f} MB moved", flush=True)
    f = fit(points)
    t = common.Table(["rows (B x n)", "response tokens", "column MB per step", "step ms", "op bodies ms",
                      "overhead ms", "fit ms"])
    for p in points:
        t.add(p["rows"], p["length"], p["bytes"] / 1e6, 1000 * p["step_s"], 1000 * p["body_s"],
              1000 * p["overhead_s"], 1000 * (f["fixed_s"] + f["per_row_s"] * p["rows"] + f["per_byte_s"] * p["bytes"]))
    t.print()
    fits = common.Table(["part", "value", "target"])
    fits.add("fixed per step (ms)", 1000 * f["fixed_s"], "<= 20")
    fits.add("per row (us)", 1e6 * f["per_row_s"], "")
    fits.add("per byte: MB/s of column traffic", (1 / f["per_byte_s"] / 1e6) if f["per_byte_s"] > 0 else float("inf"), "")
    fits.add("largest relative residual of the linear fit", f["worst_residual"], "")
    fits.add("share of squared terms at the largest point", f["squared_share"], "near 0: nothing superlinear")
    fits.print()
    if svg is not None:
        from benchmarks.charts import bar_chart

        labels = [f"{p['rows']}x{p['length']}" for p in points]
        bar_chart(svg.with_suffix(""), "Runtime overhead per step (model-free ops)", labels,
                  {"overhead": [1000 * p["overhead_s"] for p in points],
                   "linear fit": [1000 * (f["fixed_s"] + f["per_row_s"] * p["rows"] + f["per_byte_s"] * p["bytes"])
                                  for p in points]},
                  ylabel="ms per step", note="rows x response tokens; overhead = step time - op bodies' time")
    intro = __doc__.split("\n\n", 1)[1]
    notes = (f"Fixed part {1000 * f['fixed_s']:.1f} ms per step (target 20 ms), {1e6 * f['per_row_s']:.1f} us per row, "
             f"{(1 / f['per_byte_s'] / 1e6) if f['per_byte_s'] > 0 else float('inf'):.0f} MB/s of column traffic. "
             + (f"![overhead](img/overhead.svg)" if svg is not None else ""))
    return common.Section("overhead", "12. How the runtime's overhead grows", intro, [t, fits], notes,
                          common.command_line(argv if argv is not None else ["overhead"] + (["--quick"] if quick else [])))
