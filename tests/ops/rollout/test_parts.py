"""How transformers generation splits a call's groups into micro-batches (`parts.micro_batches`)."""

import pytest
import torch

from rlgraph.ops.rollout.parts import micro_batches


def _groups(prompt_lens, n=2):
    prompts = [torch.ones(length, dtype=torch.long) for length in prompt_lens for _ in range(n)]
    groups = [list(range(i * n, (i + 1) * n)) for i in range(len(prompt_lens))]
    return groups, prompts


def test_a_fixed_size_counts_groups():
    groups, prompts = _groups([3] * 5)
    assert [len(b) for b in micro_batches(groups, prompts, 2, 10**9, 4)] == [2, 2, 1]


def test_size_zero_fills_the_token_budget_in_order():
    groups, prompts = _groups([3, 3, 3, 3, 3])  # each group: 2 rows x (3 + 5) = 16 tokens
    batches = micro_batches(groups, prompts, 0, 48, 5)
    assert [len(b) for b in batches] == [3, 2]
    assert [g for b in batches for g in b] == groups  # every group once, in order


def test_a_long_prompt_widens_the_whole_batch():
    groups, prompts = _groups([2, 2, 10, 2])  # padded to the longest prompt: 10 + 2 = 12 per row
    batches = micro_batches(groups, prompts, 0, 40, 2)
    # [2, 2] -> 4 rows x 4 = 16; adding the 10-token prompt -> 6 rows x 12 = 72 > 40: a new batch
    assert [len(b) for b in batches] == [2, 1, 1]
    assert all((sum(len(g) for g in b) * (max(len(prompts[i]) for g in b for i in g) + 2) <= 40) or len(b) == 1
               for b in batches)


def test_a_group_larger_than_the_budget_still_gets_its_own_call():
    groups, prompts = _groups([50, 50], n=4)
    assert [len(b) for b in micro_batches(groups, prompts, 0, 16, 8)] == [1, 1]


def test_the_whole_grpo_example_batch_is_one_call_by_default():
    groups, prompts = _groups([8] * 64, n=8)  # 64 prompts x 8 samples, 8-token prompts, 4 new tokens
    assert len(micro_batches(groups, prompts, 0, 16384, 4)) == 1


def test_hf_rollout_log_probs_are_each_token_s_log_softmax_of_the_processed_scores(tmp_path):
    """hf_parts computes the log-probs one generation step at a time for all rows; they equal each row's own
    log_softmax of the scores generate returns (the same draw, the same seed), to the bit, up to its stop."""
    from rlgraph.ops import models
    from rlgraph.ops.rollout.parts import cut_lengths, hf_parts
    from rlgraph.rows import left_pad

    path = models.build_tiny_model(tmp_path / "m", hidden_size=32, num_heads=2, seed=1)
    model, tok = models.load_causal_lm(path), models.load_tokenizer(path, padding_side="left")
    prompts = [torch.tensor(tok.encode(t)) for t in ("1+2=", "1+2=", "34+5=", "34+5=")]
    ((positions, cols),) = list(hf_parts(model, tok, prompts, [False] * 4, n=2, seed=7, micro_batch_size=0,
                                         temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=5, logprobs=True))
    assert positions == [0, 1, 2, 3]
    ids, mask = left_pad(prompts, tok.pad_token_id)
    from rlgraph.seeds import stable_seed

    torch.manual_seed(stable_seed(7, 0))
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=True, temperature=1.0,
                         top_p=1.0, top_k=None, pad_token_id=tok.pad_token_id, eos_token_id=[tok.eos_token_id],
                         return_dict_in_generate=True, output_scores=True)
    new = out.sequences[:, ids.shape[1]:]
    for j, length in enumerate(cut_lengths(new, {tok.eos_token_id})):
        assert torch.equal(cols["responses"][j], new[j, :length])
        scores = torch.stack([s[j] for s in out.scores[:length]]).float()
        want = torch.log_softmax(scores, dim=-1).gather(-1, new[j, :length, None]).squeeze(-1)
        assert torch.equal(cols["rollout_log_probs"][j], want)


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 3), (0.0, 0)])
def test_hf_parts_draw_what_generate_draws_with_keyword_arguments(tmp_path, temperature, top_k):
    """hf_parts hands generate a cached GenerationConfig and seeds only the device it samples on; the
    samples equal generate's with the same settings as keyword arguments after torch.manual_seed,
    also where the model's own generation_config sets top_k and top_p (rlgraph's top_k=0 means none)."""
    from rlgraph.ops import models
    from rlgraph.ops.rollout.parts import cut_lengths, hf_parts
    from rlgraph.rows import left_pad
    from rlgraph.seeds import stable_seed

    path = models.build_tiny_model(tmp_path / "m", hidden_size=32, num_heads=2, seed=1)
    model, tok = models.load_causal_lm(path), models.load_tokenizer(path, padding_side="left")
    model.generation_config.top_k, model.generation_config.top_p = 2, 0.5  # a checkpoint's defaults
    prompts = [torch.tensor(tok.encode(t)) for t in ("1+2=", "1+2=", "34+5=", "34+5=")]
    got = []
    for _ in range(2):  # the second call reuses the cached config
        ((_, cols),) = list(hf_parts(model, tok, prompts, [False] * 4, n=2, seed=7, micro_batch_size=0,
                                     temperature=temperature, top_p=0.9, top_k=top_k, max_new_tokens=5))
        got.append([r.tolist() for r in cols["responses"]])
    ids, mask = left_pad(prompts, tok.pad_token_id)
    sample = temperature > 0
    torch.manual_seed(stable_seed(7, 0))
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=sample,
                         temperature=temperature if sample else None, top_p=0.9 if sample else None,
                         top_k=(top_k or None) if sample else None, pad_token_id=tok.pad_token_id,
                         eos_token_id=[tok.eos_token_id], return_dict_in_generate=True)
    new = out.sequences[:, ids.shape[1]:]
    want = [new[j, :n].tolist() for j, n in enumerate(cut_lengths(new, {tok.eos_token_id}))]
    assert got[0] == want and got[1] == want
