"""The examples' tiny policy: evaluation (building and the warm start run in tests/ops/test_models.py)."""

from __future__ import annotations

import pytest
import torch

from rlgraph.ops import models
from rlgraph.ops.data import tasks
from rlgraph.ops.tiny import evaluate


def test_evaluate_scores_generations():
    class Echo:  # a "model" that always answers "7<eos>"
        def generate(self, input_ids, **kw):
            answer = torch.tensor([[tok.convert_tokens_to_ids("7"), tok.eos_token_id]])
            return torch.cat([input_ids, answer.expand(len(input_ids), 2)], 1)

    tok = models.char_tokenizer()
    rows = [r for r in tasks.make_rows("add", 200, seed=0) if r["reward_model"]["ground_truth"] == "7"][:3]
    rows += tasks.make_rows("add", 1, seed=5)
    right = 3 + (rows[3]["reward_model"]["ground_truth"] == "7")
    assert evaluate(Echo(), tok, rows) == pytest.approx(right / 4)


# ----------------------------------------------------------------------------------- the source
