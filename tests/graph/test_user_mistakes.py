"""Pipelines written the way a user writes them from the docs, each with one mistake, and the exact
first line of what `rlgraph validate` says (tests/resources/user_mistakes/).

A mistake in a declaration is a `DeclarationError` raised where the pipeline file is imported: its
message's first line is asserted. A mistake the checker finds is a `PipelineError`: the first line
of its first problem (``[code] message``) is asserted, and the fix line that follows it. Each
message names the op, argument, group or key, the expected form, and (for a name) the closest one.
Every file in the folder must be in the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from rlgraph.cli import cli
from rlgraph.errors import DeclarationError, PipelineError
from rlgraph.graph.compile import compile_pipeline
from rlgraph.graph.loader import load_pipeline

MISTAKES = Path(__file__).resolve().parents[1] / "resources" / "user_mistakes"


@dataclass(frozen=True)
class Mistake:
    fixture: str
    error: type[Exception]
    first_line: str
    fix: str | None = None  # a PipelineError's fix line for its first problem


TABLE = [
    Mistake("annot_plain", DeclarationError,
            "op 'judge': input parameter 'prompt' is typed with the Python type str; column types come from T, e.g. T.str()"),
    Mistake("cluster_zero", DeclarationError,
            "Cluster: num_nodes=0: 0 is below the minimum 1; give 'num_nodes' a value of at least 1 (it is config key cluster.num_nodes)"),
    Mistake("config_list", DeclarationError,
            "pipeline 'config_list': config= must be a dict of namespace -> {key: value}, e.g. config={'actor': {'lr': 1e-6}}; got list ['data.batch_size=4'] (key=value strings are command-line overrides)"),
    Mistake("config_op_typo", PipelineError,
            "[config-unknown-key] the pipeline's config sets unknown config key 'updte_actor.lr'",
            fix="did you mean 'actor.lr'?"),
    Mistake("config_section_scalar", DeclarationError,
            "pipeline 'config_section_scalar': config['actor'] is int 3; a namespace holds a dict of its keys, e.g. config={'actor': {'key': value}} (or write config={'actor.key': value})"),
    Mistake("data_read_as_state", PipelineError,
            "[column-kind-mismatch] op 'update' reads column 'score' as cross-step state, but 'judge' writes it as this step's data",
            fix="drop .state() from the input 'score' of 'update' to read this step's values, or have 'judge' output it with .state()"),
    Mistake("dp_string", DeclarationError,
            "worker group 'w': dp='2': expected int, got str '2'; give 'dp' a value of type int (it is config key groups.w.dp)"),
    Mistake("dp_zero", DeclarationError,
            "worker group 'w': dp=0: 0 is below the minimum 1; give 'dp' a value of at least 1 (it is config key groups.w.dp)"),
    Mistake("drop_names_nothing", DeclarationError,
            "pipeline 'drop_names_nothing'.with_ops(): drop= names op 'refs', which the pipeline does not have (did you mean 'ref'?); its ops are generate, reward, old_logprob, ref, advantage, update_actor"),
    Mistake("estimator_typo", DeclarationError,
            "unknown advantage estimator 'gpro'; use one of gae, grpo, drgrpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, distill (did you mean 'grpo'?)"),
    Mistake("factory_uncalled", DeclarationError,
            "pipeline 'factory_uncalled': ops[0]: stages.generate is a stage factory, not an op: call it, e.g. stages.generate(group='actor')"),
    Mistake("granularity_typo", DeclarationError,
            "op 'judge': granularity 'per_sample' must be one of sample, group, batch (did you mean 'sample'?)"),
    Mistake("groups_strings", DeclarationError,
            "pipeline 'groups_strings': groups[0] must be a WorkerGroup, got str 'w'; write WorkerGroup('w')"),
    Mistake("lr_string", PipelineError,
            "[config-type] config key 'actor.lr' in the pipeline: expected float, got str '1e-4x'",
            fix="give 'actor.lr' a value of type float"),
    Mistake("n_zero", PipelineError,
            "[config-type] config key 'rollout.n' in the pipeline: 0 is below the minimum 1",
            fix="give 'rollout.n' a value of at least 1"),
    Mistake("num_cpus_str", DeclarationError,
            "worker group 'w': num_cpus='one': expected float, got str 'one'; give 'num_cpus' a value of type float (it is config key groups.w.num_cpus)"),
    Mistake("op_decorator_uncalled", DeclarationError,
            "op 'judge': @rlgraph.op needs outputs=, the columns it produces; write @rlgraph.op(outputs={'score': T.float32()}, group='...') above judge()"),
    Mistake("ops_not_list", DeclarationError,
            "pipeline 'ops_not_list': ops= is the op 'judge' alone; give a list: ops=[judge]"),
    Mistake("outputs_list", DeclarationError,
            "op 'judge': outputs= must be a dict of column name -> column type, e.g. outputs={'score': T.float32()}; got list ['score']; give each column its type ('score': T.float32(), say)"),
    Mistake("pool_names_nothing", PipelineError,
            "[pool-unknown] worker group 'reward' names pool 'actr', which is no worker group's name and no other group's pool (did you mean 'actor'?)",
            fix="to share another group's devices name that group (groups.reward.pool=<group>, one of: actor), or leave pool unset for a pool of its own"),
    Mistake("schedule_bad", PipelineError,
            "[config-type] config key 'trainer.schedule' in the pipeline: 'async' is not one of 'stream', 'sync'",
            fix="give 'trainer.schedule' one of 'stream', 'sync' (did you mean 'sync'?)"),
    Mistake("source_dict", DeclarationError,
            "pipeline 'source_dict': source= is a dict of columns; wrap it in a DataSource: source=DataSource({'prompt': ...})"),
    Mistake("source_uncalled", DeclarationError,
            "pipeline 'source_uncalled': source= is the function 'prompt_source', not a DataSource: call it, e.g. source=prompt_source()"),
    Mistake("stage_group_typo", PipelineError,
            "[op-unknown-group] op 'reward' names worker group 'rewards', which is not declared (did you mean 'reward'?)",
            fix="add WorkerGroup('rewards', ...) to the pipeline's groups, or use one of: actor, reward"),
    Mistake("state_read_as_data", PipelineError,
            "[column-kind-mismatch] op 'judge' reads column 'w' as this step's data, but 'update' writes it as cross-step state (read in the next step)",
            fix="declare the input 'w' of 'judge' as state, `w: T.float32(...).state()` (the value written in the previous step), or have 'update' output it as data"),
    Mistake("summaries_typo", PipelineError,
            "[summary-column] summaries names column 'scores' (metric 'reward'), which nothing produces",
            fix="name a column an op produces, or remove 'scores' from summaries="),
    Mistake("t_uncalled", DeclarationError,
            "op 'judge': output column 'score' is typed T.float32 without its call; write T.float32()"),
    Mistake("task_unknown", PipelineError,
            "[config-type] config key 'data.task' in the pipeline: 'addition' is not one of 'add', 'count', 'mul', 'guess'",
            fix="give 'data.task' one of 'add', 'count', 'mul', 'guess' (did you mean 'add'?)"),
    Mistake("with_groups_drop", DeclarationError,
            "pipeline 'with_groups_drop'.with_groups(): drop= names worker group 'ww', which the pipeline does not have (did you mean 'w'?); its worker groups are w"),
    Mistake("with_outputs_drop", DeclarationError,
            "pipeline 'with_outputs_drop'.with_outputs(): drop= names output 'scroe', which the pipeline does not have; its outputs are (none)"),
]


def _error(fixture: str) -> Exception:
    try:
        pipeline, ref = load_pipeline(str(MISTAKES / f"{fixture}.py"))
        compile_pipeline(pipeline, {}, pipeline_ref=ref)
    except (DeclarationError, PipelineError) as e:
        return e
    raise AssertionError(f"{fixture}: compiled without an error")


def test_every_fixture_is_in_the_table():
    assert sorted(p.stem for p in MISTAKES.glob("*.py")) == sorted(m.fixture for m in TABLE)
    assert len(TABLE) >= 20


@pytest.mark.parametrize("case", TABLE, ids=lambda m: m.fixture)
def test_the_first_line_is_exact(case: Mistake):
    e = _error(case.fixture)
    assert type(e) is case.error, e
    if isinstance(e, PipelineError):
        assert str(e.problems[0]).splitlines()[0] == case.first_line
        assert e.problems[0].fix == case.fix
    else:
        assert str(e).splitlines()[0] == case.first_line


@pytest.mark.parametrize("fixture", ["dp_zero", "pool_names_nothing", "factory_uncalled"])
def test_validate_prints_it_without_a_traceback(fixture: str):
    res = CliRunner().invoke(cli, ["validate", str(MISTAKES / f"{fixture}.py")])
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output
    first = next(m.first_line for m in TABLE if m.fixture == fixture)
    assert first in res.output
