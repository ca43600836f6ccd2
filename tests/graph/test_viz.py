"""Drawing: one node per op, labelled edges, barrier and state marks, deterministic output."""

from __future__ import annotations

import shutil
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import pytest

import rlgraph
from rlgraph.errors import RLGraphError
from rlgraph.graph import viz
from rlgraph.graph.compile import compile_pipeline
from rlgraph.graph.loader import load_pipeline
from rlgraph.graph.plan import Plan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SVG = "{http://www.w3.org/2000/svg}"

needs_dot = pytest.mark.skipif(
    shutil.which("dot") is None, reason="Graphviz `dot` is not installed (bash scripts/setup.sh)"
)


def _pipeline(name: str):
    # the examples with fixed configs (tests/resources/pinned.py): their tuned defaults may change
    pipeline, _ = load_pipeline(str(EXAMPLES.parent / "tests" / "resources" / f"{name}_pinned.py"))
    return pipeline


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    return {name: compile_pipeline(_pipeline(name)) for name in ("ppo", "grpo")}


@pytest.fixture(scope="module")
def svgs(plans, tmp_path_factory) -> dict[str, ET.Element]:
    if shutil.which("dot") is None:
        pytest.skip("Graphviz `dot` is not installed (bash scripts/setup.sh)")
    out = tmp_path_factory.mktemp("svg")
    return {
        name: ET.parse(viz.write_svg(plan, out / f"{name}.svg")).getroot() for name, plan in plans.items()
    }


def _groups(root: ET.Element, cls: str) -> dict[str, ET.Element]:
    """<g class=cls> elements by their <title> (graphviz writes 'a->b' for edges, 'a:e->b:e' for an
    edge with ports: the port is dropped here)."""
    found = {}
    for g in root.iter(f"{SVG}g"):
        if g.get("class") == cls:
            title = "->".join(end.split(":")[0] for end in g.find(f"{SVG}title").text.split("->"))
            assert title not in found, f"two SVG {cls}s titled {title!r}"
            found[title] = g
    return found


def _texts(g: ET.Element) -> list[str]:
    return [t.text for t in g.iter(f"{SVG}text") if t.text]


def _pairs(plan: Plan) -> dict[tuple[str, str, str], set[str]]:
    pairs: dict[tuple[str, str, str], set[str]] = defaultdict(set)
    for e in plan.edges:
        pairs[(e.src, e.dst, e.kind)].add(e.column)
    return pairs


# -- nodes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_one_node_per_op_plus_the_data_source(plans, svgs, name):
    nodes = _groups(svgs[name], "node")
    assert sorted(nodes) == sorted([o.name for o in plans[name].ops] + ["data"])


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_op_labels_give_group_dp_and_mode(plans, svgs, name):
    nodes = _groups(svgs[name], "node")
    for o in plans[name].ops:
        text = " ".join(_texts(nodes[o.name]))
        assert o.name in text
        assert f"{o.group} (dp {o.batching.dp})" in text
        assert f"{o.mode}:" in text


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_barrier_ops_have_a_double_border_and_say_barrier(plans, svgs, name):
    plan = plans[name]
    nodes = _groups(svgs[name], "node")
    assert plan.schedule.barriers, "the example should have a barrier op"
    for o in plan.ops:
        g = nodes[o.name]
        barrier = o.name in plan.schedule.barriers
        assert any("barrier" in t for t in _texts(g)) == barrier, o.name
        assert (len(list(g.iter(f"{SVG}polygon"))) == 2) == barrier, o.name


def test_nodes_are_coloured_by_sorted_worker_group(plans, svgs):
    plan = plans["ppo"]
    nodes = _groups(svgs["ppo"], "node")
    names = sorted(g.name for g in plan.groups)
    assert names == ["actor", "advantage", "critic", "reward"]
    for o in plan.ops:
        shapes = [e for e in nodes[o.name].iter() if e.tag in (f"{SVG}polygon", f"{SVG}path")]
        fills = {e.get("fill") for e in shapes} - {"none"}
        assert fills == {viz.PALETTE[names.index(o.group)]}, o.name
    # ops of one group share a colour, different groups differ
    assert viz._colours(plan)["actor"] != viz._colours(plan)["critic"]


def test_legend_and_title_show_groups_and_padding(plans, svgs):
    plan = plans["ppo"]
    graph = next(g for g in svgs["ppo"].iter(f"{SVG}g") if g.get("class") == "graph")
    # the title and legend are the graph's own text, outside any node or edge
    title = [t.text for t in graph.findall(f"{SVG}text") if t.text]
    assert title[0] == "ppo"
    assert f"padded batch {plan.batch.padded_batch}" in title[1]
    assert f"padding multiple {plan.batch.multiple}" in title[1]
    for g in plan.groups:
        assert any(t.startswith(f"{g.name}: dp {g.dp}, pool {g.pool}") for t in title), g.name


def test_pruned_outputs_are_listed_greyed(svgs):
    node = _groups(svgs["ppo"], "node")["old_logprob"]
    pruned = [t for t in node.iter(f"{SVG}text") if t.text == "pruned: entropy"]
    assert len(pruned) == 1 and pruned[0].get("fill") == viz._PRUNED


