"""The benchmarks in --quick mode: each writes its section of a temporary performance doc.

The pure ones (padding, scale, the simulated cluster's bound) run without Ray; the others reuse
the session's Ray and data planes (tests/conftest.py) and are marked slow: each starts worker
actors (about 20-40 s apiece on 2 cores).
"""

from __future__ import annotations

import re

import pytest
import torch

from benchmarks import common, sim

pytestmark = pytest.mark.timeout(900)


def table_rows(text: str, name: str, index: int | None = None) -> list[list[str]]:
    """The rows of the markdown tables inside section `name` of `text`, one after another; with
    `index`, of that table only (0: the first)."""
    block = text.split(f"<!-- bench:{name}:start -->")[1].split(f"<!-- bench:{name}:end -->")[0]
    tables: list[list[str]] = []
    last = False
    for ln in block.splitlines():
        row = ln.startswith("|")
        if row and not last:
            tables.append([])
        if row:
            tables[-1].append(ln)
        last = row
    lines = [ln for t in tables for ln in t] if index is None else tables[index] if index < len(tables) else []
    assert len(lines) >= 3, f"section {name} has no table {'' if index is None else index}:\n{block}"
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]


def num(cell: str) -> float:
    return float(cell.replace(",", "").rstrip("%"))


def test_sections_are_replaced_in_place(tmp_path):
    doc = tmp_path / "perf.md"
    t = common.Table(["a", "b"])
    t.add(1, 2.5)
    common.write_section(common.Section("scale", "Scale", "intro", [t], command="x"), doc)
    common.write_section(common.Section("overlap", "Overlap", "first", [t], command="y"), doc)
    common.write_section(common.Section("overlap", "Overlap", "second", [t], command="y"), doc)
    text = doc.read_text()
    assert text.count("<!-- bench:overlap:start -->") == 1 and "second" in text and "first" not in text
    assert text.index("bench:overlap:start") < text.index("bench:scale:start")  # the runner's order
    assert table_rows(text, "scale")[2] == ["1", "2.50"]


@pytest.mark.parametrize("sigma,pools,streaming", [(0.25, 4, False), (1.25, 4, False), (1.25, 2, False),
                                                   (1.25, 4, True), (1.25, 2, True)])
def test_bound_is_below_every_simulated_schedule(sigma, pools, streaming):
    import rlgraph

    plan = rlgraph.compile(sim.pipeline(pools, cpus_per_node=8, streaming=streaming),
                           [f"generate.sigma={sigma}", "data.batch_size=16"])
    assert plan.op("generate").streams == streaming
    for step in range(3):
        jobs = sim.jobs_for_step(plan, step)
        lb = sim.lower_bound(plan, jobs)
        stream, sync = sim.simulate(plan, step, "stream"), sim.simulate(plan, step, "sync")
        assert 0 < lb["critical_path"] <= lb["bound"] and lb["pool_bound"] <= lb["bound"]
        assert lb["bound"] <= stream + 1e-9 and stream <= sync + 1e-9
    # the same draws in every process: lengths depend only on (seed, step, row)
    assert sim.response_length(1, 3, 5, 256, 0.75, 4096) == sim.response_length(1, 3, 5, 256, 0.75, 4096)


def test_padding_and_scale_quick(tmp_path):
    from benchmarks import padding, scale

    doc = tmp_path / "perf.md"
    common.write_section(padding.run(quick=True), doc)
    common.write_section(scale.run(quick=True), doc)
    text = doc.read_text()
    rows = table_rows(text, "padding")
    assert rows[0][:3] == ["dp", "mini-batch (prompts)", "n"] and len(rows) == 2 + 6
    for r in rows[2:]:
        samples, m, padded, pad = num(r[3]), num(r[4]), num(r[5]), num(r[6])
        assert padded == samples + pad and padded % m == 0 and 0 <= pad < m
    rows = table_rows(text, "scale")
    assert rows[0][0] == "ops" and len(rows) == 2 + 4
    assert all(num(r[2]) > 0 and num(r[8]) > 0 for r in rows[2:])
    assert "Reproduce: `.venv/bin/python -m benchmarks.run padding --quick`" in text


def test_bar_chart_writes_svg_and_png_with_a_bar_per_value(tmp_path):
    from benchmarks.charts import bar_chart, bar_chart_figure

    args = ("step time", ["base", "B=32"], {"bound": [1.0, 2.0], "stream": [1.5, float("nan")], "sync": [2.0, 3.0]})
    (ax,) = bar_chart_figure(*args).axes
    assert [round(b.get_height(), 2) for b in ax.patches] == [1.0, 2.0, 1.5, 2.0, 3.0]  # the NaN one left out
    assert [t.get_text() for t in ax.get_xticklabels()] == ["base", "B=32"]
    svg, png = bar_chart(tmp_path / "chart.svg", *args, note="2 steps")
    assert (svg, png) == (tmp_path / "chart.svg", tmp_path / "chart.png")
    assert png.read_bytes().startswith(b"\x89PNG")
    assert all(s in svg.read_text() for s in ("step time", "2 steps", "B=32", "stream"))


