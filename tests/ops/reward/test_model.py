"""The discriminative reward-model op: scoring at the last real token, padding rows, micro-batches,
the tiny trained RM, and errors for bad checkpoints. No Ray: the op body is called directly."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may touch the network

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from rlgraph.errors import RLGraphError  # noqa: E402
from rlgraph.ops import models  # noqa: E402
from rlgraph.ops.data import tasks  # noqa: E402
from rlgraph.ops.reward import model as rm  # noqa: E402


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory):
    """An untrained tiny RM: random weights still give distinct scores per sequence."""
    return rm.build_tiny_reward_model(tmp_path_factory.mktemp("rm") / "tiny", hidden_size=32, num_heads=2, seed=1)


def make_ctx(path, is_padding, response_len, outputs=("rm_scores",), **cfg):
    config = {"reward_model": {"model_path": str(path), **cfg}}
    return SimpleNamespace(op="rm_score", group="rm", rank=0, dp=1, step=0, chunk=0, seed=0, config=config,
                           rows=tuple(range(len(is_padding))), is_padding=tuple(is_padding),
                           lengths={"response_len": tuple(response_len)}, outputs=tuple(outputs))


def worker(path, **cfg):
    w = rm.RewardModelWorker()
    w.setup(make_ctx(path, (), (), **cfg))
    return w


def rows_as_runtime_sends_them(pairs, tokenizer):
    """(prompt text, answer) pairs -> right-padded input_ids/attention_mask rows (zeros as padding,
    as the runtime pads ragged columns), plus each row's response length."""
    seqs, lens = [], []
    for content, answer in pairs:
        prompt = models.encode_prompt(tokenizer, [{"role": "user", "content": content}])
        response = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(prompt + response)
        lens.append(len(response))
    width = max(map(len, seqs))
    input_ids = torch.zeros((len(seqs), width), dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, :len(s)] = torch.tensor(s)
        attention_mask[i, :len(s)] = 1
    return input_ids, attention_mask, lens


PAIRS = [("3+4=", "7"), ("9+9=", "18"), ("count a in abcab", "2"), ("0+0=", "0"), ("5+2=", "17+1"),
         ("1+1=", "")]


def score(w, pairs, is_padding=None, micro_batch_size=32, outputs=("rm_scores",)):
    ids, mask, lens = rows_as_runtime_sends_them(pairs, w.tokenizer)
    is_padding = is_padding or (False,) * len(pairs)
    out = w.compute_rm_score(ids, mask, micro_batch_size=micro_batch_size,
                             ctx=make_ctx(w.model_path, is_padding, lens, outputs))
    return out, lens


def test_batched_scores_equal_one_row_at_a_time(rm_path):
    w = worker(rm_path)
    out, lens = score(w, PAIRS)
    batched = torch.stack([out["rm_scores"][i, n - 1] for i, n in enumerate(lens)])
    single = torch.stack([score(w, [p])[0]["rm_scores"][0, n - 1] for p, n in zip(PAIRS, lens)])
    assert torch.allclose(batched, single, atol=1e-5), (batched, single)
    assert len(set(round(float(s), 5) for s in single)) == len(PAIRS)  # the scores do depend on the text


def test_reads_the_last_real_token_even_when_pad_equals_eos(rm_path, tmp_path):
    # many real RMs have pad_token == eos_token; transformers' own pooling (rightmost non-pad token)
    # would then skip the response's closing EOS. Reading the attention mask does not.
    w = worker(rm_path)
    ids, mask, _ = rows_as_runtime_sends_them(PAIRS[:3], w.tokenizer)
    eos = w.tokenizer.eos_token_id
    ours = rm.score_sequences(w.model, ids, mask, pad_token_id=eos)
    alone = torch.cat([rm.score_sequences(w.model, ids[i:i + 1, :int(mask[i].sum())],
                                          mask[i:i + 1, :int(mask[i].sum())]) for i in range(3)])
    assert torch.allclose(ours, alone, atol=1e-5)
    # what transformers' pooling gives when pad == eos: the token before the closing EOS
    w.model.config.pad_token_id = eos
    with torch.no_grad():
        hf = w.model(input_ids=ids.masked_fill(mask == 0, eos), attention_mask=mask).logits[:, 0]
    assert not torch.allclose(hf, alone, atol=1e-4)
    # left-padded rows (verl's layout for prompts) give the same scores
    width = ids.shape[1]
    left_ids = torch.zeros_like(ids)
    left_mask = torch.zeros_like(mask)
    for i in range(3):
        n = int(mask[i].sum())
        left_ids[i, width - n:] = ids[i, :n]
        left_mask[i, width - n:] = 1
    assert torch.allclose(rm.score_sequences(w.model, left_ids, left_mask, 0), alone, atol=1e-5)


