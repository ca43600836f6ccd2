"""verl's config keys as aliases of rlgraph's: renamed with a notice, never silently ignored."""

from __future__ import annotations

import warnings

import pytest

import rlgraph
from rlgraph import PipelineError
from rlgraph.graph.verl import VerlAliasNotice
from rlgraph.ops.settings import VERL_ALIASES, aliases_of


def _compile(pipeline, overrides):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = rlgraph.compile(pipeline, overrides)
    return plan, [str(w.message) for w in caught if issubclass(w.category, VerlAliasNotice)]


def test_a_verl_command_line_compiles_to_the_same_plan_as_rlgraph_keys(ppo):
    verl = ["data.train_batch_size=45", "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.rollout.temperature=0.7",
            "data.max_response_length=16", "actor_rollout_ref.actor.ppo_mini_batch_size=15",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.ppo_epochs=2",
            "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
            "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.01",
            "algorithm.adv_estimator=gae", "algorithm.gamma=0.99", "algorithm.lam=0.95",
            "actor_rollout_ref.actor.optim.lr=2e-6", "trainer.total_training_steps=7", "trainer.save_freq=-1",
            "trainer.test_freq=5"]
    ours = ["data.batch_size=45", "rollout.n=8", "rollout.temperature=0.7", "rollout.max_new_tokens=16",
            "actor.mini_batch_size=15", "actor.micro_batch_size=8", "actor.ppo_epochs=2", "actor.clip_ratio_low=0.2",
            "actor.clip_ratio_high=0.28", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.01",
            "algorithm.estimator=gae", "algorithm.gamma=0.99", "algorithm.lam=0.95", "actor.lr=2e-6",
            "trainer.steps=7", "trainer.save_every=0", "trainer.val_every=5"]
    via_verl, notices = _compile(ppo, verl)
    direct, none = _compile(ppo, ours)
    assert via_verl.model_dump_json() == direct.model_dump_json() and none == []
    # one notice per renamed key, naming the rlgraph key (gamma and lam are spelled the same: no notice)
    assert len(notices) == len(verl) - 2
    assert "data.train_batch_size is verl's name for data.batch_size; using data.batch_size=45" in notices
    assert "trainer.save_freq is verl's name for trainer.save_every; using trainer.save_every=0" in notices


def test_a_verl_key_without_an_equivalent_is_an_error_never_ignored(ppo):
    with pytest.raises(PipelineError) as info:
        rlgraph.compile(ppo, ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.hybrid_engine=true",
                                       "trainer.device=cuda"])
    text = str(info.value)
    assert "'actor_rollout_ref.rollout.name' is a verl config key with no rlgraph equivalent" in text
    assert "set rollout.backend (hf or vllm)" in text
    assert "'actor_rollout_ref.hybrid_engine' is a verl config key" in text  # any key under verl's own sections
    assert "'trainer.device' is a verl config key" in text and "devices come from the worker groups' num_gpus" in text


@pytest.mark.parametrize("value", ["[console,wandb]", '["console","wandb"]', "console,wandb"])
def test_verls_logger_list_and_run_names_are_taken(ppo, value):
    plan, notices = _compile(ppo, [f"trainer.logger={value}", "trainer.project_name=gsm8k",
                                   "trainer.experiment_name=qwen-grpo"])
    trainer = plan.config["trainer"]
    assert (trainer["logger"], trainer["project"], trainer["run_name"]) == (value, "gsm8k", "qwen-grpo")
    assert notices == ["trainer.project_name is verl's name for trainer.project; using trainer.project=gsm8k",
                       "trainer.experiment_name is verl's name for trainer.run_name; using trainer.run_name=qwen-grpo"]


def test_a_key_set_under_both_names_is_refused(ppo):
    with pytest.raises(PipelineError, match="both 'actor_rollout_ref.rollout.n' \\(verl's name\\) and 'rollout.n'"):
        rlgraph.compile(ppo, ["actor_rollout_ref.rollout.n=4", "rollout.n=8"])