@pytest.fixture
def planes(tq_plane, ray_plane):
    common.set_planes(transferqueue=tq_plane, ray=ray_plane)
    yield
    common._planes.clear()  # the session fixtures close them


@pytest.mark.ray
def test_dataplane_quick(tmp_path, planes):
    from benchmarks import dataplane

    doc = tmp_path / "perf.md"
    common.write_section(dataplane.run(quick=True), doc)
    rows = table_rows(doc.read_text(), "dataplane")
    shared = {"TransferQueue + shared memory"} if common.plane("transferqueue").uses_shared_memory() else set()
    assert {r[3] for r in rows[2:]} == shared | {"TransferQueue, bytes only", "Ray object store", "memcpy",
                                                 dataplane.torch_row(), dataplane.FRESH, dataplane.COLD}
    # memcpy is the reference: its own ratios are blank, every other row's are filled in
    assert all((r[8] == "" and r[9] == "") == (r[3] == "memcpy") for r in rows[2:])
    # the copy into memory the cache does not hold, for the columns of 1 MB or more only
    assert {r[2] for r in rows[2:] if r[3] == dataplane.COLD} == {"2,097,152", "2,097,184"}
    assert all(num(r[4]) > 0 and num(r[5]) > 0 for r in rows[2:])


def test_dataplane_memcpy_copies_dense_and_ragged_columns():
    from benchmarks import dataplane

    for kind in ("dense", "ragged"):
        col = dataplane.make_column(kind, 8, 32)
        for copy in (dataplane.copy_plain, dataplane.copy_torch):
            dst = torch.zeros_like(col) if kind == "dense" else [torch.zeros_like(c) for c in col]
            copy(dst, col)
            assert all(torch.equal(d, c) for d, c in zip(dst, col))


def test_rowloops_quick(tmp_path):
    from benchmarks import rowloops

    doc = tmp_path / "perf.md"
    common.write_section(rowloops.run(quick=True), doc)
    rows = table_rows(doc.read_text(), "rowloops")
    assert rows[0] == ["helper", "rows", "per-row loop rows/s", "vectorised rows/s", "speed-up"] and len(rows) == 2 + 7
    assert all(num(r[2]) > 0 and num(r[3]) > 0 for r in rows[2:])


@pytest.mark.ray
@pytest.mark.bench
def test_overhead_quick(tmp_path, planes):
    from benchmarks import overhead

    doc = tmp_path / "perf.md"
    common.write_section(overhead.run(quick=True, svg=tmp_path / "overhead.svg"), doc)
    text = doc.read_text()
    rows = table_rows(text, "overhead")
    points = rows[2:rows.index(["part", "value", "target"])]
    assert rows[0][:2] == ["rows (B x n)", "response tokens"] and len(points) == 3
    assert all(num(r[3]) > 0 and num(r[2]) > 0 for r in points)  # step time, column bytes moved
    assert "fixed per step (ms)" in text and (tmp_path / "overhead.svg").is_file()


@pytest.mark.ray
@pytest.mark.slow
def test_overlap_and_traffic_quick(tmp_path, planes):
    from benchmarks import overlap, traffic

    doc = tmp_path / "perf.md"
    common.write_section(overlap.run(quick=True, svg=tmp_path / "overlap.svg"), doc)
    common.write_section(traffic.run(quick=True), doc)
    text = doc.read_text()
    head, *body = [r for i, r in enumerate(table_rows(text, "overlap")) if i != 1]
    for r in body:
        row = dict(zip(head, r))
        assert num(row["bound s"]) <= num(row["stream s"])  # the bound is a bound
        assert num(row["stream / bound"]) >= 1 and num(row["sync / stream"]) > 0
    assert "<svg" in (tmp_path / "overlap.svg").read_text() and (tmp_path / "overlap.png").stat().st_size > 0
    head, *body = [r for i, r in enumerate(table_rows(text, "traffic")) if i != 1]
    ours, classic = (dict(zip(head, r)) for r in body)
    assert num(ours["driver payload bytes / step"]) == 0
    assert num(classic["driver payload bytes / step"]) >= num(classic["column bytes moved / step"]) / 2
    assert num(ours["driver share of bytes moved"]) < num(classic["driver share of bytes moved"])


