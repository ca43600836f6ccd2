"""The run's charts (matplotlib, no Ray): the reward curve and the timeline, read back from the Figure."""

from __future__ import annotations

import pytest

from rlgraph.runtime import plots
from rlgraph.runtime.trace import Span


def _records(values, key="score/mean"):
    return [{"step": k, key: v} for k, v in enumerate(values)]


def _spans(steps: int, step_s: float = 1.0) -> list[Span]:
    """Per step: generate on actor[0] and actor[1] (streaming, two parts each), then reward, then update."""
    out = []
    for k in range(steps):
        t = 100.0 + k * step_s
        for r in range(2):
            out.append(Span("generate", "actor", r, k, r, 4, t, t + 0.5 * step_s,
                            parts=((t + 0.25 * step_s, 2), (t + 0.5 * step_s, 2))))
        out.append(Span("reward", "reward", 0, k, 0, 8, t + 0.5 * step_s, t + 0.7 * step_s))
        out.append(Span("update", "actor", 0, k, 0, 8, t + 0.7 * step_s, t + 0.95 * step_s))
    return out


def _visible_xtick_labels(ax):
    ax.figure.draw_without_rendering()  # tick labels are formatted when drawn
    lo, hi = sorted(ax.get_xlim())
    return [t.get_text() for t, x in zip(ax.get_xticklabels(), ax.get_xticks()) if lo <= x <= hi]


# -- reward curve ------------------------------------------------------------------------------------


def test_a_2_step_curve_has_one_tick_per_step(tmp_path):
    fig = plots.reward_curve_figure(_records([0.25, 0.5]), "score/mean")
    # the hand-written chart put 6 ticks on 2 steps and labelled them 0,0,0,1,1,1
    assert _visible_xtick_labels(fig.axes[0]) == ["0", "1"]


def test_the_curve_draws_the_raw_values_and_their_moving_average():
    values = [float(v) for v in range(12)]
    raw, avg = plots.reward_curve_figure(_records(values), "score/mean").axes[0].get_lines()
    assert list(raw.get_ydata()) == values
    # a 10-step window: step 0 is itself, step 1 the mean of 0 and 1, step 11 the mean of 2..11
    assert list(avg.get_ydata())[:2] == [0.0, 0.5] and avg.get_ydata()[11] == pytest.approx(6.5)
    assert avg.get_label() == "10-step moving average"
    # a run shorter than the window averages over all of its steps
    _, avg = plots.reward_curve_figure(_records([1.0, 2.0, 6.0]), "score/mean").axes[0].get_lines()
    assert avg.get_label() == "3-step moving average" and avg.get_ydata()[2] == pytest.approx(3.0)


def test_a_1_step_run_plots_a_dot_at_its_step():
    fig = plots.reward_curve_figure(_records([0.4]), "score/mean")
    raw, avg = fig.axes[0].get_lines()
    assert list(raw.get_xdata()) == [0] and raw.get_marker() == "o"
    assert _visible_xtick_labels(fig.axes[0]) == ["0"]


def test_write_reward_curve_writes_svg_and_png(tmp_path):
    records = _records([0.1, 0.3, 0.2]) + [{"step": 3, "other": 1.0}]  # a step without the key is skipped
    svg, png = plots.write_reward_curve(tmp_path / "reward_curve.svg", records, "score/mean", title="grpo: score")
    assert (svg, png) == (tmp_path / "reward_curve.svg", tmp_path / "reward_curve.png")
    assert png.read_bytes().startswith(b"\x89PNG")
    text = svg.read_text()
    assert "<svg" in text and "grpo: score" in text  # text stays text
    # the same data gives the same file
    again, _ = plots.write_reward_curve(tmp_path / "again", records, "score/mean", title="grpo: score")
    assert again == tmp_path / "again.svg" and again.read_text() == text


def test_no_record_with_the_key_writes_nothing(tmp_path):
    assert plots.write_reward_curve(tmp_path / "reward_curve.svg", _records([1.0]), "acc/mean") is None
    assert list(tmp_path.iterdir()) == []


# -- timeline ----------------------------------------------------------------------------------------


def _boundaries(ax):
    return sorted(line.get_xdata()[0] for line in ax.get_lines() if line.get_gid() == plots.STEP_BOUNDARY)


def test_a_short_run_has_one_panel_with_a_lane_per_worker_and_step_boundaries():
    fig = plots.timeline_figure(_spans(2), title="ppo: stream schedule")
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["actor[0]", "actor[1]", "reward[0]"]
    # where step 0 and step 1 start, and where the last call ends (seconds since the first call)
    assert _boundaries(ax) == pytest.approx([0.0, 1.0, 1.95])
    # one box collection per (op, lane): generate on both actor ranks, update on rank 0, reward;
    # then the ticks where generate handed over its parts: 2 per call
    *boxes, ticks = ax.collections
    assert len(boxes) == 4 and len(ticks.get_segments()) == 2 * 2 * 2
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["generate", "reward", "update"]  # the order the ops first ran


