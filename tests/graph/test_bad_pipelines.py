"""Every way a pipeline can be wrong, one fixture module each (tests/resources/bad_pipelines/).

A fixture whose problem the checker finds is listed in `CHECKED` with the problem codes, a regex
the error must match (naming the op, column, group or key with quotes) and a regex for the fix.
A fixture that fails while it is imported (a wrong declaration) is listed in `AT_IMPORT`.
Every file in the folder must be in one of the two tables.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import rlgraph
from rlgraph.errors import ConfigError, DeclarationError, PipelineError, PipelineLoadError
from rlgraph.graph import check as check_module
from rlgraph.graph.loader import load_pipeline

BAD = Path(__file__).resolve().parents[1] / "resources" / "bad_pipelines"


@dataclass(frozen=True)
class Checked:
    fixture: str
    codes: tuple[str, ...]  # exactly these problems, in any order
    names: tuple[str, ...]  # the culprits; each must appear in the error as repr(name)
    message: str  # regex the error text must match
    fix: str  # regex some problem's fix must match


@dataclass(frozen=True)
class AtImport:
    fixture: str
    error: type[Exception]
    message: str


CHECKED = [
    Checked("missing_column", ("column-missing",), ("update", "scroe"),
            r"op 'update' reads column 'scroe'.*did you mean 'score'\?", r"add an op that outputs 'scroe'"),
    Checked("duplicate_producer", ("column-duplicate-producer",), ("score", "judge_length", "judge_format"),
            r"column 'score' is produced by 2 nodes: 'judge_length', 'judge_format'",
            r"rename one of the outputs"),
    Checked("cycle", ("cycle",), ("draft", "critique"),
            r"dependency cycle ('critique' -> 'draft' -> 'critique'|'draft' -> 'critique' -> 'draft')",
            r"declare the column as state"),
    Checked("dtype_mismatch", ("column-type-mismatch",), ("score", "judge", "update"),
            r"column 'score': 'judge' writes float32\[\] but 'update' reads int64\[\] \(dtype float32 vs int64\)",
            r"same dtype and shape on both sides"),
    Checked("shape_mismatch", ("column-type-mismatch",), ("token_scores", "judge", "update"),
            r"column 'token_scores'.*dimension 0 is 'response_len' in the producer but 'prompt_len' in the consumer",
            r"same dtype and shape"),
    Checked("state_read_as_data", ("column-kind-mismatch",), ("judge", "w", "update"),
            r"op 'judge' reads column 'w' as this step's data, but 'update' writes it as cross-step state",
            r"declare the input 'w' of 'judge' as state, `w: T\.float32\(\.\.\.\)\.state\(\)`"),
    Checked("pool_unknown", ("pool-unknown",), ("reward", "actr"),
            r"worker group 'reward' names pool 'actr', which is no worker group's name and no other group's pool "
            r"\(did you mean 'actor'\?\)", r"groups\.reward\.pool=<group>, one of: actor"),
    Checked("unknown_config_key", ("config-unknown-key",), ("judge.scael",),
            r"the pipeline's config sets unknown config key 'judge.scael'", r"did you mean 'judge.scale'\?"),
    Checked("mistyped_config", ("config-type",), ("data.batch_size",),
            r"config key 'data.batch_size' in the pipeline: expected int, got str '8'",
            r"give 'data.batch_size' a value of type int"),
    Checked("granularity_conflict", ("granularity",), ("penalize", "kl_coef", "controller"),
            r"op 'penalize' runs per sample but reads column 'kl_coef', which 'controller' produces once for "
            r"the whole batch", r"make 'penalize' granularity='batch'"),
    Checked("too_many_gpus", ("resources",), ("rollout",),
            # dp=4 x 1 GPU = 4 needed; 1 node x 2 GPUs = 2 available
            r"worker group 'rollout' needs 4 GPUs \(dp=4 x 1\) but the cluster has 2 \(1 node\(s\) x 2\)",
            r"lower groups\.rollout\.dp or groups\.rollout\.num_gpus"),
    Checked("too_many_cpus", ("resources",), ("rollout",),
            # dp=3 x 4 CPUs = 12 needed; 1 node x 8 CPUs = 8 available
            r"worker group 'rollout' needs 12 CPUs \(dp=3 x 4\) but the cluster has 8 \(1 node\(s\) x 8\)",
            r"groups\.rollout\.num_cpus.*cluster\.cpus_per_node"),
    Checked("worker_larger_than_node", ("resources",), ("rollout",),
            r"worker group 'rollout' needs 6 CPUs per worker but a node has 4",
            r"lower groups\.rollout\.num_cpus to at most 4"),
    Checked("placement_fails", ("placement",), ("rollout",),
            # node 0: 4 - 2.5 = 1.5 left; node 1: 4 - 2.5 = 1.5 left; slot 2 (2.5 CPUs) fits nowhere
            r"1 worker slot\(s\) do not fit on the cluster's 2 node\(s\) of 4 CPU / 0 GPU .*"
            r"pool 'rollout' slot 2 \(2\.5 CPU, 0 GPU\)", r"raise cluster\.num_nodes"),
    Checked("dataplane_too_large", ("resources",), (),
            # 1 CPU x (1 controller + 3 storage units) = 4 > 1 node x 2 CPUs
            r"the data plane reserves 4 CPUs .* but the cluster has 2", r"lower dataplane\.storage_units"),
    Checked("no_group", ("op-no-group",), ("update",),
            r"op 'update' has no worker group", r"pass group=\.\.\. to op 'update' naming one of: workers"),
    Checked("unknown_group", ("op-unknown-group",), ("update", "worker"),
            r"op 'update' names worker group 'worker', which is not declared \(did you mean 'workers'\?\)",
            r"add WorkerGroup\('worker', \.\.\.\)"),
    Checked("duplicate_op", ("op-duplicate",), ("judge",), r"2 ops are named 'judge'", r"give each op a unique name"),
    Checked("op_named_like_source", ("op-duplicate",), ("data",),
            r"op 'data' has the same name as the data source", r"rename op 'data'"),
    Checked("duplicate_group", ("group-duplicate",), ("workers",),
            r"worker group 'workers' is declared 2 times", r"declare each worker group once"),
    Checked("unused_group", ("group-unused",), ("critic",),
            r"worker group 'critic' runs no op", r"remove worker group 'critic' or assign an op to it"),
    Checked("op_unused", ("op-unused",), ("judge", "score"),
            r"op 'judge' produces only columns nobody reads \('score'\)", r"remove op 'judge'"),
    Checked("output_missing", ("output-missing",), ("scores",),
            r"pipeline output 'scores' is produced by nothing \(did you mean 'score'\?\)",
            r"remove 'scores' from outputs="),
    Checked("summary_bad_column", ("summary-column", "summary-column", "summary-column"), ("scores", "verdict"),
            r"summaries names column 'scores' \(metric 'score'\), which nothing produces \(did you mean 'score'\?\)"
            r"(.|\n)*column 'verdict' \(metric 'score'\), which is str(.|\n)*2 summaries are named 'score'",
            r"summarise a per-sample numeric data column"),
    Checked("validation_unproduced", ("validation-column", "validation-column"), ("scores", "prompt"),
            r"validation names column 'scores', which no op produces \(did you mean 'score'\?\)"
            r"(.|\n)*validation names column 'prompt', which no op produces",
            r"remove 'scores' from validation="),
    Checked("namespace_clash", ("config-namespace",), ("judge_format", "judge_length", "judge"),
            r"op 'judge_format' and op 'judge_length' both put their params under config namespace 'judge'",
            r"config_key='judge_2'"),
    Checked("group_size_conflict", ("group-size-conflict",), ("sample_short", "sample_long"),
            r"ops 'sample_short', 'sample_long' each define the group size n", r"exactly one op"),
    Checked("batching_not_batch", ("batching-granularity",), ("update",),
            r"op 'update' splits the batch into mini-batches but runs per sample",
            r"declare 'update' with granularity='batch'"),
    Checked("minibatch_too_large", ("mini-batch-too-large",), ("update",),
            # 16 prompts per mini-batch > 8 prompts per step
            r"op 'update': update\.mini_batch_size=16 prompts is larger than data\.batch_size=8",
            r"set update\.mini_batch_size to at most 8"),
    Checked("gae_without_critic", ("op-config",), ("advantage", "gae", "values"),
            r"op 'advantage': algorithm\.estimator='gae' needs critic values, but no op produces 'values'",
            r"add stages\.values\(\) and stages\.update_critic\(\)"),
    Checked("kl_loss_without_ref", ("op-config",), ("update_actor", "ref_log_prob"),
            r"op 'update_actor': actor\.use_kl_loss=true needs column 'ref_log_prob', which no op produces",
            r"add stages\.ref\(\)"),
    Checked("kl_in_reward_without_ref", ("op-config",), ("advantage", "ref_log_prob"),
            r"op 'advantage': algorithm\.use_kl_in_reward=true needs column 'ref_log_prob'",
            r"add stages\.ref\(\)"),
    Checked("estimator_needs_barrier", ("op-config",), ("advantage", "reinforce_plus_plus"),
            r"op 'advantage': algorithm\.estimator='reinforce_plus_plus' whitens over the whole batch, but the "
            r"advantage op runs per group", r"stages\.advantage\('reinforce_plus_plus'\)"),
    Checked("staleness_colocated", ("staleness-colocated",), ("generate", "actor", "update_actor", "policy_weights"),
            r"trainer\.max_staleness=1: op 'generate' would generate with weights up to 1 step\(s\) old, but it runs "
            r"in worker group 'actor' with 'update_actor'", r"stages\.generate\(group='rollout'\)"),
    Checked("staleness_mixed", ("staleness-mixed",), ("generate", "old_logprob", "rollout", "policy_weights"),
            r"ops 'generate' and 'old_logprob' share worker group 'rollout' and read 'policy_weights'",
            r"give 'generate' a worker group of its own"),
    Checked("staleness_unused", ("staleness-unused",), (), r"trainer\.max_staleness=2, but no op may run ahead",
            r"set trainer\.max_staleness=0"),
    Checked("state_unproduced", ("column-missing",), ("judge", "judge_weights"),
            r"op 'judge' reads state column 'judge_weights', which no op and not the data source produces "
            r"\(it would read None at every step\)", r"add an op that outputs 'judge_weights'"),
    Checked("partial_unused", ("partial-unused",), ("generate",),
            r"rollout\.partial=true, but trainer\.max_staleness=0: op 'generate' then always has the newest weights",
            r"set trainer\.max_staleness=1 \(with 'generate' in a worker group of its own\), or rollout\.partial=false"),
    Checked("three_problems", ("column-missing", "op-no-group", "group-unused"), ("update", "scroe", "judge", "critic"),
            r"'three_problems' has 3 problems:", r"remove worker group 'critic'"),
]

AT_IMPORT = [
    AtImport("decl_untyped_input", DeclarationError,
             r"op 'judge': input parameter 'prompt' has no column type; annotate it"),
    AtImport("decl_bad_dtype", DeclarationError, r"unknown dtype 'fp32'; use one of .*float32"),
    AtImport("decl_bad_shape", DeclarationError, r"shape dimension 1\.5 must be an int .* or a str"),
    AtImport("decl_param_without_default", DeclarationError,
             r"op 'judge': config parameter 'scale' needs a default value"),
    AtImport("decl_param_bad_default", DeclarationError,
             r"op 'judge': config parameter 'top_k': .*expected int, got float 0\.5"),
    AtImport("decl_no_outputs", DeclarationError, r"op 'judge' declares no output columns"),
    AtImport("decl_varargs", DeclarationError, r"op 'judge': \*columns / \*\*columns are not allowed"),
    AtImport("decl_unknown_estimator", DeclarationError, r"unknown advantage estimator 'ppo'; use one of gae"),
    AtImport("load_unknown_dtype_attr", PipelineLoadError,
             r"load_unknown_dtype_attr\.py:\d+: AttributeError: T\.float31: unknown dtype"),
]


def _path(fixture: str) -> str:
    return str(BAD / f"{fixture}.py")


@pytest.mark.parametrize("case", CHECKED, ids=lambda c: c.fixture)
def test_checker_reports_the_problem(case: Checked) -> None:
    pipeline, _ = load_pipeline(_path(case.fixture))
    with pytest.raises(PipelineError, match=case.message) as info:
        rlgraph.compile(pipeline)
    err = info.value
    assert sorted(err.codes) == sorted(case.codes), str(err)
    text = str(err)
    for name in case.names:
        assert repr(name) in text, f"{name!r} not named (with quotes) in:\n{text}"
    assert any(re.search(case.fix, p.fix) for p in err.problems), [p.fix for p in err.problems]
    for p in err.problems:
        assert p.fix.strip(), f"problem {p.code} has no fix"
        if p.op:
            assert repr(p.op) in p.message
        if p.column:
            assert repr(p.column) in p.message


@pytest.mark.parametrize("case", AT_IMPORT, ids=lambda c: c.fixture)
def test_wrong_declaration_fails_at_import(case: AtImport) -> None:
    with pytest.raises(case.error, match=case.message):
        load_pipeline(_path(case.fixture))


def test_three_independent_problems_are_reported_in_one_error() -> None:
    pipeline, _ = load_pipeline(_path("three_problems"))
    with pytest.raises(PipelineError) as info:
        rlgraph.compile(pipeline)
    err = info.value
    assert len(err.problems) == 3
    assert set(err.codes) == {"column-missing", "op-no-group", "group-unused"}
    assert str(err).count("fix:") == 3


def test_every_fixture_file_is_in_a_table() -> None:
    files = {p.stem for p in BAD.glob("*.py")}
    listed = [c.fixture for c in CHECKED] + [c.fixture for c in AT_IMPORT]
    assert len(listed) == len(set(listed)), "a fixture is listed twice"
    assert files == set(listed), (
        f"fixtures without a test: {sorted(files - set(listed))}; tests without a fixture: "
        f"{sorted(set(listed) - files)}"
    )


@pytest.mark.parametrize("path", sorted(BAD.glob("*.py")), ids=lambda p: p.stem)
def test_each_fixture_says_what_is_wrong(path: Path) -> None:
    tree = ast.parse(path.read_text())
    assert ast.get_docstring(tree), f"{path.name} has no module docstring"
    assert any(
        isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pipeline" for t in node.targets)
        for node in tree.body
    ), f"{path.name} defines no module-level `pipeline`"


def _documented_codes() -> set[str]:
    """The codes in the reST table of rlgraph.graph.check's docstring (rows after the header)."""
    lines = (check_module.__doc__ or "").splitlines()
    rulers = [i for i, line in enumerate(lines) if line.startswith("=====")]
    rows = lines[rulers[1] + 1:rulers[2]]
    return {m.group(1) for line in rows if (m := re.match(r"([a-z][a-z-]+)\s{2,}", line))}


