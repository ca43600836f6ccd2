"""A run's charts, drawn with matplotlib, each written as SVG and PNG.

- the reward curve (``reward_curve.svg``): the pipeline's headline metric per step, raw and as a
  moving average;
- the timeline (``timeline.svg``): one lane per worker (group, rank), one box per op call against
  time, one colour per op, step boundaries marked. A long run (more than `LONG_RUN` steps) gets two
  panels: the last `DETAIL_STEPS` steps in detail, and above them a per-step summary of the whole
  run: each op's span (its first call's start to its last call's end) and the step's wall time
  against the step, so a slow-down or a spike reads at a glance.

Figures are `matplotlib.figure.Figure` objects with no pyplot state: nothing global changes and no
display is needed. The ``*_figure`` functions return the figure (the tests read it back); the
``write_*`` ones draw and save it. `save` writes ``<name>.svg`` (text kept as text, no date, so the
same data gives the same file) and ``<name>.png``; `benchmarks/charts.py` uses it too.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from rlgraph.runtime.metrics import read_metrics
from rlgraph.runtime.trace import PALETTE, Span, write_chrome_trace

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["write_run_charts", "LONG_RUN", "DETAIL_STEPS", "SUMMARY_POINTS", "AVERAGE_WINDOW", "new_figure", "save", "reward_curve_figure",
           "write_reward_curve", "timeline_figure", "write_timeline"]

LONG_RUN = 8  # a timeline of more steps than this draws the last DETAIL_STEPS in detail plus a summary
DETAIL_STEPS = 4
SUMMARY_POINTS = 1000  # at most this many points per line in the whole-run summary (longer runs: means)
AVERAGE_WINDOW = 10  # steps in the reward curve's moving average (fewer when the run is shorter)
STEP_BOUNDARY = "step-boundary"  # the gid of the lines that mark where a step starts (and the last ends)
_DPI = 110
_FONT = 8


def new_figure(width: float, height: float) -> "Figure":
    """An empty figure of `width` x `height` inches with constrained layout; matplotlib is imported here."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        from rlgraph.graph.viz import MissingDependencyError

        raise MissingDependencyError("drawing charts needs the Python package 'matplotlib'; install it with "
                                     "`pip install matplotlib` (or `pip install -e .`, which pulls it in)") from None
    return Figure(figsize=(width, height), dpi=_DPI, layout="constrained")


def _stem(path: str | Path) -> Path:
    path = Path(path)
    return path.with_suffix("") if path.suffix.lower() in (".svg", ".png") else path


def save(fig: "Figure", path: str | Path) -> tuple[Path, Path]:
    """Write `fig` as ``<name>.svg`` and ``<name>.png``, where `path` is ``<name>``, ``<name>.svg`` or
    ``<name>.png``; returns both paths."""
    import matplotlib

    stem = _stem(path)
    stem.parent.mkdir(parents=True, exist_ok=True)
    svg, png = stem.with_name(stem.name + ".svg"), stem.with_name(stem.name + ".png")
    # text stays text (searchable, and a test can read it); a fixed salt and no date: same data, same file
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "rlgraph"}):
        fig.savefig(svg, format="svg", metadata={"Date": None})
    fig.savefig(png, format="png", metadata={"Software": None})
    return svg, png


def _integer_steps(ax: "Axes") -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


# -- reward curve ------------------------------------------------------------------------------------


def _moving_average(values: Sequence[float], window: int) -> list[float]:
    """The mean of each value and the up to `window` - 1 values before it."""
    out = []
    for i in range(len(values)):
        recent = values[max(0, i - window + 1):i + 1]
        out.append(sum(recent) / len(recent))
    return out