def test_every_alias_points_at_a_key_of_the_bundled_pipelines(ppo):
    from rlgraph.graph.build import config_schema

    schema, _ = config_schema(ppo)
    known = set(schema) | {"cluster.num_nodes", "cluster.gpus_per_node"}
    assert {ours for ours in VERL_ALIASES.values()} - known == set()
    assert aliases_of("rollout.max_new_tokens") == ["data.max_response_length", "actor_rollout_ref.rollout.response_length"]


def test_an_alias_is_translated_by_the_keys_the_pipeline_has(grpo):
    from rlgraph.ops import stages

    # no critic in GRPO: verl's critic key stands for nothing in it
    with pytest.raises(PipelineError, match="unknown config key 'critic.optim.lr'"):
        rlgraph.compile(grpo, ["critic.optim.lr=1e-5"])
    without_ref = grpo.with_ops(drop=["ref"])
    with pytest.raises(PipelineError, match="'actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu' is a verl "
                                            "config key with no equivalent among this pipeline's keys"):
        rlgraph.compile(without_ref, ["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"])
    # the same op declared twice: the verl key would stand for both
    twice = grpo.with_ops(stages.ref().with_(name="ref2"))
    with pytest.raises(PipelineError, match="stands for 'ref.micro_batch_size' and 'ref2.micro_batch_size'"):
        rlgraph.compile(twice, ["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"])


def test_verls_engine_keys_set_the_training_engine(ppo):
    """strategy=fsdp2, use_dynamic_bsz with its token budgets, the LoRA keys, remove-padding and
    gradient checkpointing compile to the same plan as rlgraph's keys."""
    verl = ["actor_rollout_ref.actor.strategy=fsdp", "critic.strategy=fsdp2",
            "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192",
            "critic.use_dynamic_bsz=true",  # no budget given: verl's default 16384
            "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=4096",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=999",  # ignored, as verl ignores it
            "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
            "actor_rollout_ref.model.target_modules=q_proj,v_proj", "actor_rollout_ref.model.use_remove_padding=true",
            "actor_rollout_ref.model.enable_gradient_checkpointing=true",
            "actor_rollout_ref.actor.fsdp_config.offload_policy=true"]
    ours = ["actor.backend=fsdp2", "critic.backend=fsdp2", "actor.max_tokens_per_micro_batch=8192",
            "critic.max_tokens_per_micro_batch=16384", "ref.max_tokens_per_micro_batch=4096", "actor.lora_rank=8",
            "actor.lora_alpha=16", "actor.lora_target_modules=q_proj,v_proj", "actor.packing=true",
            "actor.gradient_checkpointing=true", "actor.cpu_offload=true"]
    via_verl, notices = _compile(ppo, verl)
    direct, _ = _compile(ppo, ours)
    # the same resolved config and ops (the overrides are recorded in another order)
    assert via_verl.config == direct.config and via_verl.ops == direct.ops
    assert any("use_dynamic_bsz=true: micro-batches by the token budget critic.ppo_max_token_len_per_gpu=16384" in n
               for n in notices)
    assert any("log_prob_max_token_len_per_gpu without" in n and "ignored" in n for n in notices)
    # rlgraph's own other spellings of the same keys
    same, notices = _compile(ppo, ["actor.strategy=fsdp2", "actor.lora.rank=8", "actor.lora.alpha=16",
                                   "actor.lora.target_modules=q_proj,v_proj"])
    assert same.config["actor"]["backend"] == "fsdp2" and same.config["actor"]["lora_rank"] == 8
    assert "actor.lora.rank is another name for actor.lora_rank; using actor.lora_rank=8" in notices


def test_megatron_is_refused_naming_the_backends_there_are(ppo):
    with pytest.raises(PipelineError, match=r"strategy=megatron: rlgraph has no Megatron backend(.|\n)*fsdp2"):
        rlgraph.compile(ppo, ["actor_rollout_ref.actor.strategy=megatron"])


def test_engine_keys_of_another_backend_are_refused(ppo):
    with pytest.raises(PipelineError, match=r"actor.cpu_offload=true is an FSDP2 option, but actor.backend=torch"):
        rlgraph.compile(ppo, ["actor.cpu_offload=true"])
    with pytest.raises(PipelineError, match=r"critic.zero_stage=2 is a DeepSpeed option, but critic.backend=fsdp2"):
        rlgraph.compile(ppo, ["critic.backend=fsdp2", "critic.zero_stage=2"])