def test_batched_ops_and_left_out_forwards_are_drawn():
    plan = compile_pipeline(_pipeline("grpo"), ["actor.mini_batch_size=8"])  # one optimizer step per step
    root = ET.fromstring(viz.render(plan, "svg"))
    nodes = _groups(root, "node")
    assert "old_logprob" not in nodes
    batched = {name for name, g in nodes.items() if "ready chunks batched: one call per rank" in _texts(g)}
    # the advantage rides in the reward's calls (a fused chain), never dispatched, so never batched
    assert batched == {o.name for o in plan.ops if plan.batches_calls(o.name)} == {"reward"}
    title = " ".join(t.text or "" for t in root.iter(f"{SVG}text"))
    assert "left out: old_logprob (its 'old_log_probs' is update_actor's own first forward" in title


def test_a_fused_chain_is_drawn_in_its_own_colour():
    plan = compile_pipeline(_pipeline("ppo"))
    root = ET.fromstring(viz.render(plan, "svg"))
    title = " ".join(t.text or "" for t in root.iter(f"{SVG}text"))
    assert "brown: a fused chain, one dispatched call per chunk" in title
    edges = _groups(root, "edge")
    brown = {name for name, g in edges.items() if any(p.get("stroke") == viz._FUSED for p in g.iter(f"{SVG}path"))}
    assert brown == {"generate->ref"}  # generate->old_logprob is on the critical path: red wins
    nodes = _groups(root, "node")
    assert "fused: its calls run old_logprob, ref too" in _texts(nodes["generate"])
    assert all("fused: runs inside generate's calls" in _texts(nodes[n]) for n in ("old_logprob", "ref"))
    assert not any("fused" in t for n in ("reward", "values", "update_actor") for t in _texts(nodes[n]))
    unfused = viz.render(compile_pipeline(_pipeline("ppo"), ["trainer.fuse_ops=false"]), "svg").decode()
    assert viz._FUSED not in unfused and "fused" not in unfused


# -- edges ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_one_edge_per_producer_consumer_labelled_with_all_its_columns(plans, svgs, name):
    edges = _groups(svgs[name], "edge")
    pairs = _pairs(plans[name])
    assert sorted(edges) == sorted(f"{u}->{v}" for u, v, _ in pairs)
    for (u, v, _), columns in pairs.items():
        assert columns <= set(_texts(edges[f"{u}->{v}"])), (u, v)


def test_ppo_generate_to_reward_carries_responses(svgs):
    texts = _texts(_groups(svgs["ppo"], "edge")["generate->reward"])
    assert {"responses", "response_mask"} <= set(texts)


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_state_edges_are_dashed_and_do_not_constrain_the_layout(plans, svgs, name):
    edges = _groups(svgs[name], "edge")
    update = _groups(svgs[name], "edge")["update_actor->generate"]
    assert "policy_weights" in _texts(update)
    for (u, v, kind) in _pairs(plans[name]):
        dashed = [p.get("stroke-dasharray") for p in edges[f"{u}->{v}"].iter(f"{SVG}path")]
        assert bool(dashed[0]) == (kind == "state"), (u, v)
    source = viz.dot_source(plans[name])
    state_lines = [line for line in source.splitlines() if "style=dashed" in line]
    assert state_lines and all("constraint=false" in line for line in state_lines)
    assert any(line.lstrip().startswith("update_actor -> generate") for line in state_lines)


def test_critical_path_edges_are_bold(plans, svgs):
    plan = plans["ppo"]
    path = plan.schedule.critical_path
    assert path == ["data", "generate", "old_logprob", "advantage", "update_actor"]
    on_path = {f"{u}->{v}" for u, v in zip(path, path[1:])}
    for title, g in _groups(svgs["ppo"], "edge").items():
        width = g.find(f".//{SVG}path").get("stroke-width")
        assert (width == "2.6") == (title in on_path), title


def _label_boxes(ops: list[dict]) -> list[tuple[float, float, float, float]]:
    """(x0, y0, x1, y1) of each text line an xdot draw list writes (y up, baseline y)."""
    boxes, size = [], 9.0
    for op in ops:
        if op["op"] == "F":
            size = op["size"]
        elif op["op"] == "T":
            (x, y), w = op["pt"], op["width"]
            x0 = {"l": x, "c": x - w / 2, "r": x - w}[op["align"]]
            boxes.append((x0, y - 0.2 * size, x0 + w, y + 0.75 * size))
    return boxes


def _curve(ops: list[dict], n: int = 40) -> list[tuple[float, float]]:
    """Points along the cubic Bezier pieces of an edge's draw list."""
    pts = []
    for op in ops:
        if op["op"] in ("b", "B"):
            p = op["points"]
            for i in range(0, len(p) - 3, 3):
                a, b, c, d = p[i:i + 4]
                for k in range(n + 1):
                    t = k / n
                    pts.append(tuple((1 - t) ** 3 * a[j] + 3 * (1 - t) ** 2 * t * b[j] + 3 * (1 - t) * t * t * c[j]
                                     + t ** 3 * d[j] for j in range(2)))
    return pts