def reward_curve_figure(records: Iterable[Mapping[str, Any]], key: str, title: str = "per step") -> "Figure | None":
    """`key` against the step, raw and as a moving average over min(`AVERAGE_WINDOW`, steps) steps;
    None when no record has `key`. Steps are whole numbers, so are the x ticks."""
    points = sorted((int(r["step"]), float(r[key])) for r in records
                    if isinstance(r.get(key), (int, float)) and "step" in r)
    if not points:
        return None
    steps, values = [s for s, _ in points], [v for _, v in points]
    window = min(AVERAGE_WINDOW, len(points))
    fig = new_figure(8, 4)
    ax = fig.add_subplot()
    few = len(points) <= 30  # markers while a step's dot can be told apart; a 1-step run is one dot
    ax.plot(steps, values, color="#9ecae1", linewidth=1, marker="o" if few else None, markersize=4, label=key)
    ax.plot(steps, _moving_average(values, window), color="#08519c", linewidth=2,
            marker="o" if len(points) == 1 else None, markersize=3, label=f"{window}-step moving average")
    if len(points) == 1:  # a single step: an axis around it, not one 0.1 wide, and its tick only
        ax.set_xlim(steps[0] - 0.5, steps[0] + 0.5)
        ax.set_xticks([steps[0]])
    else:
        _integer_steps(ax)
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(title, fontsize=11, loc="left")
    ax.grid(True, color="#eeeeee")
    ax.legend(fontsize=_FONT, loc="best")
    return fig


def write_reward_curve(path: str | Path, records: Iterable[Mapping[str, Any]], key: str,
                       title: str = "per step") -> tuple[Path, Path] | None:
    """Draw `reward_curve_figure` to ``<path>.svg`` and ``.png``; None (nothing written) if no record has `key`."""
    fig = reward_curve_figure(records, key, title)
    return None if fig is None else save(fig, path)


# -- timeline ----------------------------------------------------------------------------------------


def _op_colours(spans: Sequence[Span], more: Iterable[str] = ()) -> dict[str, str]:
    """One colour per op, handed out in the order the ops first ran (about the plan's order)."""
    first: dict[str, float] = {}
    for s in spans:
        first[s.op] = min(first.get(s.op, s.start), s.start)
    ops = sorted(first, key=lambda o: (first[o], o)) + sorted(set(more) - set(first))
    return {o: PALETTE[i % len(PALETTE)] for i, o in enumerate(ops)}


def _run_summary(spans: Sequence[Span], records: Sequence[Mapping[str, Any]]
                 ) -> tuple[list[int], dict[str, list[float]], list[float]]:
    """Per step: each op's span (first call's start to last call's end, s) and the step's wall time.

    From metrics.jsonl's records when they have the op timings (they cover every step; the driver
    keeps the spans of the latest steps only), else from the spans."""
    timed = [r for r in records if "step" in r and any(k.endswith("/span_s") for k in r)]
    if timed:
        steps = [int(r["step"]) for r in timed]
        ops = sorted({k.split("/")[1] for r in timed for k in r
                      if k.startswith("timing/") and k.endswith("/span_s") and k.count("/") == 2})
        per_op = {o: [float(r.get(f"timing/{o}/span_s", float("nan"))) for r in timed] for o in ops}
        wall = [float(r.get("timing/step_s", float("nan"))) for r in timed]
        return steps, per_op, wall
    first: dict[tuple[int, str], float] = {}
    last: dict[tuple[int, str], float] = {}
    for s in spans:
        first[(s.step, s.op)] = min(first.get((s.step, s.op), s.start), s.start)
        last[(s.step, s.op)] = max(last.get((s.step, s.op), s.end), s.end)
    steps = sorted({s.step for s in spans})
    ops = sorted({s.op for s in spans})
    per_op = {o: [last[(k, o)] - first[(k, o)] if (k, o) in first else float("nan") for k in steps] for o in ops}
    step_first: dict[int, float] = {}
    step_last: dict[int, float] = {}
    for (k, _), t in first.items():
        step_first[k] = min(step_first.get(k, t), t)
    for (k, _), t in last.items():
        step_last[k] = max(step_last.get(k, t), t)
    return steps, per_op, [step_last[k] - step_first[k] for k in steps]


