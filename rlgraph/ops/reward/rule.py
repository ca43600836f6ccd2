"""The rule-based reward op: decode responses, score them concurrently, put the score on the last token.

The scoring function has verl's signature, ``compute_score(data_source, solution_str,
ground_truth, extra_info=None) -> float | dict`` (a dict carries ``"score"`` and extras), and is
named by ``reward.fn`` as ``module:function``, so existing verl reward code drops in. Samples
of a call are scored concurrently (`rlgraph.ops.reward.scorer`: threads, a process pool, or an event
loop for ``async def`` functions), each under ``timeout_s``. Padding rows score 0 and are never
passed to the function.

A sample whose function raises or runs out of time carries the error in its extras
(``reward_error``) and is then handled by ``on_error``: ``fail`` fails the step naming the
samples, ``zero`` scores it 0, ``drop_group`` scores it 0 and drops its whole group from
training (counted under ``samples/dropped/reward_error`` or ``.../reward_timeout``).

The op's outputs are, in declaration order: the score column (token level), the extras column,
the metrics column, so the same body serves the single reward (``token_level_scores``) and a
named source of a mixed reward (e.g. ``rule_scores``).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from itertools import accumulate
from typing import Any, Sequence

import torch

from rlgraph.ops.models import decode_rows, tokenizer_at
from rlgraph.ops.names import ON_ERROR
from rlgraph.ops.reward.functions import RewardFnError
from rlgraph.ops.reward.scorer import RewardScorer
from rlgraph.ops.settings import ActorSettings, DataSettings, RewardSettings, RolloutSettings
from rlgraph.rows import Rows, reads_flat, trimmed_rows

__all__ = ["RewardWorker", "combine_rewards", "env_reward", "overlong_penalty", "overlong_penalties"]



class RewardWorker:
    def setup(self, ctx: Any) -> None:
        self.default_tokenizer = DataSettings.value(ctx, "tokenizer") or ActorSettings.value(ctx, "model_path")
        self.tokenizers: dict[str, Any] = {}
        self.scorers: dict[tuple, RewardScorer] = {}
        # loaded now, beside the models' loading, not in the first step (transformers' import is seconds):
        # the tokenizer of ``reward.tokenizer`` or the default. A reward op of another name may name its
        # own; its call loads that, and reports a tokenizer that cannot be loaded, as before
        try:
            self._tokenizer(RewardSettings.value(ctx, "tokenizer"))
        except Exception:  # noqa: BLE001 - the op's own call raises it, naming the op, if it needs this one
            pass

    def _tokenizer(self, path: str) -> Any:
        """`path`'s tokenizer, else data.tokenizer's, else actor.model_path's: the one the prompts were
        encoded with (``char``: the built-in character tokenizer)."""
        path = path or self.default_tokenizer or ""
        if not path:
            raise RewardFnError("the reward has no tokenizer to decode responses with: reward.tokenizer, "
                                "data.tokenizer and actor.model_path are all empty; set data.tokenizer to the "
                                "policy's HF directory (or data.tokenizer=char for the built-in character tokenizer)")
        if path not in self.tokenizers:
            self.tokenizers[path] = tokenizer_at(path)
        return self.tokenizers[path]

    @reads_flat  # `responses` through its flat tensor and lengths; `response_mask` not at all
    def compute_reward(self, responses: Rows, response_mask: Rows, data_source: list, ground_truth: list,
                       extra_info: list, *, fn: str, executor: str, concurrency: int, timeout_s: float, on_error: str,
                       tokenizer: str, ctx: Any) -> dict[str, Any]:
        """`responses` come as their rows (the op takes them ``as_rows``; a padded tensor, as a stage of
        one's own may give it, is taken back to rows by `ctx.lengths`): each is decoded as it is, and the
        score column is written into rows of the same lengths, with no padding either way. `response_mask`
        is read only so that the advantage can run inside this op's call (see `rlgraph.ops.stages.reward`)."""
        if on_error not in ON_ERROR:
            raise RewardFnError(f"{ctx.op}.on_error={on_error!r}; use one of {', '.join(ON_ERROR)}")
        key = (fn, executor, int(concurrency), float(timeout_s))
        if key not in self.scorers:
            self.scorers[key] = RewardScorer(fn, executor=executor, concurrency=concurrency, timeout_s=timeout_s)
        scorer = self.scorers[key]
        if type(responses) is not Rows or responses.flat is None:
            responses = trimmed_rows(responses, ctx.lengths.get("response_len", ()))
        lengths = responses.lengths
        rows = len(lengths)
        ends = list(accumulate(lengths))  # each row's end in the joined tokens
        tok = self._tokenizer(tokenizer)
        ids = responses.flat.tolist()  # one conversion for the call, then each row's slice of it
        if any(ctx.is_padding):
            real = [i for i, pad in enumerate(ctx.is_padding) if not pad]
            texts = decode_rows(tok, [ids[ends[i] - lengths[i]:ends[i]] for i in real])
            res = scorer.scores([data_source[i] for i in real], texts, [ground_truth[i] for i in real],
                                [extra_info[i] for i in real])
        else:  # every row real (the common case): the columns as they are
            real = range(rows)
            texts = decode_rows(tok, [ids[end - n:end] for n, end in zip(lengths, ends)])
            res = scorer.scores(data_source, texts, ground_truth, extra_info)
        failed = [(real[k], o) for k, o in sorted(res.failed.items())]
        if failed and on_error == "fail":
            shown = "; ".join(f"row {i} (data_source={data_source[i]!r}): {o.error}" for i, o in failed[:3])
            raise RewardFnError(
                f"reward function {fn!r} failed on {len(failed)} of {len(real)} samples: {shown}"
                f"{' ...' if len(failed) > 3 else ''}. Fix the function, or set {ctx.op}.on_error=zero (score "
                f"them 0) or {ctx.op}.on_error=drop_group (leave their groups out of training)")
        score_col, extra_col, metrics_col = ctx.outputs[0], ctx.outputs[1], ctx.outputs[2]
        # filled where an op or the pipeline reads it; else one empty record a row, which nothing reads
        reward_extra: list[dict] = [{}] * rows
        if extra_col in ctx.wanted:
            reward_extra = [{} for _ in range(rows)]
            for k, extra in res.extras.items():
                reward_extra[real[k]] = dict(extra)
            for i, o in failed:
                reward_extra[i] = {**o.extra, "reward_error": o.error}
        if on_error == "drop_group":
            for i, o in failed:
                ctx.drop(i, "reward_timeout" if o.timed_out else "reward_error", group=True)
        # each score on its row's last token: a failed sample's score is 0, as the rest of its row; an
        # empty row has no token to hold one. Written by Python into a float32 array, which the tensor then
        # shares: one loop for padding, failed and empty rows alike, as fast in the actor as numpy's indexed
        # write was (128 rows, after a model's pass), and 13 against 16 us with warm caches. Each row's sum
        # is its one score as stored (float32), given with the rows (`Rows.sums`): the worker's summary
        # of the column then sums nothing (0.067 ms a call of 128 rows in the actor)
        scores = array("f", bytes(4 * ends[-1])) if ends else array("f")
        sums = [0.0] * rows
        for i, value in zip(real, res.values):
            if lengths[i]:
                scores[ends[i] - 1] = value
                sums[i] = scores[ends[i] - 1]
        restarted = scorer.restarted
        scorer.restarted = 0
        flat = torch.frombuffer(scores, dtype=torch.float32) if scores else torch.zeros(0)
        return {score_col: Rows(flat, lengths, sums), extra_col: reward_extra,
                metrics_col: _chunk_metrics(ctx.chunks or (rows,), real, failed, restarted)}

    def close(self) -> None:
        for scorer in self.scorers.values():
            scorer.close()


def _chunk_metrics(chunks: tuple[int, ...], real: Sequence[int], failed: list[tuple[int, Any]],
                   restarted: int) -> dict[str, Any] | list[dict[str, Any]]:
    """The call's metrics: one record, or one per chunk when the call holds several (the op is
    vectorised: the step's metrics then average what a call per chunk would have given). Rows are
    the call's, in chunk order; restarts are the call's, on its first chunk."""
    records, start = [], 0
    for size in chunks:  # `real` and `failed` are in row order
        end = start + size
        errors = [o for i, o in failed if start <= i < end] if failed else []
        records.append({"scored_count": bisect_left(real, end) - bisect_left(real, start),
                        "process_restarts": restarted if not records else 0,
                        "error_count": sum(1 for o in errors if not o.timed_out),
                        "timeout_count": sum(1 for o in errors if o.timed_out)})
        start = end
    return records[0] if len(records) == 1 else records


def overlong_penalties(lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment per response length (verl's DAPO reward manager):
    ``min(-(L - (max_len - buffer_len)) / buffer_len * factor, 0)``: 0 up to ``max_len -
    buffer_len`` tokens, then falling linearly to ``-factor`` at ``max_len``."""
    if not 1 <= buffer_len <= max_len:
        raise ValueError(f"overlong buffer_len={buffer_len} must be between 1 and the maximum response length "
                         f"{max_len}; lower buffer_len or raise rollout.max_new_tokens")
    expected = max_len - buffer_len
    exceed = lengths.float() - expected
    return torch.clamp(-exceed / buffer_len * factor, max=0.0)


def overlong_penalty(response_mask: torch.Tensor, *, score_column: str, buffer_len: int, penalty_factor: float,
                     max_response_length: int, ctx: Any, **inputs: Any) -> dict[str, Any]:
    """Body of `stages.overlong_penalty`: ``token_level_scores = <score_column> + penalty`` on each
    response's last token."""
    rollout = RolloutSettings.find(ctx)  # None: no generate op, so no response length limit to take
    max_len = int(max_response_length) or (rollout.max_new_tokens if rollout is not None else 0)
    if max_len <= 0:
        raise ValueError(f"{ctx.op}: no maximum response length: set {ctx.op}.max_response_length or "
                         f"rollout.max_new_tokens")
    scores = inputs[score_column].float()
    mask = response_mask[:, :scores.shape[1]].to(scores.dtype)
    lengths = mask.sum(dim=1)
    penalty = overlong_penalties(lengths, max_len, int(buffer_len), float(penalty_factor))
    real = torch.tensor([not p for p in ctx.is_padding], dtype=torch.bool) & (lengths > 0)
    out = scores.clone()
    last = (lengths.long() - 1).clamp(min=0)
    rows = torch.arange(len(out))[real]
    out[rows, last[real]] += penalty[real]
    n = int(real.sum())
    metrics = {"penalised_frac": float((penalty[real] < 0).float().mean()) if n else 0.0,
               "penalty_mean": float(penalty[real].mean()) if n else 0.0}
    return {ctx.outputs[0]: out, ctx.outputs[1]: metrics}


def filter_groups(uid: torch.Tensor, *, score_column: str, metric_column: str, min_std: float, ctx: Any,
                  **inputs: Any) -> dict[str, Any]:
    """Body of `stages.filter_groups`: drop each group whose metric (per-sample sum of
    ``metric_column``) has a population std of at most `min_std`, as verl's filter keeps a prompt
    when ``np.std(metric_vals) > 0`` or it has a single sample."""
    metric = inputs[metric_column].double().sum(dim=1)  # [b]; float64: equal scores give a std of exactly 0
    real = [i for i, pad in enumerate(ctx.is_padding) if not pad]
    members: dict[int, list[int]] = {}
    for i in real:
        members.setdefault(int(uid[i]), []).append(i)
    dropped = 0
    for rows in members.values():
        vals = metric[rows]
        alike = bool(vals.max() == vals.min()) if min_std == 0 else float(vals.std(unbiased=False)) <= min_std
        if len(rows) > 1 and alike:
            ctx.drop(rows[0], "zero_variance", group=True)
            dropped += 1
    metrics = {"groups_count": len(members), "kept_groups_count": len(members) - dropped,
               "dropped_groups_count": dropped}
    return {ctx.outputs[0]: inputs[score_column].clone(), ctx.outputs[1]: metrics}


def combine_rewards(response_mask: torch.Tensor, *, ctx: Any, **inputs: Any) -> dict[str, Any]:
    """Body of `stages.combine_rewards`: ``sum_k w_k * scores_k`` over the score columns, token by token
    (each source carries its score on the last response token). Params are ``w_<column>``."""
    weights = {k[2:]: float(v) for k, v in inputs.items() if k.startswith("w_")}
    missing = [c for c in weights if c not in inputs]
    if missing:
        raise RewardFnError(f"{ctx.op}: weights given for {missing}, but the op did not receive those columns")
    rows = len(ctx.is_padding)
    width = max(ctx.lengths.get("response_len", (0,)), default=0)
    total = torch.zeros((rows, width), dtype=torch.float32)
    real = torch.tensor([not p for p in ctx.is_padding], dtype=torch.bool)
    metrics: dict[str, Any] = {}
    for col, w in weights.items():
        scores = inputs[col].float()[:, :width]
        if scores.shape[1] < width:
            scores = torch.nn.functional.pad(scores, (0, width - scores.shape[1]))
        total += w * scores
        per_row = scores.sum(dim=1)[real]
        if per_row.numel():
            metrics[col] = {"mean": float(per_row.mean()), "weight": w}
    score_col, metrics_col = ctx.outputs[0], ctx.outputs[1]
    return {score_col: total, metrics_col: metrics}


def env_reward(env_rewards: torch.Tensor, response_mask: torch.Tensor, *, ctx: Any) -> dict[str, Any]:
    """``token_level_scores``: each row's environment reward on its response's last token."""
    scores = torch.zeros(response_mask.shape, dtype=torch.float32)
    lengths = torch.tensor(ctx.lengths["response_len"], dtype=torch.long)
    if scores.numel():
        scores[torch.arange(len(scores)), (lengths - 1).clamp(min=0)] = env_rewards.float().reshape(-1)
    return {"token_level_scores": scores}
