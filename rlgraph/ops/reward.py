"""The rule-based reward op: decode responses, score them, put the score on the last token.

The scoring function has verl's signature, ``compute_score(data_source, solution_str,
ground_truth, extra_info=None) -> float | dict`` (a dict carries ``"score"`` and extras), and is
named by ``reward.fn`` as ``module:function``, so existing verl reward code drops in.
Padding rows score 0 and are never passed to the function.
"""

from __future__ import annotations

from typing import Any

import torch

from rlgraph.ops.models import load_tokenizer
from rlgraph.ops.rewards import load_reward_fn, score_batch
from rlgraph.ops.training import section

__all__ = ["RewardWorker"]


class RewardWorker:
    def setup(self, ctx: Any) -> None:
        path = (section(ctx, "reward").get("tokenizer") or section(ctx, "data").get("tokenizer")
                or section(ctx, "actor").get("model_path"))
        if not path:
            raise ValueError("the reward op needs a tokenizer to decode responses: set reward.tokenizer, "
                             "data.tokenizer or actor.model_path")
        self.tokenizer = load_tokenizer(path)
        self.fns: dict[str, Any] = {}

    def compute_reward(self, prompts: Any = None, responses: torch.Tensor | None = None,
                       response_mask: torch.Tensor | None = None, data_source: list | None = None,
                       ground_truth: list | None = None, extra_info: list | None = None, *,
                       fn: str = "rlgraph.ops.rewards:compute_score", ctx: Any = None, **_: Any) -> dict[str, Any]:
        if fn not in self.fns:
            self.fns[fn] = load_reward_fn(fn)
        lengths = ctx.lengths["response_len"]
        rows = len(lengths)
        real = [i for i in range(rows) if not ctx.is_padding[i]]
        texts = [self.tokenizer.decode(responses[i, :lengths[i]].tolist(), skip_special_tokens=True) for i in real]
        scores, extras = score_batch(self.fns[fn], [data_source[i] for i in real], texts,
                                     [ground_truth[i] for i in real], [extra_info[i] for i in real])
        token_level_scores = torch.zeros((rows, max(lengths)), dtype=torch.float32)
        reward_extra: list[dict] = [{} for _ in range(rows)]
        for j, i in enumerate(real):
            token_level_scores[i, lengths[i] - 1] = float(scores[j])  # on the last response token
            reward_extra[i] = extras[j]
        return {"token_level_scores": token_level_scores, "reward_extra": reward_extra}
