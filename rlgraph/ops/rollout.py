"""Generation with Hugging Face transformers: one call per chunk of prompts, seeded per chunk.

Padding rows are not generated: each gets a one-token response (EOS) with ``response_mask``
0, the minimal row of BRIEF section 2. A response ends at and includes its first EOS; its
``response_mask`` is 1 on exactly those tokens.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["generate_hf", "response_columns"]


def response_columns(prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor],
                     is_padding: Sequence[bool], log_probs: Sequence[torch.Tensor] | None) -> dict[str, list]:
    """The generate op's output columns, one entry per row."""
    out: dict[str, list] = {k: [] for k in ("prompts", "responses", "response_mask", "input_ids", "attention_mask",
                                             "position_ids", "rollout_log_probs")}
    for i, (p, r) in enumerate(zip(prompts, responses)):
        seq = torch.cat([p, r]).long()
        out["prompts"].append(p.long())
        out["responses"].append(r.long())
        out["response_mask"].append(torch.full((len(r),), 0 if is_padding[i] else 1, dtype=torch.long))
        out["input_ids"].append(seq)
        out["attention_mask"].append(torch.ones(len(seq), dtype=torch.long))
        out["position_ids"].append(torch.arange(len(seq), dtype=torch.long))
        out["rollout_log_probs"].append(log_probs[i] if log_probs is not None else torch.zeros(len(r)))
    return out


@torch.no_grad()
def generate_hf(model: Any, tokenizer: Any, prompts: Sequence[torch.Tensor], is_padding: Sequence[bool], *,
                seed: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, max_new_tokens: int = 16,
                calculate_log_probs: bool = False) -> dict[str, list]:
    """Sample one response per row (rows of one prompt are repeated n times by the source)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    real = [i for i, p in enumerate(is_padding) if not p]
    responses: list[torch.Tensor] = [torch.tensor([eos]) for _ in prompts]
    log_probs: list[torch.Tensor] | None = [torch.zeros(1) for _ in prompts] if calculate_log_probs else None
    if real:
        width = max(len(prompts[i]) for i in real)
        ids = torch.full((len(real), width), pad, dtype=torch.long)
        mask = torch.zeros((len(real), width), dtype=torch.long)
        for j, i in enumerate(real):  # left padding: generation continues from the last column
            ids[j, width - len(prompts[i]):] = prompts[i]
            mask[j, width - len(prompts[i]):] = 1
        torch.manual_seed(seed)  # the chunk's seed: the same rows draw the same samples in any schedule
        sample = temperature > 0
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=sample,
            temperature=temperature if sample else None, top_p=top_p if sample else None,
            top_k=(top_k or None) if sample else None, pad_token_id=pad, eos_token_id=eos,
            return_dict_in_generate=True, output_scores=calculate_log_probs)
        new = out.sequences[:, width:]
        for j, i in enumerate(real):
            row = new[j]
            hits = (row == eos).nonzero()
            length = int(hits[0]) + 1 if len(hits) else len(row)
            responses[i] = row[:length].clone()
            if log_probs is not None:
                scores = torch.stack([s[j] for s in out.scores[:length]]).float()  # [length, vocab]
                log_probs[i] = torch.log_softmax(scores, dim=-1).gather(-1, row[:length, None]).squeeze(-1)
    return response_columns(prompts, responses, is_padding, log_probs)
