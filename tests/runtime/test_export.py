"""`rlgraph export`: a PPO run's trained policy and critic as Hugging Face directories.

One PPO run (2 steps, a checkpoint at step 1) on Ray and TransferQueue; while its workers are
still up, the test reads their live weights, so an exported model is checked against what the
trainer holds, not against the checkpoint it was made from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import rlgraph
from rlgraph.cli import cli
from rlgraph.graph.loader import load_pipeline
from rlgraph.ops.models import load_causal_lm, load_critic, load_tokenizer
from rlgraph.runtime.export import WORKER_CLASSES, ExportError, export_model
from rlgraph.runtime.runner import Runner, RunOptions

pytestmark = pytest.mark.ray

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlgraph.ops.tiny import prepare_tiny_policy

    return str(prepare_tiny_policy(str(tmp_path_factory.mktemp("tiny") / "model"), "add", sft_steps=100))


@pytest.fixture(scope="module")
def trained(model_dir, tq_plane, tmp_path_factory):
    """(run dir, live model weights by what) after 2 PPO steps with a checkpoint after the last."""
    pipeline, ref = load_pipeline(str(ROOT / "examples" / "ppo.py"))
    plan = rlgraph.compile(pipeline, [f"actor.model_path={model_dir}", "data.batch_size=4", "rollout.n=4",
                                      "actor.mini_batch_size=2", "critic.mini_batch_size=2", "trainer.save_every=2",
                                      "data.num_rows=64"], pipeline_ref=ref)
    out = tmp_path_factory.mktemp("run")
    with Runner(plan, RunOptions(out_dir=out, steps=2, timeout_s=300), tq_plane) as runner:
        runner.run()
        fleet = runner.fleet
        actor, critic = fleet.get([fleet.workers["actor"][0].instance_states.remote(),
                                   fleet.workers["critic"][0].instance_states.remote()], "the live weights")
    live = {"actor": actor[WORKER_CLASSES["actor"]]["model"], "critic": critic[WORKER_CLASSES["critic"]]["model"]}
    return out, live


def _batch(model_dir):
    tok = load_tokenizer(model_dir)
    ids = [tok.encode(s) for s in ("<|user|>12+34=<|assistant|>", "<|user|>7+8=<|assistant|>46")]
    width = max(map(len, ids))
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in ids])
    return input_ids, (input_ids != tok.pad_token_id).long()


def test_exported_policy_gives_the_trainers_logits(trained, model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    run_dir, live = trained
    done = export_model(run_dir, tmp_path / "policy")
    assert (done.what, done.step, done.state) == ("actor", 1, "actor_0")
    names = {p.name for p in (tmp_path / "policy").iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "rlgraph_export.json"} <= names
    assert json.loads((tmp_path / "policy" / "rlgraph_export.json").read_text())["step"] == 1

    trainer = load_causal_lm(model_dir)
    trainer.load_state_dict(live["actor"])
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "policy", local_files_only=True).eval()
    input_ids, mask = _batch(model_dir)
    with torch.no_grad():
        want = trainer(input_ids=input_ids, attention_mask=mask).logits
        got = exported(input_ids=input_ids, attention_mask=mask).logits
        base = load_causal_lm(model_dir)(input_ids=input_ids, attention_mask=mask).logits
    assert torch.equal(got, want)
    assert float((got - base).abs().max()) > 1e-4  # the run trained: not the starting weights
    # the tokenizer and generation config came along: it generates as a Hugging Face model
    tok = AutoTokenizer.from_pretrained(tmp_path / "policy", local_files_only=True)
    assert tok.encode("12+34=") == load_tokenizer(model_dir).encode("12+34=")
    assert GenerationConfig.from_pretrained(tmp_path / "policy").eos_token_id == tok.eos_token_id
    new = exported.generate(input_ids[:1], attention_mask=mask[:1], max_new_tokens=4, do_sample=False)
    assert new.shape[1] > input_ids.shape[1]


def test_exported_critic_gives_the_trainers_values(trained, model_dir, tmp_path):
    from transformers import AutoModelForTokenClassification

    run_dir, live = trained
    result = CliRunner().invoke(cli, ["export", str(run_dir), "--what", "critic", "-o", str(tmp_path / "critic")])
    assert result.exit_code == 0, result.output
    assert "exported the critic of step 1 (critic_0" in result.output
    trainer = load_critic(model_dir)
    trainer.load_state_dict(live["critic"])
    exported = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic", local_files_only=True).eval()
    assert exported.config.num_labels == 1
    input_ids, mask = _batch(model_dir)
    with torch.no_grad():
        assert torch.equal(exported(input_ids=input_ids, attention_mask=mask).logits[..., 0],
                           trainer(input_ids=input_ids, attention_mask=mask).logits[..., 0])


def test_what_cannot_be_exported_is_a_clear_error(trained, model_dir, tmp_path):
    run_dir, _ = trained
    with pytest.raises(ExportError, match=r"has no checkpoint of step 7; it has steps \[1\]"):
        export_model(run_dir, tmp_path / "a", step=7)
    with pytest.raises(ExportError, match=r"has no checkpoint; run with trainer.save_every=K"):
        export_model(tmp_path, tmp_path / "a")
    with pytest.raises(ExportError, match=r"base model .* \(--base\) is not a Hugging Face model directory"):
        export_model(run_dir, tmp_path / "a", base=tmp_path)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ExportError, match=r"'.*full' is not empty; give a new one, or --overwrite"):
        export_model(run_dir, tmp_path / "full")
    # --overwrite never deletes the run or the base model, and replaces an export only once the new one is complete
    with pytest.raises(ExportError, match=r"is \(or holds\) the run directory"):
        export_model(run_dir, run_dir.parent, overwrite=True)
    with pytest.raises(ExportError, match=r"is \(or holds\) the base model"):
        export_model(run_dir, Path(model_dir).parent, overwrite=True)
    with pytest.raises(ExportError, match=r"has no checkpoint of step 7"):
        export_model(run_dir, tmp_path / "full", step=7, overwrite=True)
    assert (tmp_path / "full" / "x").exists()  # a failed export left the old contents alone
    export_model(run_dir, tmp_path / "full", overwrite=True)
    assert not (tmp_path / "full" / "x").exists() and (tmp_path / "full" / "model.safetensors").is_file()
    # a pipeline without a critic (as GRPO): say so, and what can be exported
    grpo_like = tmp_path / "grpo_like"
    shutil.copytree(run_dir / "checkpoints", grpo_like / "checkpoints")
    for f in (grpo_like / "checkpoints" / "step_1").glob("critic_0.*"):
        f.unlink()
    with pytest.raises(ExportError, match=r"holds no critic model .* export the actor with --what actor"):
        export_model(grpo_like, tmp_path / "a", what="critic")
    result = CliRunner().invoke(cli, ["export", str(run_dir), "-o", str(tmp_path / "b"), "--step", "7"])
    assert result.exit_code == 1 and "has no checkpoint of step 7" in result.output


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_loads_the_exported_policy_and_generates_as_transformers(trained, tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed: bash scripts/setup.sh --vllm=cpu")
    from transformers import AutoModelForCausalLM

    from rlgraph.ops.rollout.vllm_engine import VLLMEngine

    run_dir, _ = trained
    path = export_model(run_dir, tmp_path / "policy").out_dir
    input_ids, mask = _batch(str(path))
    prompts = [row[m.bool()].tolist() for row, m in zip(input_ids, mask)]
    hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    engine = VLLMEngine(str(path), rank=0)
    try:
        done = sorted(engine.generate(prompts, n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=5,
                                      stop_token_ids=[], seeds=[0, 1], logprobs=True), key=lambda f: f.index)
    finally:
        engine.close()
    for p, fin in zip(prompts, done):
        tokens = fin.tokens[0]
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([p + tokens])).logits[0, len(p) - 1:-1]
        assert tokens == logits.argmax(-1).tolist()  # greedy under the exported weights
        hf_lp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert float((hf_lp - torch.tensor(fin.logprobs[0])).abs().max()) < 1e-3


def test_the_export_keeps_the_trained_dtype_whatever_the_base_config_says(trained, model_dir, tmp_path):
    """Real bases ship bfloat16 configs; the trained float32 weights are exported as float32."""
    from transformers import AutoModelForCausalLM

    run_dir, live = trained
    base = tmp_path / "bf16_base"
    shutil.copytree(model_dir, base)
    config = json.loads((base / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = "bfloat16"
    (base / "config.json").write_text(json.dumps(config))
    export_model(run_dir, tmp_path / "policy", base=base)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "policy", local_files_only=True, dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in live["actor"].items())
