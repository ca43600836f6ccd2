"""Response log-probs and entropy without the full ``[tokens, vocab]`` logits, padded or packed.

A causal LM's forward returns float logits for every position: a 4,096-token response with a
152k vocabulary is 2.5 GB per sequence in float32, and autograd keeps them (and their softmax)
for the backward pass. Here the logits are never materialised at once:

- `enable_token_logprobs(model)` gives the model *instance* a forward that, when called with
  ``logprob_index``, runs the decoder only (``model.get_decoder()``), keeps the hidden states of
  the positions that predict response tokens, and computes ``log p(label)`` (and the entropy) a
  chunk of `chunk` positions at a time from the output embedding. Called without it, the forward
  is the model's own (generation is unchanged). Going through the instance's forward keeps
  DDP's and FSDP2's hooks (gradient reduction, parameter all-gathers) in the call.
- Under autograd every chunk is checkpointed (`torch.utils.checkpoint`): backward recomputes the
  chunk's logits instead of storing them, so the peak is one chunk's ``[chunk, vocab]`` float32
  block, independent of the response length (BRIEF: entropy and log-probs over blocks of rows).

Two layouts of a micro-batch (`Layout`): *padded*, the verl layout of `sequences.repack`
(prompts left-padded to P, responses right-padded to R), and *packed*: the rows' real tokens
concatenated into one row with position ids restarting at 0 for each sequence and no attention
mask, so transformers' masking keeps attention within each sequence (its packed-sequence
detection from position ids) and no padding token is computed. Both return ``[b, R]`` tensors (packed:
zero past each response; padded: whatever the padding slots give, for the caller's mask), so the
losses are the same code either way.

A model whose logits are not ``output_embeddings(hidden)`` (no ``get_decoder``, or a logit scale
or soft-cap this module does not know) takes the plain path: the full logits, then the same
selection. ``fused_supported`` says which.
"""

from __future__ import annotations

import types
from typing import Any, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from rlgraph.ops.train.sequences import Packed

__all__ = ["Layout", "Scores", "padded_layout", "packed_layout", "layout_for", "enable_token_logprobs",
           "fused_supported", "response_logprobs", "response_scores", "scored", "score_rows", "score_rows_top_k",
           "DEFAULT_CHUNK"]

DEFAULT_CHUNK = 1024  # positions per logits block: 1024 x 152k vocabulary x 4 bytes = 0.6 GB


class Scores(NamedTuple):
    """A pass's results, ``[b, R]`` each, and ``[b, R, k]`` for the side values: the log-probs of the
    `top_k` most likely tokens and their ids (a distillation teacher's), or the log-probs of given
    ids (the student's at the teacher's top-k); None when not asked for."""

    logp: Tensor
    entropy: Tensor | None
    side_logp: Tensor | None = None
    side_ids: Tensor | None = None


class Layout(NamedTuple):
    """What one forward pass takes, and where its response tokens are."""

    input_ids: Tensor  # [B, T]
    attention_mask: Tensor | None  # [B, T]; None when packed (sequences told apart by position_ids)
    position_ids: Tensor  # [B, T]
    index: Tensor  # [N] flat positions (b * T + t) whose hidden state predicts a response token
    labels: Tensor  # [N] that token
    rows: Tensor  # [N] its row in the [b, R] result
    cols: Tensor  # [N] its column (the token's place in its response)
    shape: tuple[int, int]  # (b, R) of the result
    tokens: int  # positions the forward computes (B * T): what the layout costs


def padded_layout(packed: Packed) -> Layout:
    """Every response slot of the verl layout, real or padding (the result's mask zeroes padding)."""
    b, R, P = packed.input_ids.shape[0], packed.response_width, packed.prompt_width
    width, dev = packed.input_ids.shape[1], packed.input_ids.device
    rows = torch.arange(b, device=dev).repeat_interleave(R)
    cols = torch.arange(R, device=dev).repeat(b)
    index = rows * width + (P - 1) + cols
    labels = packed.input_ids[:, P:P + R].reshape(-1)
    return Layout(packed.input_ids, packed.attention_mask, packed.position_ids, index, labels, rows, cols, (b, R),
                  b * width)