@needs_dot
@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_no_edge_crosses_an_edge_label(plans, name):
    # long edges used to run through their own labels (and PPO's two long edges on the left through
    # each other's); Graphviz's layout, read back as JSON, says where every label line and edge lies
    import json
    import subprocess

    out = subprocess.run(["dot", "-Tjson"], input=viz.dot_source(plans[name]).encode(), capture_output=True,
                         check=True).stdout
    layout = json.loads(out)
    names = {o["_gvid"]: o["name"] for o in layout["objects"]}
    edges = layout["edges"]
    crossed = []
    for e in edges:
        boxes = _label_boxes(e.get("_ldraw_", []))
        assert boxes, "every edge is labelled"
        for f in edges:
            if any(x0 < x < x1 and y0 < y < y1 for x, y in _curve(f["_draw_"]) for x0, y0, x1, y1 in boxes):
                crossed.append(f"{names[f['tail']]}->{names[f['head']]} crosses the label of "
                               f"{names[e['tail']]}->{names[e['head']]}")
    assert crossed == []


def test_a_pruned_column_on_an_edge_is_greyed():
    # a compiled plan never routes a pruned column, but a hand-edited one may: mark it, don't hide it
    plan = compile_pipeline(_pipeline("ppo"))
    cols = dict(plan.columns)
    cols["responses"] = cols["responses"].model_copy(update={"stored": False})
    source = viz.dot_source(plan.model_copy(update={"columns": cols}))
    assert f'<FONT COLOR="{viz._PRUNED}">responses (pruned)</FONT>' in source


# -- output --------------------------------------------------------------------------------------


@needs_dot
@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_rendering_is_deterministic(plans, tmp_path, name):
    a = viz.write_svg(plans[name], tmp_path / "a.svg").read_bytes()
    b = viz.write_svg(compile_pipeline(_pipeline(name)), tmp_path / "b.svg").read_bytes()
    assert a == b
    assert b"Generated by graphviz" not in a


@needs_dot
def test_format_comes_from_the_extension(plans, tmp_path):
    plan = plans["grpo"]
    assert viz.write_svg(plan, tmp_path / "g.png").read_bytes().startswith(b"\x89PNG")
    assert viz.write_svg(plan, tmp_path / "g.pdf").read_bytes().startswith(b"%PDF")
    assert viz.write_svg(plan, tmp_path / "sub" / "g.svg").read_bytes().lstrip().startswith(b"<?xml")


def test_dot_file_needs_no_binary(plans, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "")
    path = viz.write_svg(plans["ppo"], tmp_path / "ppo.dot")
    assert path.read_text() == viz.dot_source(plans["ppo"])
    assert path.read_text().startswith("digraph ppo {")


def test_missing_dot_binary_says_how_to_install(plans, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "")
    with pytest.raises(viz.MissingDependencyError, match=r"apt-get install graphviz.*scripts/setup\.sh"):
        viz.write_svg(plans["ppo"], tmp_path / "ppo.svg")
    assert not (tmp_path / "ppo.svg").exists()


def test_missing_graphviz_package_says_how_to_install(plans, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "graphviz", None)  # makes `import graphviz` raise ImportError
    with pytest.raises(viz.MissingDependencyError, match=r"pip install graphviz") as info:
        viz.write_svg(plans["ppo"], tmp_path / "ppo.dot")
    assert isinstance(info.value, RLGraphError)


def test_unknown_extension_is_refused(plans, tmp_path):
    with pytest.raises(viz.VizError, match=r"'.*pipeline\.jpeg'.*\.svg, \.png, \.pdf or \.dot"):
        viz.write_svg(plans["ppo"], tmp_path / "pipeline.jpeg")
    with pytest.raises(viz.VizError, match=r"format 'gif'; use one of svg, png, pdf, dot"):
        viz.render(plans["ppo"], "gif")


# -- visualize -----------------------------------------------------------------------------------


def test_visualize_compiles_a_pipeline_with_overrides(tmp_path):
    path = rlgraph.visualize(_pipeline("ppo"), tmp_path / "ppo.dot", ["data.batch_size=45"])
    assert path == tmp_path / "ppo.dot"
    # 45 prompts x n=4 = 180 samples, padded to a multiple of 16 -> 192
    assert "padded batch 192 = 180 samples + 12 padding" in path.read_text()


def test_visualize_draws_a_plan(plans, tmp_path):
    path = viz.visualize(plans["grpo"], tmp_path / "grpo.dot")
    assert path.read_text() == viz.dot_source(plans["grpo"])


def test_visualize_refuses_overrides_for_a_compiled_plan(plans, tmp_path):
    with pytest.raises(viz.VizError, match=r"'ppo' is already a compiled plan; pass the Pipeline"):
        viz.visualize(plans["ppo"], tmp_path / "ppo.dot", ["data.batch_size=45"])


def test_visualize_refuses_other_objects(tmp_path):
    with pytest.raises(viz.VizError, match=r"a Pipeline or a Plan, not str; .*load_plan"):
        viz.visualize("examples/ppo.py", tmp_path / "ppo.dot")