def _binned(steps: Sequence[int], series: Sequence[float], size: int) -> tuple[list[float], list[float]]:
    """Means over `size` consecutive steps (NaNs left out), at each bin's mean step."""
    xs, ys = [], []
    for i in range(0, len(steps), size):
        vals = [v for v in series[i:i + size] if not math.isnan(v)]
        xs.append(sum(steps[i:i + size]) / len(steps[i:i + size]))
        ys.append(sum(vals) / len(vals) if vals else float("nan"))
    return xs, ys


def _draw_calls(ax: "Axes", spans: Sequence[Span], colour: Mapping[str, str]) -> None:
    """One lane per worker, one box per call (numbered by step where wide enough), step boundaries."""
    from matplotlib.transforms import blended_transform_factory

    lanes = sorted({(s.group, s.rank) for s in spans})
    lane = {w: i for i, w in enumerate(lanes)}
    t0 = min(s.start for s in spans)
    total = max(max(s.end for s in spans) - t0, 1e-6)
    boxes: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    for s in spans:
        boxes[(s.op, lane[(s.group, s.rank)])].append((s.start - t0, max(s.duration, total * 1e-4)))
    for (op, i), xs in sorted(boxes.items()):
        ax.broken_barh(xs, (i - 0.4, 0.8), facecolors=colour[op], edgecolors="#333333", linewidths=0.3)
    ticks: list[tuple[float, int]] = []  # a tick where a streaming call handed over a part
    for s in spans:
        i = lane[(s.group, s.rank)]
        if s.duration >= total * 0.03:  # the step number, so that steps in flight together read apart
            ax.text(s.start - t0 + total * 0.003, i, str(s.step), fontsize=6, va="center", color="#222222")
        ticks.extend((t - t0, i) for t, _rows in s.parts)
    if ticks:
        ax.vlines([t for t, _ in ticks], [i - 0.4 for _, i in ticks], [i + 0.4 for _, i in ticks],
                  colors="#000000", linewidths=0.6)
    # step boundaries: where each step's first call starts, and where the last call ends
    starts: dict[int, float] = {}
    for s in spans:
        starts[s.step] = min(starts.get(s.step, s.start), s.start)
    top = blended_transform_factory(ax.transData, ax.transAxes)
    for step, t in sorted(starts.items()):
        ax.axvline(t - t0, color="#555555", linestyle="--", linewidth=0.8, gid=STEP_BOUNDARY)
        ax.text(t - t0, 1.0, f"step {step}", transform=top, fontsize=_FONT - 1, ha="left", va="bottom",
                color="#555555")
    ax.axvline(total, color="#555555", linestyle="--", linewidth=0.8, gid=STEP_BOUNDARY)
    ax.set_yticks(range(len(lanes)), [f"{g}[{r}]" for g, r in lanes], fontsize=_FONT)
    ax.set_ylim(len(lanes) - 0.5, -0.5)  # the first lane on top
    ax.set_xlim(0, total * 1.01)
    ax.set_xlabel("seconds", fontsize=_FONT)
    ax.tick_params(axis="x", labelsize=_FONT)
    ax.grid(True, axis="x", color="#eeeeee")
    ax.set_axisbelow(True)


EVENT_LANES = 24  # lanes (e.g. trajectories) drawn inside a call at most
_EVENT_COLOURS = {"turn": "#4e79a7", "tool": "#e15759", "env": "#59a14f"}