def packed_layout(packed: Packed) -> Layout:
    """The rows' real tokens (prompt then response) end to end in one row, positions restarting per row."""
    b, R, P = packed.input_ids.shape[0], packed.response_width, packed.prompt_width
    dev = packed.input_ids.device
    real = packed.attention_mask.bool()
    ids = packed.input_ids[real].unsqueeze(0)  # row-major: row 0's tokens, then row 1's, ...
    lengths = real.sum(dim=1)
    r = packed.response_mask.sum(dim=1)
    p = lengths - r
    starts = torch.cumsum(lengths, 0) - lengths
    positions = torch.arange(int(lengths.sum()), device=dev) - starts.repeat_interleave(lengths)
    rows = torch.arange(b, device=dev).repeat_interleave(r)
    cols = torch.arange(int(r.sum()), device=dev) - (torch.cumsum(r, 0) - r).repeat_interleave(r)
    index = (starts + p - 1).repeat_interleave(r) + cols  # the position before each response token
    src_rows, src_cols = rows, P + cols  # where that token sits in the padded layout
    labels = packed.input_ids[src_rows, src_cols]
    if bool((p[r > 0] < 1).any()):
        raise ValueError("a response without a prompt token cannot be scored: its first token has no position "
                         "before it")
    return Layout(ids, None, positions.unsqueeze(0), index, labels, rows, cols, (b, R), int(lengths.sum()))


def layout_for(packed: Packed, packing: bool, loss_mask: Tensor | None = None) -> tuple[Layout, Tensor]:
    """`packed`'s rows as one forward pass, and the rows it holds: all of them padded; packed, the rows
    with something to score (`loss_mask`, else the response mask), at least one so that every rank of
    a group runs a forward."""
    dev = packed.input_ids.device
    if not packing:
        return padded_layout(packed), torch.arange(packed.input_ids.shape[0], device=dev)
    has = (packed.response_mask if loss_mask is None else loss_mask).sum(dim=1) > 0
    keep = has.nonzero().flatten().to(dev)
    if keep.numel() == 0:
        keep = torch.zeros(1, dtype=torch.long, device=dev)
    sub = Packed(*(t[keep] for t in packed[:4]), packed.prompt_width, packed.response_width)
    return packed_layout(sub), keep