def test_score_sits_on_the_last_response_token_and_padding_rows_score_zero(rm_path):
    w = worker(rm_path)
    padding = (False, True, False, False, True, False)
    out, lens = score(w, PAIRS, is_padding=padding)
    s = out["rm_scores"]
    assert s.dtype == torch.float32 and s.shape == (len(PAIRS), max(lens))
    for i, n in enumerate(lens):
        others = torch.cat([s[i, :n - 1], s[i, n:]])
        assert torch.all(others == 0)
        assert (s[i, n - 1] == 0) == padding[i]
    assert (w.calls, w.rows_scored) == (1, 4)
    full, _ = score(w, PAIRS)
    real = [i for i, p in enumerate(padding) if not p]
    assert torch.allclose(s[real], full["rm_scores"][real], atol=1e-5)


def test_micro_batches_give_the_same_scores(rm_path):
    w = worker(rm_path)
    one, _ = score(w, PAIRS, micro_batch_size=64)
    for mb in (1, 2, 4):
        assert torch.allclose(score(w, PAIRS, micro_batch_size=mb)[0]["rm_scores"], one["rm_scores"], atol=1e-5)


def test_output_is_named_by_the_declared_column(rm_path):
    w = worker(rm_path)
    out, _ = score(w, PAIRS[:2], outputs=("token_level_scores",))
    assert list(out) == ["token_level_scores"]
    ids, mask, lens = rows_as_runtime_sends_them(PAIRS[:2], w.tokenizer)
    bare = SimpleNamespace(is_padding=(False, False), lengths={"response_len": tuple(lens)})  # no outputs
    assert list(w.compute_rm_score(ids, mask, ctx=bare)) == ["rm_scores"]


def test_bad_model_path_names_the_path_and_the_fix(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(RLGraphError) as e:
        worker(missing)
    assert isinstance(e.value, rm.RewardModelError)
    assert str(missing) in str(e.value) and "prepare_tiny_reward_model" in str(e.value)
    with pytest.raises(RLGraphError, match="model_path is not set"):
        rm.RewardModelWorker().setup(make_ctx("", (), ()))


def test_a_causal_lm_is_not_taken_for_a_reward_model(tmp_path):
    path = models.build_tiny_model(tmp_path / "policy", hidden_size=32, num_heads=2)
    with pytest.raises(rm.RewardModelError, match="AutoModelForSequenceClassification") as e:
        worker(path)
    assert str(path) in str(e.value)


def test_a_policy_with_another_tokenizer_is_refused(rm_path, tmp_path):
    other = tmp_path / "other_tok"
    models.char_tokenizer("zyx0123456789").save_pretrained(other)
    ctx = make_ctx(rm_path, (), ())
    ctx.config["actor"] = {"model_path": str(other)}
    with pytest.raises(rm.RewardModelError, match="another tokenizer"):
        rm.RewardModelWorker().setup(ctx)
    ctx.config["reward_model"]["check_tokenizer"] = False
    rm.RewardModelWorker().setup(ctx)
    models.char_tokenizer().save_pretrained(tmp_path / "same_tok")  # the tiny policy's tokenizer: fine
    ctx.config["reward_model"]["check_tokenizer"] = True
    ctx.config["actor"] = {"model_path": str(tmp_path / "same_tok")}
    rm.RewardModelWorker().setup(ctx)


@pytest.mark.slow  # ~20 s on 2 idle cores: a warm start and 300 RM steps
def test_trained_tiny_reward_model_prefers_correct_answers(tmp_path):
    path = rm.prepare_tiny_reward_model(tmp_path / "tiny_rm", task="add", steps=300, sft_steps=150)
    assert (path / "config.json").is_file() and not (tmp_path / "tiny_rm.partial").exists()
    assert rm.prepare_tiny_reward_model(path) == path  # cached: a second call does nothing
    w = worker(path)
    test_rows = tasks.make_rows("add", 24, seed=5, split="test")  # prompts never trained on
    pairs = []
    for r in test_rows:
        content, answer = r["prompt"][0]["content"], r["reward_model"]["ground_truth"]
        far = str(int(answer) + 3) if int(answer) < 10 else str(int(answer) - 4)
        pairs += [(content, answer), (content, far), (content, answer + "+")]
    out, lens = score(w, pairs)
    s = torch.stack([out["rm_scores"][i, n - 1] for i, n in enumerate(lens)]).view(-1, 3)
    accuracy = float((s[:, :1] > s[:, 1:]).float().mean())
    assert accuracy >= 0.7, accuracy  # typically 0.8-0.9
