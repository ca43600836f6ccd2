"""Rollout: one generate call per rank, streaming its groups, on Hugging Face or vLLM.

A call holds a rank's whole share of the step's prompts (rows of one prompt are contiguous, one
row per sample; each padding row is a group of its own). Both backends yield ``(positions,
columns)`` parts, so the runtime hands each part to the ops downstream as soon as it exists:

- `hf_parts`: transformers ``generate`` on micro-batches of ``micro_batch_size`` groups, each
  seeded from the call's seed and its index, a part per micro-batch;
- `vllm_parts`: every group submitted to the engine at once (one request per prompt, ``n``
  samples each, seeded per prompt), a part per group the moment its last sample finishes. With
  partial rollout, newer weights may be loaded between engine steps: a response started under
  one policy version finishes under the next, and its part says which.

Padding rows are not generated: each gets a one-token response (EOS) with ``response_mask`` 0,
the minimal row of BRIEF section 2, handed over first. A response ends at and includes its first
stop token (EOS or one of ``stop_token_ids``); its ``response_mask`` is 1 on exactly those tokens.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch

from rlgraph.ops.names import parse_token_ids
from rlgraph.seeds import stable_seed

# parse_token_ids is rlgraph.ops.names's (torch-free: the compiler checks the param with it)
__all__ = ["GEN_COLUMNS", "VERSIONS", "groups_of", "hf_parts", "vllm_parts", "response_columns", "parse_token_ids",
           "cut_lengths", "left_pad"]

GEN_COLUMNS = ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids",
               "rollout_log_probs")

Part = tuple[list[int], dict[str, list]]
VERSIONS = "weight_labels"  # not a column: a vllm part's per-row weight labels of its (first, last) token


def response_columns(prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor],
                     is_padding: Sequence[bool], log_probs: Sequence[torch.Tensor] | None) -> dict[str, list]:
    """The generate op's per-sample output columns, one entry per row (views into one flat tensor
    per column: a few concatenations and splits, no per-row allocations)."""
    if not prompts:
        return {k: [] for k in GEN_COLUMNS}
    plen = [len(p) for p in prompts]
    rlen = [len(r) for r in responses]
    slen = [a + b for a, b in zip(plen, rlen)]
    prompt_flat = torch.cat(list(prompts)).long()
    response_flat = torch.cat(list(responses)).long()
    seq_flat = torch.cat([t for pair in zip(prompts, responses) for t in pair]).long()
    real = torch.tensor([0 if pad else 1 for pad in is_padding], dtype=torch.long)
    starts = torch.tensor(slen, dtype=torch.long).cumsum(0) - torch.tensor(slen, dtype=torch.long)
    positions = torch.arange(sum(slen), dtype=torch.long) - starts.repeat_interleave(torch.tensor(slen))
    lp = (torch.cat([t.float().reshape(-1) for t in log_probs]) if log_probs is not None
          else torch.zeros(sum(rlen)))
    return {
        "prompts": list(prompt_flat.split(plen)),
        "responses": list(response_flat.split(rlen)),
        "response_mask": list(real.repeat_interleave(torch.tensor(rlen)).split(rlen)),
        "input_ids": list(seq_flat.split(slen)),
        "attention_mask": list(torch.ones(sum(slen), dtype=torch.long).split(slen)),
        "position_ids": list(positions.split(slen)),
        "rollout_log_probs": list(lp.split(rlen)),
    }


def groups_of(is_padding: Sequence[bool], n: int) -> tuple[list[int], list[list[int]]]:
    """(padding positions, real groups as position lists) of a call: real rows come in runs of
    `n` per prompt (calls are group-aligned), each padding row alone."""
    padding = [i for i, p in enumerate(is_padding) if p]
    real = [i for i, p in enumerate(is_padding) if not p]
    if len(real) % n:
        raise ValueError(f"a generate call got {len(real)} real rows, not whole groups of n={n}")
    return padding, [real[k:k + n] for k in range(0, len(real), n)]


def _cut(tokens: Sequence[int], stop: set[int]) -> int:
    """Length of a response that ends at (and includes) its first stop token."""
    for k, t in enumerate(tokens):
        if t in stop:
            return k + 1
    return len(tokens)


def cut_lengths(tokens: torch.Tensor, stop: set[int]) -> list[int]:
    """`_cut` of every row of `tokens` [rows, width] at once: each row's length up to and including
    its first stop token, or the whole width."""
    ids = sorted(t for t in stop if t is not None)
    width = tokens.shape[1]
    if not ids or tokens.numel() == 0:
        return [width] * tokens.shape[0]
    hits = torch.isin(tokens, torch.tensor(ids, dtype=tokens.dtype))
    first = hits.to(torch.int8).argmax(dim=1)  # the first hit's column (0 where there is none)
    return torch.where(hits.any(dim=1), first + 1, width).tolist()


def left_pad(prompts: Sequence[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`prompts` as one left-padded batch (generation continues from the last column) and its
    attention mask, both ``long`` [rows, longest prompt]."""
    ids = torch.nn.utils.rnn.pad_sequence([p.long() for p in prompts], batch_first=True, padding_value=pad,
                                          padding_side="left")
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    mask = (torch.arange(ids.shape[1]) >= (ids.shape[1] - lengths).unsqueeze(1)).long()
    return ids, mask


def _part(positions: list[int], prompts: Sequence[torch.Tensor], responses: dict[int, torch.Tensor],
          is_padding: Sequence[bool], log_probs: dict[int, torch.Tensor] | None) -> Part:
    cols = response_columns([prompts[i] for i in positions], [responses[i] for i in positions],
                            [is_padding[i] for i in positions],
                            [log_probs[i] for i in positions] if log_probs is not None else None)
    return positions, cols