def test_a_long_run_shows_a_whole_run_summary_and_the_last_steps_in_detail():
    fig = plots.timeline_figure(_spans(50), title="ppo")
    summary, detail = fig.axes
    # detail: the calls of the last DETAIL_STEPS steps only, each step's start marked
    assert _boundaries(detail) == pytest.approx([0.0, 1.0, 2.0, 3.0, 3.95])
    assert {t.get_text() for t in detail.texts if t.get_text().startswith("step ")} == \
        {f"step {k}" for k in range(46, 50)}
    # summary: one line per op and one for the step's wall time, a point per step
    lines = {line.get_label(): line for line in summary.get_lines()}
    assert set(lines) == {"generate", "reward", "update", "step (wall time)"}
    assert list(lines["generate"].get_xdata()) == list(range(50))
    assert lines["reward"].get_ydata() == pytest.approx([0.2] * 50)
    assert lines["step (wall time)"].get_ydata() == pytest.approx([0.95] * 50)


def test_the_summary_covers_every_step_in_the_metrics_records():
    # the driver keeps the spans of the latest steps; metrics.jsonl has every step's op timings
    records = [{"step": k, "timing/gen/span_s": 2.0, "timing/gen/busy_s": 3.0, "timing/step_s": 2.5,
                "timing/idle/actor_s": 0.1} for k in range(100)]
    fig = plots.timeline_figure(_spans(3), records=records)
    summary, detail = fig.axes
    lines = {line.get_label(): line for line in summary.get_lines()}
    assert set(lines) == {"gen", "step (wall time)"}
    assert list(lines["gen"].get_xdata()) == list(range(100)) and lines["gen"].get_ydata()[0] == 2.0
    assert len(_boundaries(detail)) == 3 + 1  # the 3 traced steps, all of them in detail


def test_a_very_long_run_is_summarised_in_means_over_several_steps():
    records = [{"step": k, "timing/gen/span_s": float(k % 3), "timing/step_s": 1.0} for k in range(2500)]
    summary, _ = plots.timeline_figure(_spans(1), records=records).axes
    gen = next(line for line in summary.get_lines() if line.get_label() == "gen")
    # at most SUMMARY_POINTS points: means over ceil(2500 / 1000) = 3 steps, each 0, 1, 2 -> 1
    assert len(gen.get_xdata()) == 834 and gen.get_xdata()[0] == 1.0 and gen.get_ydata()[0] == 1.0
    assert summary.get_title(loc="left").endswith("2500 steps, means over 3 steps")


def test_write_timeline_writes_svg_and_png(tmp_path):
    svg, png = plots.write_timeline(tmp_path / "timeline.svg", _spans(12), title="ppo: stream")
    assert png.read_bytes().startswith(b"\x89PNG") and png.stat().st_size > 1000
    text = svg.read_text()
    assert "actor[1]" in text and "generate" in text and "step 11" in text
    assert text.count(f'id="{plots.STEP_BOUNDARY}') == plots.DETAIL_STEPS + 1


def test_save_takes_a_stem_or_either_extension(tmp_path):
    fig = plots.new_figure(2, 2)
    for name in ("a", "a.svg", "a.png"):
        assert plots.save(fig, tmp_path / name) == (tmp_path / "a.svg", tmp_path / "a.png")


def test_a_call_s_result_crosses_to_the_driver_without_its_empty_fields():
    import pickle

    from rlgraph.runtime.worker import CallResult

    bare = Span("ref", "actor", 0, 3, 1, 8, 1.0, 2.0)
    full = Span("ref", "actor", 0, 3, 1, 8, 1.0, 2.0, parts=((1.5, 4),), io_s=0.25, fused_into="generate")
    for span in (bare, full):
        assert pickle.loads(pickle.dumps(span)) == span
    result = CallResult(span=bare, metrics=[{"loss": 1.0}], fused=[CallResult(span=full)])
    back = pickle.loads(pickle.dumps(result))
    assert back == result and back.summaries == {} and back.fused[0].span.fused_into == "generate"
    # the empty fields are left out: a bare span pickles smaller than one that fills them
    assert "fused_into" not in pickle.loads(pickle.dumps(bare)).__getstate__()
    assert len(pickle.dumps(bare)) < len(pickle.dumps(full)) - 40
    back.summaries["c"] = {0: 1.0}  # a default filled in on load is the result's own, not shared
    assert CallResult(span=bare).summaries == {}