def _draw_events(ax: "Axes", spans: Sequence[Span]) -> None:
    """What happened inside one op's calls of one step (`Span.events`): a lane per event lane (an
    agent's trajectory), a box per event, coloured by the label's first word (turn, tool, env)."""
    from matplotlib.patches import Patch

    keys = sorted({(s.rank, lane) for s in spans for _, _, lane, _ in s.events})[:EVENT_LANES]
    row = {k: i for i, k in enumerate(keys)}
    t0 = min(s.start for s in spans)
    boxes: dict[str, list[tuple[int, tuple[float, float]]]] = defaultdict(list)
    for s in spans:
        for start, end, lane, label in s.events:
            if (s.rank, lane) in row:
                kind = label.split()[0] if label else "event"
                boxes[kind].append((row[(s.rank, lane)], (start - t0, max(end - start, 1e-4))))
    for kind, items in boxes.items():
        for i, xs in items:
            ax.broken_barh([xs], (i - 0.4, 0.8), facecolors=_EVENT_COLOURS.get(kind, "#bab0ac"),
                           edgecolors="#333333", linewidths=0.2)
    ax.set_yticks(range(len(keys)), [f"{r}.{lane}" for r, lane in keys], fontsize=_FONT - 2)
    ax.set_ylim(len(keys) - 0.5, -0.5)
    ax.set_xlabel("seconds from the call's start", fontsize=_FONT)
    ax.tick_params(axis="x", labelsize=_FONT)
    ax.grid(True, axis="x", color="#eeeeee")
    ax.legend(handles=[Patch(facecolor=_EVENT_COLOURS.get(k, "#bab0ac"), label=k) for k in sorted(boxes)],
              fontsize=_FONT - 1, loc="upper right", frameon=False)
    ax.set_title(f"inside {spans[0].op}, step {spans[0].step}: each lane a trajectory (rank.index), model turns "
                 f"and tool or environment steps", fontsize=_FONT + 1, loc="left")