def test_every_documented_code_has_a_fixture_and_every_reported_code_is_documented() -> None:
    documented = _documented_codes()
    covered = {code for c in CHECKED for code in c.codes}
    assert "placement" in documented and "config-unknown-key" in documented  # the table was parsed
    assert covered == documented, (
        f"documented but never tested: {sorted(documented - covered)}; "
        f"reported but undocumented: {sorted(covered - documented)}"
    )


# Overrides from the command line --------------------------------------------------------------


def _compile_error(pipeline, overrides: list[str]) -> PipelineError:
    with pytest.raises(PipelineError) as info:
        rlgraph.compile(pipeline, overrides)
    return info.value


def test_override_with_unknown_key_suggests_the_close_one(ppo) -> None:
    err = _compile_error(ppo, ["actor.lrr=1"])
    assert err.codes == ["config-unknown-key"]
    (p,) = err.problems
    assert "override actor.lrr=1 sets unknown config key 'actor.lrr'" in p.message
    assert re.search(r"did you mean 'actor\.lr'", p.fix)


def test_override_in_an_unknown_namespace_lists_the_namespaces(ppo) -> None:
    err = _compile_error(ppo, ["actr_zzz.qq=1"])
    assert err.codes == ["config-unknown-key"]
    assert re.search(r"known namespaces are: .*actor.*rollout", err.problems[0].fix)


