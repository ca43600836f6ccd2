"""The settings models: one typed home per config section, and nothing reads a key with a default of its own."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

import rlgraph
from rlgraph.errors import ConfigError, DeclarationError
from rlgraph.graph.build import build, config_schema
from rlgraph.graph.config import nest, resolve_config
from rlgraph.graph.dsl import Cluster, Pipeline, WorkerGroup
from rlgraph.graph.settings import (ClusterSettings, DataplaneSettings, GroupSettings, SourceSettings, TrainerSettings,
                                    params_of)
from rlgraph.ops import stages
from rlgraph.ops.settings import (SECTIONS, VERL_ALIASES, AlgorithmSettings, FilterGroupsSettings, OverlongSettings,
                                  RewardModelSettings, RolloutSettings, aliases_of)

ROOT = Path(__file__).resolve().parents[2]
# what a settings model leaves to the declaration, as the stage factories declare it by default
DECLARED = {AlgorithmSettings: {"estimator": "gae"}, OverlongSettings: {"score_column": "rule_scores"},
            FilterGroupsSettings: {"score_column": "raw_scores", "metric_column": "raw_scores"}}


def _every_stage() -> Pipeline:
    """Every built-in stage with its default declaration and no pipeline config (columns need not connect:
    only the config is resolved)."""
    ops = [stages.generate(), stages.reward(), stages.reward_model(), stages.overlong_penalty(),
           stages.filter_groups(), stages.old_logprob(), stages.ref(), stages.teacher_logprob(), stages.values(),
           stages.advantage(), stages.reward_model(kind="generative", name="judge", score_column="judge_scores"),
           stages.update_critic(), stages.update_actor()]
    return Pipeline("every_stage", stages.prompt_source(), ops, [WorkerGroup("actor", dp=2)], Cluster())


def test_the_resolved_config_holds_each_models_defaults():
    schema, problems = config_schema(_every_stage())
    config, more = resolve_config(schema, {}, {})
    assert problems == more == []
    nested = nest(config)
    for model in SECTIONS:
        assert model.of(nested) == model(**DECLARED.get(model, {})), model.__name__
    assert GroupSettings.of(nested, "groups.actor") == GroupSettings(dp=2, pool="actor")
    # and the params a section's keys resolve by are its model's fields, in order, nothing else
    for model in SECTIONS:
        keys = [k.split(".", 1)[1] for k in schema if k.split(".")[0] == model.namespace]
        assert keys == list(model.model_fields), model.__name__


def test_params_carry_the_fields_type_default_bounds_choices_doc_and_verl_names():
    p = params_of(RolloutSettings)
    assert (p["n"].type, p["n"].default, p["n"].minimum, p["n"].verl) == (int, 4, 1, ("actor_rollout_ref.rollout.n",))
    assert p["backend"].choices == ("hf", "vllm") and p["backend"].setup and not p["n"].setup
    assert p["temperature"].doc == "sampling temperature (0: greedy)"
    optional = params_of(DataplaneSettings)["storage_units"]
    assert optional.optional and optional.default is None and optional.type is int
    # a declaration's argument is the default; a FIXED field's only choice is the declared value
    assert params_of(TrainerSettings, seed=3)["seed"].default == 3
    fixed = params_of(OverlongSettings, score_column="rm_scores")["score_column"]
    assert (fixed.default, fixed.choices) == ("rm_scores", ("rm_scores",))


def test_a_field_the_declaration_sets_must_be_given():
    with pytest.raises(DeclarationError, match="AlgorithmSettings.estimator is set by the declaration"):
        params_of(AlgorithmSettings)
    with pytest.raises(DeclarationError, match=r"TrainerSettings has no fields \['sead'\]"):
        params_of(TrainerSettings, sead=1)


def test_bounds_and_choices_are_refused_naming_the_key():
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        TrainerSettings(steps=0)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        TrainerSettings(sead=1)
    with pytest.raises(ConfigError, match=r"trainer\.steps: Input should be greater than or equal to 1 \(got 0\)"):
        TrainerSettings.of({"trainer": {"steps": 0}})
    with pytest.raises(ConfigError, match=r"rollout\.backend: Input should be 'hf' or 'vllm' \(got 'sglang'\)"):
        RolloutSettings.of({"rollout": {"backend": "sglang"}})
    with pytest.raises(ConfigError, match="reward_model.dtype"):
        RewardModelSettings.of({"reward_model": {"dtype": "float64"}})
    with pytest.raises(ConfigError, match=r"groups\.actor\.pool is not set"):
        GroupSettings.of({"groups": {"actor": {"dp": 1}}}, "groups.actor")
    # an override is checked by the same bounds when the pipeline compiles
    with pytest.raises(rlgraph.PipelineError, match="below the minimum 1"):
        rlgraph.compile(_every_stage(), ["trainer.steps=0"])


def test_typed_access_from_a_plan_a_context_a_graph_or_the_config(ppo):
    plan = rlgraph.compile(ppo, ["trainer.seed=7", "rollout.temperature=0.5"])
    assert TrainerSettings.of(plan).seed == 7
    assert TrainerSettings.of(SimpleNamespace(config=plan.config)).seed == 7  # an op context
    assert TrainerSettings.of(build(ppo, ["trainer.seed=7"])).seed == 7  # a built graph: flat dotted keys
    assert RolloutSettings.of(plan.config).temperature == 0.5
    # a section the pipeline lacks, or a key it lacks, takes the model's default; keys of others are left out
    assert TrainerSettings.of(None) == TrainerSettings() and RolloutSettings.of({}) == RolloutSettings()
    assert RolloutSettings.find({}) is None and RolloutSettings.find(plan).temperature == 0.5  # is it there?
    assert RolloutSettings.of({"rollout": {"n": 2, "my_own_param": 1}}) == RolloutSettings(n=2)
    assert SourceSettings.of(plan).batch_size == plan.config["data"]["batch_size"]


def test_dataplane_storage_units_are_resolved_once_at_compile_time(ppo):
    assert DataplaneSettings().storage_units is None  # "one per node", resolved by the compiler alone
    plan = rlgraph.compile(ppo)
    assert DataplaneSettings.of(plan).storage_units == ClusterSettings.of(plan).num_nodes == 1
    assert DataplaneSettings.of(rlgraph.compile(ppo, ["dataplane.storage_units=2"])).storage_units == 2


def test_the_verl_table_is_the_sections_and_docs_migrating_lists_it():
    assert VERL_ALIASES["data.train_batch_size"] == "data.batch_size"
    assert VERL_ALIASES["trainer.nnodes"] == "cluster.num_nodes"
    assert aliases_of("actor.lr") == ["actor_rollout_ref.actor.optim.lr"]
    text = (ROOT / "docs" / "migrating.md").read_text().split("## The alias table", 1)[1].split("\n## ", 1)[0]
    listed = dict(re.findall(r"^\| `([\w.]+)` \| `([\w.]+)` \|$", text, flags=re.M))
    assert listed == dict(VERL_ALIASES)


# ------------------------------------------------------------------------------------------------
# No module reads a config key with a default of its own: `x.get("seed", 0)` where "seed" is a key
# of a settings model. The default lives in the model; read it through the model
# (`TrainerSettings.of(ctx).seed`). A `.get` on something that is not config (a state dict, a
# checkpoint's meta, metrics) may name such a key only from a receiver listed here.
NOT_CONFIG = frozenset({"state", "meta", "metrics", "info", "os.environ"})
SETTINGS_KEYS = frozenset(f for m in (*SECTIONS, GroupSettings, SourceSettings) for f in m.model_fields)


def reads_with_own_default(source: str) -> list[tuple[int, str]]:
    """(line, call) of each ``X.get("<settings key>", <default>)`` in `source`, X not in `NOT_CONFIG`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"):
            continue
        key = node.args[0] if node.args else None
        has_default = len(node.args) > 1 or any(k.arg == "default" for k in node.keywords)
        if isinstance(key, ast.Constant) and key.value in SETTINGS_KEYS and has_default \
                and ast.unparse(node.func.value) not in NOT_CONFIG:
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_the_scan_finds_a_read_with_its_own_default():
    bad = 'seed = int(section(ctx, "trainer").get("seed", 0))\nunits = plan.config["dataplane"].get("storage_units", 1)\n'
    assert [line for line, _ in reads_with_own_default(bad)] == [1, 2]
    fine = 'seed = TrainerSettings.of(ctx).seed\nk = state.get("seed", 0)\nx = cfg.get("not_a_key", 0)\n'
    assert reads_with_own_default(fine) == []


def test_no_module_reads_a_config_key_with_its_own_default():
    bad = [f"{path.relative_to(ROOT)}:{line}: {call}"
           for path in sorted((ROOT / "rlgraph").rglob("*.py"))
           for line, call in reads_with_own_default(path.read_text())]
    assert not bad, ("config keys read with a default of their own (read the settings model instead, e.g. "
                     "TrainerSettings.of(ctx).seed):\n" + "\n".join(bad))


def test_one_key_of_another_ops_section_is_read_without_checking_its_other_keys():
    # a custom data source named "data" may declare keys the built-in one types otherwise
    from rlgraph.errors import ConfigError
    from rlgraph.ops.settings import ActorSettings, DataSettings

    custom = {"data": {"tokenizer": "/models/tok", "task": "mult", "num_rows": 0}, "actor": {"lr": 1}}
    assert DataSettings.value(custom, "tokenizer") == "/models/tok"
    assert ActorSettings.value(custom, "model_path") == ""  # not set: the field's default
    with pytest.raises(ConfigError, match="config key data.tokenizer: Input should be a valid string"):
        DataSettings.value({"data": {"tokenizer": 3}}, "tokenizer")