def _padding_part(prompts: Sequence[torch.Tensor], padding: list[int], is_padding: Sequence[bool], eos: int,
                  logprobs: bool) -> Part:
    one = {i: torch.tensor([eos]) for i in padding}
    return _part(padding, prompts, one, is_padding, {i: torch.zeros(1) for i in padding} if logprobs else None)


def micro_batches(groups: Sequence[Sequence[int]], prompts: Sequence[torch.Tensor], size: int, max_tokens: int,
                  max_new_tokens: int) -> list[list[Sequence[int]]]:
    """`groups` in order, `size` a call; with `size` 0, each call takes groups while its rows x (its
    longest prompt + `max_new_tokens`) stay within `max_tokens` (one group at least): the padded
    batch transformers computes, sized for the engine rather than a fixed count."""
    if size > 0:
        return [list(groups[i:i + size]) for i in range(0, len(groups), size)]
    out: list[list[Sequence[int]]] = []
    batch: list[Sequence[int]] = []
    rows = width = 0
    for g in groups:
        w = max(width, max(len(prompts[i]) for i in g))
        if batch and (rows + len(g)) * (w + max_new_tokens) > max_tokens:
            out.append(batch)
            batch, rows, w = [], 0, max(len(prompts[i]) for i in g)
        batch.append(g)
        rows += len(g)
        width = w
    if batch:
        out.append(batch)
    return out


@torch.no_grad()
def hf_parts(model: Any, tokenizer: Any, prompts: Sequence[torch.Tensor], is_padding: Sequence[bool], *, n: int,
             seed: int, micro_batch_size: int, temperature: float, top_p: float, top_k: int, max_new_tokens: int,
             stop_token_ids: Sequence[int] = (), logprobs: bool = False, max_batch_tokens: int = 16384,
             refresh: Callable[[], bool] | None = None) -> Iterator[Part]:
    """transformers ``generate`` on micro-batches of `micro_batch_size` groups (0: as many as
    `micro_batches` fits in `max_batch_tokens`), a part per micro-batch. `refresh` (partial rollout) is
    called before each micro-batch; it may change `model`'s weights."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    stop = {eos, *stop_token_ids}
    padding, groups = groups_of(is_padding, n)
    if padding:
        yield _padding_part(prompts, padding, is_padding, eos, logprobs)
    for k, batch in enumerate(micro_batches(groups, prompts, micro_batch_size, max_batch_tokens, max_new_tokens)):
        if refresh is not None:
            refresh()
        rows = [i for g in batch for i in g]
        ids, mask = left_pad([prompts[i] for i in rows], pad)
        width = ids.shape[1]
        torch.manual_seed(stable_seed(seed, k))  # the same rows draw the same samples in any schedule
        sample = temperature > 0
        device = next(model.parameters()).device  # the worker's GPU when it has one
        out = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens, do_sample=sample,
            temperature=temperature if sample else None, top_p=top_p if sample else None,
            top_k=(top_k or None) if sample else None, pad_token_id=pad, eos_token_id=sorted(stop),
            return_dict_in_generate=True, output_scores=logprobs)
        new = out.sequences[:, width:].cpu()
        responses, lps = {}, {} if logprobs else None
        # each token's log-prob under the processed scores, one step at a time for all rows (a [rows, vocab]
        # log_softmax each), not one row at a time: 128 rows of 4 tokens took 1.9 ms, now 0.24 ms
        table = (torch.stack([torch.log_softmax(s.float(), dim=-1).gather(-1, new[:, t, None].to(s.device)).squeeze(-1)
                              for t, s in enumerate(out.scores)], dim=1).cpu() if logprobs else None)
        for j, (i, length) in enumerate(zip(rows, cut_lengths(new, stop))):
            responses[i] = new[j, :length]  # a view: response_columns copies the part's rows into its columns
            if lps is not None:
                lps[i] = table[j, :length]
        yield _part(rows, prompts, responses, is_padding, lps)


def vllm_parts(engine: Any, prompts: Sequence[torch.Tensor], is_padding: Sequence[bool], eos: int, *, n: int,
               seed: int, temperature: float, top_p: float, top_k: int, max_new_tokens: int,
               stop_token_ids: Sequence[int] = (), logprobs: bool = False,
               refresh: Callable[[], bool] | None = None) -> Iterator[Part]:
    """Every group submitted to `engine` (a `VLLMEngine`) at once; a part per group as it finishes.
    Each part also holds ``VERSIONS``: per row, the weight labels of its first and last response
    token (they differ when `refresh`, called between engine steps, loaded new weights: partial
    rollout, see `VLLMEngine.generate`)."""
    padding, groups = groups_of(is_padding, n)
    if padding:
        yield _padding_part(prompts, padding, is_padding, eos, logprobs)
    if not groups:
        return
    stop = {eos, *stop_token_ids}
    heads = [prompts[g[0]].tolist() for g in groups]  # the rows of a group repeat one prompt
    for done in engine.generate(heads, n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                                max_tokens=max_new_tokens, stop_token_ids=sorted(stop - {eos}),
                                seeds=[stable_seed(seed, k) for k in range(len(groups))], logprobs=logprobs,
                                refresh=refresh):
        rows = groups[done.index]
        responses, row_lps = {}, {} if logprobs else None
        for j, i in enumerate(rows):
            length = _cut(done.tokens[j], stop)
            responses[i] = torch.tensor(done.tokens[j][:length], dtype=torch.long)
            if row_lps is not None:
                row_lps[i] = torch.tensor(done.logprobs[j][:length], dtype=torch.float32)
        positions, cols = _part(rows, prompts, responses, is_padding, row_lps)
        cols[VERSIONS] = list(done.labels)
        yield positions, cols