def test_override_int_key_with_a_float_is_a_type_error(ppo) -> None:
    err = _compile_error(ppo, ["data.batch_size=4.5"])
    assert err.codes == ["config-type"]
    (p,) = err.problems
    assert "override data.batch_size=4.5: expected an int, got '4.5'" in p.message
    assert p.fix.startswith("write data.batch_size=<int>")


def test_override_outside_the_choices_lists_them(ppo) -> None:
    err = _compile_error(ppo, ["actor.loss_agg_mode=foo"])
    assert err.codes == ["config-type"]
    assert re.search(r"'foo' is not one of 'token-mean', 'seq-mean-token-sum', 'seq-mean-token-mean'",
                     err.problems[0].message)


def test_override_below_the_minimum(ppo) -> None:
    err = _compile_error(ppo, ["groups.actor.dp=0"])
    assert err.codes == ["config-type"]
    assert "0 is below the minimum 1" in err.problems[0].message


def test_several_bad_overrides_are_reported_together(ppo) -> None:
    err = _compile_error(ppo, ["actor.lrr=1", "data.batch_size=4.5", "actor.loss_agg_mode=foo"])
    assert sorted(err.codes) == ["config-type", "config-type", "config-unknown-key"]


@pytest.mark.parametrize("item", ["novalue", "=3", "  =x"])
def test_malformed_override_is_a_config_error(ppo, item: str) -> None:
    with pytest.raises(ConfigError, match=r"is not of the form key=value; write e\.g\. actor\.lr=1e-6"):
        rlgraph.compile(ppo, [item])
