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

import functools
from typing import Any, Callable, Iterator, Sequence

import torch

from rlgraph.ops.names import parse_token_ids
from rlgraph.rows import Rows, left_pad, trimmed_rows
from rlgraph.seeds import stable_seed

# parse_token_ids is rlgraph.ops.names's (torch-free: the compiler checks the param with it)
__all__ = ["GEN_COLUMNS", "VERSIONS", "groups_of", "hf_parts", "vllm_parts", "response_columns", "parse_token_ids",
           "cut_lengths", "seed_device", "generation_config"]

GEN_COLUMNS = ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids",
               "rollout_log_probs")

Part = tuple[list[int], dict[str, list]]
VERSIONS = "weight_labels"  # not a column: a vllm part's per-row weight labels of its (first, last) token


def response_columns(prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor],
                     is_padding: Sequence[bool], log_probs: Sequence[torch.Tensor] | None) -> dict[str, list]:
    """The generate op's per-sample output columns, one entry per row (`Rows`: views into one flat
    tensor per column, a few concatenations and splits, no per-row allocations)."""
    if not prompts:
        return {k: [] for k in GEN_COLUMNS}
    plen = [p.shape[0] for p in prompts]  # not len(): Tensor.__len__ is a Python call (~1 us a row)
    rlen = [r.shape[0] for r in responses]
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
        "prompts": Rows(prompt_flat, plen),
        "responses": Rows(response_flat, rlen),
        "response_mask": Rows(real.repeat_interleave(torch.tensor(rlen)), rlen),
        "input_ids": Rows(seq_flat, slen),
        "attention_mask": Rows(torch.ones(sum(slen), dtype=torch.long), slen),
        "position_ids": Rows(positions, slen),
        "rollout_log_probs": Rows(lp, rlen),
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
        longest = max(prompts[i].shape[0] for i in g)
        w = max(width, longest)
        if batch and (rows + len(g)) * (w + max_new_tokens) > max_tokens:
            out.append(batch)
            batch, rows, w = [], 0, longest
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
        device = next(model.parameters()).device  # the worker's GPU when it has one
        seed_device(device, stable_seed(seed, k))  # the same rows draw the same samples in any schedule
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=generation_config(
            max_new_tokens, temperature, top_p, top_k, pad, tuple(sorted(stop)), logprobs))
        new = out.sequences[:, width:].cpu()
        # each token's log-prob under the processed scores, one step at a time for all rows (a [rows, vocab]
        # log_softmax each), not one row at a time: 128 rows of 4 tokens took 1.9 ms, now 0.24 ms
        table = (torch.stack([torch.log_softmax(s.float(), dim=-1).gather(-1, new[:, t, None].to(s.device)).squeeze(-1)
                              for t, s in enumerate(out.scores)], dim=1).cpu() if logprobs else None)
        lengths = cut_lengths(new, stop)  # views of one copy each: response_columns joins the part's rows
        responses = dict(zip(rows, trimmed_rows(new, lengths)))
        lps = dict(zip(rows, trimmed_rows(table, lengths))) if table is not None else None
        yield _part(rows, prompts, responses, is_padding, lps)


def seed_device(device: torch.device, seed: int) -> None:
    """Seed the generator that sampling on `device` draws from (and the CPU's). ``torch.manual_seed``
    also seeds every accelerator type torch knows; where one is not started, each call queues the
    seeding with a formatted stack (three a call: ~0.1 ms, and a queue that grows every step)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
    elif device.type != "cpu":
        torch.manual_seed(seed)


@functools.lru_cache(maxsize=64)
def generation_config(max_new_tokens: int, temperature: float, top_p: float, top_k: int, pad: int,
                      eos: tuple[int, ...], scores: bool) -> Any:
    """The ``GenerationConfig`` of a micro-batch, made once per setting (transformers copies it per
    call). Handed keyword arguments instead, ``generate`` checks the model's config for legacy
    generation fields first: 0.6 ms a call. Every value is set, none left None, so that the
    model's own ``generation_config`` fills only what rlgraph does not set, as it does for keyword
    arguments: top-k off is 0, not None (a None would take the model's or transformers' 50)."""
    from transformers import GenerationConfig

    sample = temperature > 0
    return GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=sample, pad_token_id=pad, eos_token_id=list(eos),
        return_dict_in_generate=True, output_scores=scores,
        **({"temperature": temperature, "top_p": top_p, "top_k": top_k} if sample else {}))


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
