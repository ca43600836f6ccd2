"""Checkpoints: safetensors + JSON, no pickles, exact round trips."""

import json
import math

import pytest
import torch

from rlgraph.runtime.checkpoint import (CHECKPOINT_FORMAT, CheckpointError, latest_checkpoint, load_state,
                                        save_state)


def test_round_trip_of_model_and_optimizer_state(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3, "nan": float("nan"),
             "names": ["a", None, True]}
    save_state(state, tmp_path, "w")
    back = load_state(tmp_path, "w")
    assert torch.equal(back["model"]["weight"], model.state_dict()["weight"])
    # optimizer state is keyed by int parameter ids: they come back as ints
    assert set(back["optim"]["state"]) == {0, 1}
    assert torch.equal(back["optim"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    opt2 = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=0.1)
    opt2.load_state_dict(back["optim"])  # accepted by torch as is
    assert back["step"] == 3 and math.isnan(back["nan"]) and back["names"] == ["a", None, True]
    # the skeleton is plain JSON: nothing to unpickle
    json.loads((tmp_path / "w.json").read_text())


def test_objects_that_are_not_state_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"cannot checkpoint object at 'x.y'"):
        save_state({"x": {"y": object()}}, tmp_path, "bad")
    with pytest.raises(CheckpointError, match=r"mixes key types"):
        save_state({1: 1, "a": 2}, tmp_path, "bad")
    with pytest.raises(CheckpointError, match=r"has no state 'missing'"):
        load_state(tmp_path, "missing")


def test_latest_checkpoint_ignores_incomplete_ones(tmp_path):
    root = tmp_path / "checkpoints"
    for k, complete in ((1, True), (3, True), (5, False)):
        (root / f"step_{k}").mkdir(parents=True)
        if complete:
            (root / f"step_{k}" / "meta.json").write_text(json.dumps({"format": CHECKPOINT_FORMAT, "step": k}))
    assert latest_checkpoint(tmp_path).name == "step_3"
    assert latest_checkpoint(tmp_path / "nothing") is None
