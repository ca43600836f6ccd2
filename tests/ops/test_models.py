"""Tiny models built offline: char tokenizer, random Qwen2/Llama, critic, SFT warm start."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may touch the network

import pytest  # noqa: E402
import torch  # noqa: E402

from rlgraph.errors import RLGraphError  # noqa: E402
from rlgraph.ops import models  # noqa: E402
from rlgraph.ops.data import tasks  # noqa: E402
from rlgraph.ops.models import ModelLoadError  # noqa: E402
from rlgraph.ops.tiny import evaluate  # noqa: E402

USER = [{"role": "user", "content": "3+4="}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return models.build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", seed=0)


def test_char_tokenizer_encodes_one_token_per_character():
    tok = models.char_tokenizer("ab1 \n")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) == len(models.SPECIAL_TOKENS) + 5
    ids = tok("ab 1\nb", add_special_tokens=False)["input_ids"]
    assert len(ids) == 6
    assert tok.decode(ids) == "ab 1\nb"  # no spaces inserted between characters
    assert tok("z", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]


def test_chat_template_adds_generation_prompt():
    tok = models.char_tokenizer()
    text = tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    assert text == "<bos><|user|>3+4=<|assistant|>"
    ids = models.encode_prompt(tok, USER)
    # <bos>, <|user|>, 4 characters, <|assistant|>: role markers are single tokens
    assert len(ids) == 7
    assert ids[0] == tok.bos_token_id and tok.convert_ids_to_tokens(ids[-1]) == "<|assistant|>"
    assert tok.decode(ids, skip_special_tokens=True) == "3+4="


def test_tokenizer_round_trips_through_save_pretrained(tmp_path):
    tok = models.char_tokenizer(padding_side="right")
    tok.save_pretrained(tmp_path)
    loaded = models.load_tokenizer(tmp_path)
    assert loaded.padding_side == "right"
    assert models.load_tokenizer(tmp_path, padding_side="left").padding_side == "left"
    assert models.encode_prompt(loaded, USER) == models.encode_prompt(tok, USER)
    assert loaded.get_vocab() == tok.get_vocab()


def _same_tokenizer(a, b):
    assert type(a) is type(b)
    assert a.get_vocab() == b.get_vocab() and a.all_special_tokens == b.all_special_tokens
    assert (a.padding_side, a.truncation_side, a.model_max_length) == (b.padding_side, b.truncation_side,
                                                                      b.model_max_length)
    assert a.chat_template == b.chat_template
    assert models.encode_prompt(a, USER) == models.encode_prompt(b, USER)


def test_a_tokenizer_loads_through_the_class_autotokenizer_chose_until_its_directory_changes(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.delenv("RLGRAPH_CACHE", raising=False)  # the default place: under XDG_CACHE_HOME
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    models.char_tokenizer(padding_side="right").save_pretrained(tmp_path / "tok")
    classes = models.TokenizerClasses()
    assert classes.path == tmp_path / "cache" / "rlgraph" / "tokenizer_classes.json"
    assert classes.load(tmp_path / "tok") is None  # nothing remembered yet
    first = models.load_tokenizer(tmp_path / "tok")  # AutoTokenizer's, remembered
    assert classes.load(tmp_path / "tok") is not None
    _same_tokenizer(first, AutoTokenizer.from_pretrained(tmp_path / "tok", local_files_only=True))
    calls = []
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: calls.append(a) or first)
    _same_tokenizer(models.load_tokenizer(tmp_path / "tok"), first)
    assert calls == []  # through the remembered class
    (tmp_path / "tok" / "extra.txt").write_text("a change")  # any change to the directory: AutoTokenizer again
    models.load_tokenizer(tmp_path / "tok")
    assert len(calls) == 1


def test_a_remembered_class_that_no_longer_loads_falls_back_to_autotokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("RLGRAPH_CACHE", str(tmp_path / "cache"))
    models.char_tokenizer().save_pretrained(tmp_path / "tok")
    classes = models.TokenizerClasses()
    assert classes.path == tmp_path / "cache" / "tokenizer_classes.json"
    classes.path.parent.mkdir(parents=True)
    classes.path.write_text("{not json")  # a broken file is no entry
    assert classes.load(tmp_path / "tok") is None
    classes.remember(tmp_path / "tok", type("Gone", (), {"__module__": "no_such_module_here"}))
    assert classes.load(tmp_path / "tok") is None
    _same_tokenizer(models.load_tokenizer(tmp_path / "tok"), models.char_tokenizer())
    assert "tokenization" in classes.path.read_text()  # the slow load wrote the right class back
    monkeypatch.setattr(models.TokenizerClasses, "KEEP", 2)
    for name in "abc":
        models.char_tokenizer().save_pretrained(tmp_path / name)
        models.load_tokenizer(tmp_path / name)
    assert [classes.load(tmp_path / n) is not None for n in ("tok", "a", "b", "c")] == [False, False, True, True]


def test_a_remembered_tokenizer_loads_without_transformers_model_machinery(tmp_path):
    """The point of remembering: a process that only tokenises imports no torch._dynamo or DTensor."""
    import subprocess
    import sys

    models.char_tokenizer().save_pretrained(tmp_path / "tok")
    code = ("import sys; from rlgraph.ops.models import load_tokenizer; load_tokenizer(sys.argv[1]); "
            "print(sorted(m for m in ('torch._dynamo', 'transformers.models.auto.auto_factory') if m in sys.modules))")
    env = {**os.environ, "RLGRAPH_CACHE": str(tmp_path / "cache")}
    runs = [subprocess.run([sys.executable, "-c", code, str(tmp_path / "tok")], capture_output=True, text=True,
                           env=env, timeout=120) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr + runs[1].stderr
    assert runs[0].stdout.split()[-1] != "[]"  # the first load asks AutoTokenizer ...
    assert runs[1].stdout.strip().splitlines()[-1] == "[]"  # ... the second does not


def test_task_characters_are_in_the_default_vocabulary():
    assert set(tasks.TASK_CHARS) <= set(models.DEFAULT_CHARS)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_build_tiny_model_saves_a_loadable_hf_directory(tmp_path, arch):
    path = models.build_tiny_model(tmp_path / arch, arch=arch, hidden_size=32, num_heads=2)
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (path / name).is_file(), name
    model, tok = models.load_causal_lm(path), models.load_tokenizer(path)
    assert model.config.model_type == arch
    assert model.config.vocab_size == len(tok)
    assert (model.config.pad_token_id, model.config.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    prompt = torch.tensor([models.encode_prompt(tok, USER)])
    out = model.generate(prompt, max_new_tokens=3, do_sample=False)
    assert out.shape[0] == 1 and 7 < out.shape[1] <= 10


def test_build_tiny_model_is_deterministic_for_a_seed(tmp_path):
    a = models.load_causal_lm(models.build_tiny_model(tmp_path / "a", hidden_size=32, num_heads=2, seed=3))
    b = models.load_causal_lm(models.build_tiny_model(tmp_path / "b", hidden_size=32, num_heads=2, seed=3))
    c = models.load_causal_lm(models.build_tiny_model(tmp_path / "c", hidden_size=32, num_heads=2, seed=4))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])


def test_build_tiny_model_does_not_disturb_the_global_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    models.build_tiny_model(tmp_path / "m", hidden_size=32, num_heads=2, seed=9)
    assert torch.equal(torch.rand(3), expected)


def test_build_tiny_model_rejects_bad_shapes(tmp_path):
    with pytest.raises(ValueError, match="hidden_size=30 is not divisible by num_heads=4"):
        models.build_tiny_model(tmp_path, hidden_size=30, num_heads=4)
    with pytest.raises(ValueError, match="arch='gpt2' is not supported"):
        models.build_tiny_model(tmp_path, arch="gpt2")  # type: ignore[arg-type]


def test_load_critic_keeps_the_backbone_and_adds_a_value_head(tiny):
    policy = models.load_causal_lm(tiny)
    critic = models.load_critic(tiny)
    assert type(critic).__name__ == "Qwen2ForTokenClassification"
    assert critic.config.num_labels == 1 and critic.config.classifier_dropout == 0.0
    backbone = policy.model.state_dict()
    assert all(torch.equal(v, backbone[k]) for k, v in critic.model.state_dict().items())
    ids = torch.tensor([[1, 5, 10, 11], [1, 5, 12, 13]])
    values = critic(input_ids=ids).logits
    assert values.shape == (2, 4, 1)
    critic.train()  # no dropout: training-mode values equal eval-mode values
    assert torch.equal(critic(input_ids=ids).logits, values)


def test_load_errors_are_typed_and_say_what_to_do(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist; build one with"):
        models.load_causal_lm(tmp_path / "nope")
    (tmp_path / "file.bin").write_text("x")
    with pytest.raises(ModelLoadError, match="is a file, not a directory"):
        models.load_critic(tmp_path / "file.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="not a Hugging Face model directory: it lacks config.json"):
        models.load_causal_lm(tmp_path / "empty")
    with pytest.raises(ModelLoadError, match="holds no tokenizer"):
        models.load_tokenizer(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot load a causal LM from"):
        models.load_causal_lm(tmp_path / "bad")
    assert issubclass(ModelLoadError, RLGraphError)


def test_a_checkpoint_missing_weights_is_an_error(tiny, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"causal LM from .* lacks weights \['model.norm.weight'\]"):
        models.load_causal_lm(broken)
    with pytest.raises(ModelLoadError, match=r"critic from .* lacks weights \['model.norm.weight'\]"):
        models.load_critic(broken)


def test_sft_warmstart_learns_the_answers_and_saves(tiny, tmp_path):
    rows = tasks.make_rows("add", 200, seed=0)
    out = tmp_path / "sft"
    metrics = models.sft_warmstart(tiny, tasks.sft_examples(rows), steps=40, lr=3e-3, batch_size=16, out_dir=out)
    assert metrics.steps == 40 and metrics.examples == 200 and metrics.out_dir == out
    assert metrics.loss_last < metrics.loss_first / 2  # ~4.0 (uniform over 57 tokens) to below 2
    tuned = models.load_causal_lm(out)
    assert models.load_tokenizer(out).padding_side == "left"
    before = models.load_causal_lm(tiny)  # the source directory is untouched
    assert not torch.equal(tuned.lm_head.weight, before.lm_head.weight)
    acc = evaluate(tuned, models.load_tokenizer(out), rows[:32])
    assert 0.0 <= acc <= 1.0
    again = models.sft_warmstart(out, tasks.sft_examples(rows), steps=2, batch_size=4)  # in place
    assert again.out_dir == out and sorted(p.name for p in tmp_path.iterdir()) == ["sft"]  # no temp dirs left
    assert not torch.equal(models.load_causal_lm(out).lm_head.weight, tuned.lm_head.weight)


def test_sft_warmstart_rejects_empty_input(tiny):
    with pytest.raises(ValueError, match="at least one"):
        models.sft_warmstart(tiny, [], steps=1)
    with pytest.raises(ValueError, match="steps=0"):
        models.sft_warmstart(tiny, [(USER, "7")], steps=0)


def test_model_paths_may_start_with_a_tilde(tmp_path, monkeypatch):
    # config paths such as ~/.cache/rlgraph/models/... must load (the examples' defaults use one)
    from rlgraph.ops.models import build_tiny_model, load_causal_lm, load_critic, load_tokenizer

    monkeypatch.setenv("HOME", str(tmp_path))
    build_tiny_model(tmp_path / "models" / "m", hidden_size=16, num_layers=1, num_heads=2)
    assert load_tokenizer("~/models/m").eos_token_id is not None
    assert load_causal_lm("~/models/m").config.hidden_size == 16
    assert load_critic("~/models/m").config.num_labels == 1


def test_decode_rows_gives_what_transformers_batch_decode_gives(tmp_path, monkeypatch):
    # the Rust tokenizer's own decode for a plain fast tokenizer: row by row for a small call, one batched
    # call from DECODE_PARALLEL_TOKENS tokens; transformers' own path otherwise
    import random

    from rlgraph.ops import models
    from rlgraph.ops.models import char_tokenizer, decode_rows

    tok = char_tokenizer()
    batches, singles = [], []

    class Backend:  # the Rust tokenizer, counting its decodes
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def decode_batch(self, rows, **kwargs):
            batches.append(len(rows))
            return self.inner.decode_batch(rows, **kwargs)

        def decode(self, row, **kwargs):
            singles.append(len(row))
            return self.inner.decode(row, **kwargs)

    tok._tokenizer = Backend(tok._tokenizer)
    rng = random.Random(0)
    rows = [[rng.randrange(len(tok)) for _ in range(rng.randrange(0, 12))] for _ in range(200)]  # special ids too
    expected = tok.batch_decode(rows, skip_special_tokens=True)
    singles.clear()
    assert sum(map(len, rows)) < models.DECODE_PARALLEL_TOKENS
    assert decode_rows(tok, rows) == expected
    assert batches == [] and len(singles) == 200 and decode_rows(tok, []) == []
    monkeypatch.setattr(models, "DECODE_PARALLEL_TOKENS", sum(map(len, rows)))
    assert decode_rows(tok, [tuple(r) for r in rows]) == expected  # rows of any sequence type
    assert batches == [200] and len(singles) == 200
    tok.clean_up_tokenization_spaces = True  # a clean-up only transformers does: its path, the same strings
    assert decode_rows(tok, rows) == tok.batch_decode(rows, skip_special_tokens=True)
    assert batches == [200]
