"""Sequence layouts: ragged rows of the data plane <-> the padded batches a model takes.

Rows are stored unpadded (a prompt of P_i tokens, a response of R_i tokens). For a forward pass
a chunk is packed verl-style: prompts left-padded to the chunk's longest prompt P, responses
right-padded to its longest response R, so every response starts at column P and

    logits[:, P - 1 + t]  predicts  response token t        (t = 0 .. R-1)

which makes response log-probs a slice instead of a per-row gather.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

__all__ = ["Packed", "pack", "repack", "response_logits"]


class Packed(NamedTuple):
    input_ids: torch.Tensor  # [b, P + R]
    attention_mask: torch.Tensor  # [b, P + R]
    position_ids: torch.Tensor  # [b, P + R]
    response_mask: torch.Tensor  # [b, R] 1 on real response tokens
    prompt_width: int  # P
    response_width: int  # R


def pack(prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor], pad_id: int) -> Packed:
    """Left-pad prompts and right-pad responses into one [b, P + R] batch."""
    b = len(prompts)
    P = max(len(p) for p in prompts)
    R = max(len(r) for r in responses)
    input_ids = torch.full((b, P + R), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, P + R), dtype=torch.long)
    response_mask = torch.zeros((b, R), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, P - len(p):P] = p
        input_ids[i, P:P + len(r)] = r
        attention_mask[i, P - len(p):P + len(r)] = 1
        response_mask[i, :len(r)] = 1
    # positions count real tokens only, so left padding does not shift them
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return Packed(input_ids, attention_mask, position_ids, response_mask, P, R)


def repack(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_lengths: Sequence[int],
           pad_id: int) -> Packed:
    """`pack` of the prompts and responses cut out of right-padded prompt+response rows (row i:
    its prompt, then its response, then padding), in one gather, without a loop over rows."""
    b = input_ids.shape[0]
    total = attention_mask.sum(dim=1).long()
    r = torch.as_tensor(list(response_lengths), dtype=torch.long).reshape(b)
    p = total - r
    P = int(p.max()) if b else 0
    R = int(r.max()) if b else 0
    cols = torch.arange(P + R).unsqueeze(0)  # [1, P + R]
    in_prompt = (cols < P) & (cols >= P - p.unsqueeze(1))
    in_response = (cols >= P) & (cols < P + r.unsqueeze(1))
    # where each output column reads from in the right-padded row
    src = torch.where(cols < P, cols - (P - p.unsqueeze(1)), p.unsqueeze(1) + cols - P)
    real = in_prompt | in_response
    gathered = torch.gather(input_ids.long(), 1, src.clamp(min=0, max=max(input_ids.shape[1] - 1, 0)))
    ids = torch.where(real, gathered, torch.full_like(gathered, pad_id))
    mask = real.long()
    position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
    response_mask = in_response[:, P:].long()
    return Packed(ids, mask, position_ids, response_mask, P, R)


def response_logits(model: torch.nn.Module, packed: Packed, temperature: float = 1.0) -> torch.Tensor:
    """Logits predicting each response token, [b, R, vocab], divided by the sampling temperature."""
    out = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                position_ids=packed.position_ids, use_cache=False)
    P, R = packed.prompt_width, packed.response_width
    logits = out.logits[:, P - 1:P - 1 + R, :].float()
    return logits / temperature if temperature > 0 else logits