def _draw_summary(ax: "Axes", steps: Sequence[int], per_op: Mapping[str, Sequence[float]], wall: Sequence[float],
                  colour: Mapping[str, str], detail: Sequence[int]) -> int:
    """Draw the per-step lines; returns the steps each point averages (1 up to `SUMMARY_POINTS` steps)."""
    size = -(-len(steps) // SUMMARY_POINTS)  # a 100,000-step run: means over 100 steps, not a solid band
    for op, spans_s in per_op.items():
        ax.plot(*_binned(steps, spans_s, size), color=colour[op], linewidth=1.2, label=op)
    ax.plot(*_binned(steps, wall, size), color="#000000", linewidth=1.6, label="step (wall time)")
    if detail:
        ax.axvspan(min(detail) - 0.5, max(detail) + 0.5, color="#dddddd", zorder=0)
        ax.text(max(detail) + 0.5, 1.0, "detail below ", transform=ax.get_xaxis_transform(), fontsize=_FONT - 1,
                ha="right", va="top", color="#555555")
    _integer_steps(ax)
    ax.set_xlabel("step", fontsize=_FONT)
    ax.set_ylabel("seconds", fontsize=_FONT)
    ax.tick_params(labelsize=_FONT)
    ax.grid(True, color="#eeeeee")
    ax.set_ylim(bottom=0)
    return size


def _legend(fig: "Figure", colour: Mapping[str, str], wall: bool) -> None:
    """One entry per op in the order they first ran (and the summary's wall-time line), under the axes."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles: list[Any] = [Patch(facecolor=c, edgecolor="#333333", linewidth=0.3, label=o) for o, c in colour.items()]
    if wall:
        handles.append(Line2D([], [], color="#000000", linewidth=1.6, label="step (wall time)"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 7), fontsize=_FONT, frameon=False)


def timeline_figure(spans: Iterable[Span], title: str = "timeline",
                    records: Sequence[Mapping[str, Any]] = ()) -> "Figure":
    """The op calls of `spans` against time. A run of more than `LONG_RUN` steps (counted in `records`,
    metrics.jsonl's lines, when given, else in `spans`) gets two panels: the whole run per step, then
    the calls of the last `DETAIL_STEPS` steps."""
    spans = sorted(spans, key=lambda s: (s.start, s.group, s.rank))
    if not spans:
        fig = new_figure(11, 1.5)
        fig.suptitle(f"{title}: no op calls recorded", fontsize=11, x=0.01, ha="left")
        return fig
    span_steps = sorted({s.step for s in spans})
    run_steps = {int(r["step"]) for r in records if "step" in r} | set(span_steps)
    long_run = len(run_steps) > LONG_RUN
    shown = [s for s in spans if s.step in set(span_steps[-DETAIL_STEPS:])] if long_run else spans
    lanes = len({(s.group, s.rank) for s in shown})
    seconds = max(s.end for s in shown) - min(s.start for s in shown)
    lane_h = 0.28 if lanes > 4 else 0.4
    inner = [s for s in shown if s.events]
    inner = [s for s in inner if s.step == inner[-1].step and s.op == inner[-1].op] if inner else []
    inner_lanes = len({(s.rank, lane) for s in inner for _, _, lane, _ in s.events})
    inner_h = [max(1.2, min(inner_lanes, 24) * 0.16)] if inner else []
    if long_run:
        steps, per_op, wall = _run_summary(spans, records)
        colour = _op_colours(spans, per_op)
        fig = new_figure(11, 3.4 + lanes * lane_h + 0.9 + sum(inner_h) + (0.6 if inner else 0))
        summary, detail, *rest = fig.subplots(2 + len(inner_h), 1,
                                              height_ratios=[2.6, max(1.4, lanes * lane_h), *inner_h])
        size = _draw_summary(summary, steps, per_op, wall, colour, sorted({s.step for s in shown}))
        means = f", means over {size} steps" if size > 1 else ""
        summary.set_title(f"whole run: each op's span (first call start to last call end) per step, "
                          f"{len(steps)} steps{means}", fontsize=_FONT + 1, loc="left")
        _draw_calls(detail, shown, colour)
        detail.set_title(f"last {min(DETAIL_STEPS, len(span_steps))} steps ({seconds:.2f} s): op calls per worker",
                         fontsize=_FONT + 1, loc="left", pad=12)
        fig.suptitle(title, fontsize=11, x=0.01, ha="left")
    else:
        colour = _op_colours(spans)
        fig = new_figure(11, 1.3 + max(1.0, lanes * lane_h) + 0.5 + sum(inner_h) + (0.6 if inner else 0))
        calls, *rest = fig.subplots(1 + len(inner_h), 1, height_ratios=[max(1.0, lanes * lane_h), *inner_h]) \
            if inner else [fig.add_subplot()]
        _draw_calls(calls, shown, colour)
        fig.suptitle(f"{title} ({seconds:.2f} s)", fontsize=11, x=0.01, ha="left")
    if inner:
        _draw_events(rest[0], inner)
    _legend(fig, colour, wall=long_run)
    return fig


def write_timeline(path: str | Path, spans: Iterable[Span], title: str = "timeline",
                   records: Sequence[Mapping[str, Any]] = ()) -> tuple[Path, Path]:
    """Draw `timeline_figure` to ``<path>.svg`` and ``.png``."""
    return save(timeline_figure(spans, title, records), path)


def write_run_charts(out: Path, title: str, headline: Sequence[str], spans: Sequence[Span], note: str = "") -> None:
    """A run's charts as it ends: reward_curve.svg/.png of the first headline metric, trace.json
    and timeline.svg/.png of the op calls in `spans` (whose whole-run summary reads every step's op
    timings from metrics.jsonl: the spans cover the latest steps only). It runs also when the run
    failed, so a chart that cannot be drawn is a warning, never an exception that would hide the
    run's own error."""
    import warnings

    try:
        records = read_metrics(out / "metrics.jsonl")
        if headline:
            write_reward_curve(out / "reward_curve.svg", records, key=headline[0],
                               title=f"{title}: {headline[0]} per step")
        if spans:
            write_chrome_trace(spans, out / "trace.json")
            write_timeline(out / "timeline.svg", spans, title=f"{title}: {note}", records=records)
    except Exception as e:
        warnings.warn(f"could not write the run's charts to {out} ({type(e).__name__}: {e}); metrics.jsonl "
                      f"has every step", RuntimeWarning, stacklevel=2)