@pytest.mark.ray
@pytest.mark.bench  # not in the default run: tests/ops/test_examples_e2e.py covers stream = sync on the examples
def test_real_quick(tmp_path, planes):
    from benchmarks import real

    doc = tmp_path / "perf.md"
    common.write_section(real.run(quick=True), doc)
    head, *body = [r for i, r in enumerate(table_rows(doc.read_text(), "real")) if i != 1]
    row = dict(zip(head, body[0]))
    assert row["example"] == "GRPO" and row["same rewards"] == "yes"
    assert num(row["stream s/step"]) > 0 and num(row["sync s/step"]) > 0
    assert re.match(r"\d", row["sync / stream"])


@pytest.mark.vllm
@pytest.mark.slow
def test_rollout_quick(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed: bash scripts/setup.sh --vllm=cpu")
    from benchmarks import rollout

    doc = tmp_path / "perf.md"
    common.write_section(rollout.run(quick=True), doc)
    head, *body = [r for i, r in enumerate(table_rows(doc.read_text(), "rollout")) if i != 1]
    row = dict(zip(head, body[0]))
    assert num(row["tokens / step"]) > 0
    assert num(row["hf s / step"]) > 0 and num(row["vllm s / step"]) > 0
    assert num(row["hf / vllm"]) == pytest.approx(num(row["hf s / step"]) / num(row["vllm s / step"]), rel=0.05)


@pytest.mark.parametrize("streaming", [False, True])
def test_multi_step_replay_keeps_one_step_results_at_k0_and_bounds_staleness(streaming):
    import rlgraph

    def plan(k):
        return rlgraph.compile(sim.pipeline(4, cpus_per_node=8, streaming=streaming),
                               ["generate.sigma=1.25", "data.batch_size=16", f"trainer.max_staleness={k}"])

    p0 = plan(0)
    for schedule in ("sync", "stream"):  # k=0: steps one after another, each as the one-step replay
        got = sim.simulate_steps(p0, 4, schedule)
        assert got["makespan"] == pytest.approx(sum(sim.simulate(p0, s, schedule) for s in range(4)))
        assert got["staleness"] == [0, 0, 0, 0]
    stream = sim.simulate_steps(p0, 6, "stream")["makespan"]
    k1, k2 = sim.simulate_steps(plan(1), 6, "stream"), sim.simulate_steps(plan(2), 6, "stream")
    assert k1["staleness"] == [0, 1, 1, 1, 1, 1] and k2["staleness"] == [0, 1, 2, 2, 2, 2]
    # more steps in flight never slow the zero-overhead replay down, and here they speed it up
    assert k2["makespan"] <= k1["makespan"] + 1e-9 < stream
    assert 0 <= k1["idle"]["rollout"] < 1


@pytest.mark.ray
@pytest.mark.bench  # not in the default run: tests/runtime/test_async.py covers k=1 on the example
def test_staleness_quick(tmp_path, planes):
    from benchmarks import staleness

    doc = tmp_path / "perf.md"
    common.write_section(staleness.run(quick=True), doc)
    rows = table_rows(doc.read_text(), "staleness")
    head, *body = [r for i, r in enumerate(rows) if i != 1]
    modes = [dict(zip(head, b))["mode"] for b in body if len(b) == len(head)]
    assert modes[:4] == ["sync", "stream", "k=1", "k=2"]


@pytest.mark.ray
@pytest.mark.slow
def test_leaks_quick(tmp_path, planes):
    """The long-run sampler on a few steps: every quantity is measured (non-zero) and tabled."""
    from benchmarks import leaks

    doc = tmp_path / "perf.md"
    common.write_section(leaks.run(quick=True), doc)
    rows = table_rows(doc.read_text(), "leaks")
    head, *body = [r for i, r in enumerate(rows) if i != 1]
    got = {b[0]: dict(zip(head, b)) for b in body[:4]}  # the summary table; the samples follow
    assert set(got) == {"driver resident memory (MiB)", "actors' resident memory, summed (MiB)",
                        "object store used (MiB)", "Ray session directory (MiB)"}
    assert [b[0] for b in body if b[0].isdigit()] == ["2", "4", "6"]  # a sample every 2 steps
    assert num(got["driver resident memory (MiB)"]["after step 6"]) > 50
    assert num(got["actors' resident memory, summed (MiB)"]["after step 6"]) > 100
    assert num(got["Ray session directory (MiB)"]["after step 6"]) > 0


@pytest.mark.bench  # needs the benchmark extra (TRL): pip install 'rlgraph[bench]'
def test_trl_peer_quick(tmp_path):
    """rlgraph against TRL on a few steps: both trainers (rlgraph also with a reward pool and unfused) and the
    async example run and are tabled, each phase against TRL's."""
    pytest.importorskip("trl")
    from benchmarks import trl_peer

    doc = tmp_path / "perf.md"
    common.write_section(trl_peer.run(quick=True), doc)
    rows = table_rows(doc.read_text(), "trl")
    head, *body = [r for i, r in enumerate(rows) if i != 1]
    got = {dict(zip(head, b))["trainer"]: dict(zip(head, b)) for b in body if len(b) == len(head)}
    assert set(got) == {"rlgraph", "rlgraph, reward pool", "rlgraph, unfused", "rlgraph async k=1", "TRL"}
    assert num(got["TRL"]["vs TRL"]) == 1.0 and all(num(r["s/step (median)"]) > 0 for r in got.values())
    rows = table_rows(doc.read_text(), "trl", 1)
    head, *body = [r for i, r in enumerate(rows) if i != 1]
    assert head[-1] == "rlgraph vs TRL" and {b[1] for b in body} == set(trl_peer.ROWS)
    trl = {b[1]: num(b[4]) for b in body}
    # TRL's decode is timed apart: it adds to its reward and comes out of its generation (medians of steps)
    assert trl[trl_peer.WITH_DECODE] > trl["reward"] > 0 and 0 < trl[trl_peer.NO_DECODE] < trl["generate"]


@pytest.mark.bench
def test_startup_quick(tmp_path):
    """Start-up of the GRPO example, as it is, with TQ's storage unit and the data source in processes of
    their own, with tensordict imported as it is, with transformers' import table scanned in each process
    and with Ray started as it is: every phase tabled."""
    from benchmarks import startup

    doc = tmp_path / "perf.md"
    common.write_section(startup.run(quick=True), doc)
    rows = table_rows(doc.read_text(), "startup", 0)
    head, *body = [r for i, r in enumerate(rows) if i != 1]
    assert head[1:] == ["rlgraph", "unit and source on their own", "tensordict as it is",
                        "transformers' table scanned", "Ray as it is"]
    got = {b[0]: [num(c) for c in b[1:]] for b in body}
    assert len(got) == 7 and all(v > 0 for vs in got.values() for v in vs)
    assert got["start-up to the first step (s)"][0] < got["wall to step 0's end (s)"][0]
    # the CPU by process: the driver, the policy's worker (every op of the example runs on it), TransferQueue's
    # controller hosting the unit and the source (neither has a process of its own), Ray's own
    head, *body = [r for i, r in enumerate(table_rows(doc.read_text(), "startup", 1)) if i != 1]
    procs = {b[0]: (num(b[1]), num(b[2])) for b in body}
    assert procs["driver (rlgraph run)"][0] == 1 and procs["policy worker"][0] == 1
    assert procs["TransferQueue controller (and the unit and the source it hosts)"][0] == 1
    assert "data source" not in procs and "TransferQueue storage unit" not in procs
    assert all(cpu > 0 for _, cpu in procs.values())
    assert sum(cpu for _, cpu in procs.values()) <= 1.05 * got["CPU seconds, all processes, to step 0's end"][0]


@pytest.mark.bench
def test_logprob_memory_and_packing_quick(tmp_path):
    """The chunked log-prob path uses less memory than the full logits, and packing computes fewer tokens
    with the same loss: both measured in fresh processes and tabled."""
    from benchmarks import logprob_memory, packing

    doc = tmp_path / "perf.md"
    common.write_section(logprob_memory.run(quick=True), doc)
    common.write_section(packing.run(quick=True), doc)
    rows = table_rows(doc.read_text(), "logprob_memory")
    head, *body = [r for i, r in enumerate(rows) if i != 1]
    assert [b[0] for b in body] == ["64", "256"]
    assert all(num(dict(zip(head, b))["chunked peak MiB"]) > 0 for b in body)
    last = dict(zip(head, body[-1]))
    assert num(last["full logits peak MiB"]) > num(last["chunked peak MiB"])
    rows = table_rows(doc.read_text(), "packing")
    head, *body = [r for i, r in enumerate(rows) if i != 1]
    got = {b[0]: dict(zip(head, b)) for b in body}
    assert num(got["packed"]["tokens computed"]) == num(got["packed"]["real tokens"]) < num(
        got["padded"]["tokens computed"])
    assert got["packed"]["loss"] == got["padded"]["loss"]


@pytest.mark.ray
@pytest.mark.bench
def test_real_shape_quick(tmp_path, planes):
    """The 0.5B-shape example (cut to 2 layers, same width and vocabulary) runs with the engine options
    off and on; every part of the step breakdown and every worker's peak memory is tabled."""
    from benchmarks import real_shape

    doc = tmp_path / "perf.md"
    common.write_section(real_shape.run(quick=True), doc)
    rows = table_rows(doc.read_text(), "real_shape")
    head, *body = [r for i, r in enumerate(rows) if i != 1]
    assert len(body) == 3 and all(num(dict(zip(head, b))["step s"]) > 0 for b in body)
    sharded = dict(zip(head, body[2]))
    assert "actor_0" in sharded["peak MiB per worker"] and "actor_1" in sharded["peak MiB per worker"]