def scored(model: Any, packed: Packed, temperature: float, chunk: int, packing: bool, with_entropy: bool,
           loss_mask: Tensor | None = None, device: torch.device | None = None, top_k: int = 0,
           at_ids: Tensor | None = None) -> Scores:
    """Log-probs (and entropy; with `top_k` or `at_ids`, see `response_scores`) of `packed`'s responses,
    ``[b, R]``, on the model's device. `at_ids` is ``[b, R, k]``."""
    layout, keep = layout_for(packed, packing, loss_mask)
    if at_ids is not None:
        at_ids = at_ids[keep.to(at_ids.device)] if keep.numel() != packed.input_ids.shape[0] else at_ids
    s = response_scores(model, layout, temperature, chunk, with_entropy, device=device, top_k=top_k, at_ids=at_ids)
    if keep.numel() == packed.input_ids.shape[0]:
        return s
    b = packed.input_ids.shape[0]

    def full(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.new_zeros((b, *t.shape[1:])).index_copy(0, keep.to(t.device), t)

    return Scores(*(full(t) for t in s))


@torch.no_grad()
def score_rows(model: Any, input_ids: Tensor, attention_mask: Tensor, response_lengths: Sequence[int], pad_id: int,
               temperature: float = 1.0, chunk: int = DEFAULT_CHUNK, packing: bool = False, budget: int = 0,
               with_entropy: bool = False, rows_per_pass: int = 0) -> tuple[Tensor, Tensor | None]:
    """A forward-only op's scores of its rows (right-padded prompt + response, as ops receive them):
    float32 ``[b, R]`` log-probs (0 past each response) and entropy, in CPU memory. With `budget`, the
    rows go through the model in passes of at most that many tokens (`balance.token_micro_batches`);
    else, with `rows_per_pass`, in passes of that many rows."""
    s = score_rows_top_k(model, input_ids, attention_mask, response_lengths, pad_id, temperature, chunk, packing,
                         budget, with_entropy, rows_per_pass=rows_per_pass)
    return s.logp, s.entropy


@torch.no_grad()
def score_rows_top_k(model: Any, input_ids: Tensor, attention_mask: Tensor, response_lengths: Sequence[int],
                     pad_id: int, temperature: float = 1.0, chunk: int = DEFAULT_CHUNK, packing: bool = False,
                     budget: int = 0, with_entropy: bool = False, top_k: int = 0, rows_per_pass: int = 0) -> Scores:
    """`score_rows`, and with `top_k` the log-probs and ids of each position's `top_k` most likely tokens
    (``[b, R, k]``, k = min(top_k, vocabulary); 0 and id 0 past each response)."""
    from rlgraph.ops.train.engine.balance import token_micro_batches
    from rlgraph.ops.train.sequences import repack

    resp = list(response_lengths)
    whole = repack(input_ids, attention_mask, resp, pad_id)
    b, R = input_ids.shape[0], whole.response_width
    step = rows_per_pass if 0 < rows_per_pass < b else b
    parts = token_micro_batches(attention_mask.sum(dim=1).tolist(), budget) if budget else \
        [list(range(i, min(i + step, b))) for i in range(0, b, step)]
    logp = torch.zeros((b, R))
    ent = torch.zeros((b, R)) if with_entropy else None
    side_lp = side_ids = None
    for part in parts:
        rows = torch.tensor(part, dtype=torch.long)
        sub = whole if len(parts) == 1 else repack(input_ids[rows], attention_mask[rows], [resp[i] for i in part],
                                                    pad_id)
        s = scored(model, sub, temperature, chunk, packing, with_entropy, top_k=top_k)
        w, m = sub.response_width, sub.response_mask.cpu()
        logp[rows, :w] = (s.logp.cpu() * m).float()
        if ent is not None and s.entropy is not None:
            ent[rows, :w] = s.entropy.float().cpu()
        if top_k and s.side_logp is not None and s.side_ids is not None:
            if side_lp is None:
                k = s.side_logp.shape[-1]
                side_lp, side_ids = torch.zeros((b, R, k)), torch.zeros((b, R, k), dtype=torch.long)
            side_lp[rows, :w] = s.side_logp.float().cpu() * m[..., None]
            side_ids[rows, :w] = s.side_ids.cpu() * m[..., None].long()
    return Scores(logp, ent, side_lp, side_ids)


# ---------------------------------------------------------------------------- the model's forward
def fused_supported(model: torch.nn.Module) -> bool:
    """Whether `model`'s logits are its output embedding of the decoder's last hidden state, which
    the chunked path computes itself (else `response_logprobs` takes the full logits)."""
    decoder = getattr(model, "get_decoder", None)
    head = getattr(model, "get_output_embeddings", None)
    if decoder is None or head is None:
        return False
    cfg = getattr(model, "config", None)
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
        return False
    try:
        return decoder() is not None and isinstance(head(), torch.nn.Linear)
    except (AttributeError, NotImplementedError):
        return False


def enable_token_logprobs(model: torch.nn.Module) -> bool:
    """Give `model` (a transformers causal LM) the log-prob forward; idempotent. Returns whether
    the chunked path is used (`fused_supported`)."""
    if getattr(model, "_rlgraph_logprobs", False):
        return bool(model._rlgraph_fused)
    fused = fused_supported(model)
    original = type(model).forward

    def forward(self, *args: Any, logprob_index: Tensor | None = None, logprob_labels: Tensor | None = None,
                logprob_temperature: float = 1.0, logprob_chunk: int = DEFAULT_CHUNK, logprob_entropy: bool = False,
                logprob_top_k: int = 0, logprob_at: Tensor | None = None, **kwargs: Any) -> Any:
        if logprob_index is None:
            return original(self, *args, **kwargs)
        input_ids, attention_mask, position_ids = kwargs["input_ids"], kwargs.get("attention_mask"), \
            kwargs["position_ids"]
        side = (logprob_top_k, logprob_at)
        if self._rlgraph_fused:
            out = self.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                     use_cache=False)
            hidden = out.last_hidden_state
            selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, logprob_index)
            head = self.get_output_embeddings()
            return _chunked(selected, head.weight, head.bias, logprob_labels, logprob_temperature, logprob_chunk,
                            logprob_entropy, *side)
        logits = original(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).logits
        selected = logits.reshape(-1, logits.shape[-1]).index_select(0, logprob_index)
        return _from_logits(selected, logprob_labels, logprob_temperature, logprob_entropy, *side)

    model.forward = types.MethodType(forward, model)
    model._rlgraph_fused = fused
    model._rlgraph_logprobs = True  # a copy (deepcopy) keeps the forward, bound to the copy
    return fused


def response_logprobs(model: Any, layout: Layout, temperature: float = 1.0, chunk: int = DEFAULT_CHUNK,
                      with_entropy: bool = False, device: torch.device | None = None) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropy) of the layout's response tokens at `temperature`, ``[b, R]`` each
    (mask them with the response mask: a packed layout leaves 0 past each response, a padded one
    the padding slots' values). `model` is the model or its DDP/FSDP wrapper; the model must
    have had `enable_token_logprobs`. `device`: where the inputs go (default: the parameters')."""
    s = response_scores(model, layout, temperature, chunk, with_entropy, device)
    return s.logp, s.entropy


def response_scores(model: Any, layout: Layout, temperature: float = 1.0, chunk: int = DEFAULT_CHUNK,
                    with_entropy: bool = False, device: torch.device | None = None, top_k: int = 0,
                    at_ids: Tensor | None = None) -> Scores:
    """`response_logprobs`, and a side result per response token from the same logits block:
    with `top_k`, the log-probs and ids of its `top_k` most likely tokens (k = min(top_k, vocabulary));
    with `at_ids` (``[b, R, k]`` token ids), the log-probs of those tokens (differentiable). Both
    ``[b, R, k]``, normalised over the whole vocabulary at `temperature`."""
    device = device or _device_of(model)
    at = None if at_ids is None else at_ids.to(device)[layout.rows.to(device), layout.cols.to(device)]
    logp, ent, side_lp, side_ids = model(
        input_ids=layout.input_ids.to(device),
        attention_mask=None if layout.attention_mask is None else layout.attention_mask.to(device),
        position_ids=layout.position_ids.to(device), logprob_index=layout.index.to(device),
        logprob_labels=layout.labels.to(device), logprob_temperature=temperature or 1.0,
        logprob_chunk=chunk if chunk > 0 else max(int(layout.index.numel()), 1), logprob_entropy=with_entropy,
        logprob_top_k=top_k, logprob_at=at)
    wanted = bool(top_k) or at is not None
    return Scores(_scatter(logp, layout), _scatter(ent, layout) if with_entropy else None,
                  _scatter(side_lp, layout) if wanted else None, _scatter(side_ids, layout) if top_k else None)


def _device_of(model: Any) -> torch.device:
    try:
        p = next(model.parameters())
    except StopIteration:
        return torch.device("cpu")
    return p.device


def _scatter(values: Tensor, layout: Layout) -> Tensor:
    """``[N, *rest]`` values of the layout's response tokens -> ``[b, R, *rest]``."""
    out = values.new_zeros((*layout.shape, *values.shape[1:]))
    return out.index_put((layout.rows.to(values.device), layout.cols.to(values.device)), values)


def _token_stats(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, temperature: float,
                 with_entropy: bool, top_k: int = 0, at: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    logits = F.linear(hidden, weight, bias).float()
    if not torch.is_grad_enabled():  # in place: two [chunk, vocab] blocks at most, not four
        return _stats_in_place(logits.div_(temperature), labels, with_entropy, top_k, at)
    return _stats(logits / temperature, labels, with_entropy, top_k, at)


def _side(logits: Tensor, log_total: Tensor, top_k: int, at: Tensor | None) -> tuple[Tensor, Tensor]:
    """[n, k] log-probs of the top-k tokens and their ids, or of the ids `at`; [n, 0] when neither is asked for.
    `logits` may be shifted by a per-row constant that `log_total` includes."""
    n = logits.shape[0]
    if at is not None:
        return logits.gather(-1, at) - log_total.unsqueeze(-1), at
    if top_k:
        vals, ids = logits.topk(min(top_k, logits.shape[-1]), dim=-1)
        return vals - log_total.unsqueeze(-1), ids
    return logits.new_zeros((n, 0)), torch.zeros((n, 0), dtype=torch.long, device=logits.device)


def _stats(logits: Tensor, labels: Tensor, with_entropy: bool, top_k: int = 0,
           at: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    side_lp, side_ids = _side(logits, lse, top_k, at)
    if with_entropy:
        ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
    else:
        ent = logp.new_zeros(())
    return logp, ent, side_lp, side_ids


def _stats_in_place(logits: Tensor, labels: Tensor, with_entropy: bool, top_k: int = 0,
                    at: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`_stats` without autograd, overwriting `logits`: with z shifted by its row max and S = sum exp z,
    log p(label) = z_label - log S and the entropy is log S - sum(exp z * z) / S."""
    z = logits.sub_(logits.max(dim=-1, keepdim=True).values)
    e = z.exp()
    total = e.sum(dim=-1)
    log_total = total.log()
    logp = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - log_total
    side_lp, side_ids = _side(z, log_total, top_k, at)
    ent = log_total - e.mul_(z).sum(dim=-1) / total if with_entropy else logp.new_zeros(())
    return logp, ent, side_lp, side_ids


def _chunked(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, temperature: float, chunk: int,
             with_entropy: bool, top_k: int = 0, at: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    logps, ents, side_lps, side_ids = [], [], [], []
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    ats = at.split(chunk) if at is not None else [None] * len(labels.split(chunk))
    for h, lab, a in zip(hidden.split(chunk), labels.split(chunk), ats):
        if grad:  # keep the chunk's input, recompute its logits in backward
            lp, en, slp, sid = checkpoint(_token_stats, h, weight, bias, lab, temperature, with_entropy, top_k, a,
                                          use_reentrant=False)
        else:
            lp, en, slp, sid = _token_stats(h, weight, bias, lab, temperature, with_entropy, top_k, a)
        logps.append(lp)
        ents.append(en)
        side_lps.append(slp)
        side_ids.append(sid)
    if not logps:
        empty = hidden.new_zeros((0,), dtype=torch.float32)
        return empty, empty, empty.new_zeros((0, 0)), torch.zeros((0, 0), dtype=torch.long, device=hidden.device)
    logp = torch.cat(logps)
    ent = torch.cat(ents) if with_entropy else logp.new_zeros(logp.shape)
    return logp, ent, torch.cat(side_lps), torch.cat(side_ids)


def _from_logits(logits: Tensor, labels: Tensor, temperature: float, with_entropy: bool, top_k: int = 0,
                 at: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    scaled = logits.float() / temperature
    logp, ent, side_lp, side_ids = (_stats(scaled, labels, with_entropy, top_k, at) if torch.is_grad_enabled()
                                    else _stats_in_place(scaled, labels, with_entropy, top_k, at))
    return logp, (ent if with_entropy else logp.new_zeros(logp.shape)), side_lp, side_ids
