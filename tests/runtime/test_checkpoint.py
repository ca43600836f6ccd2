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


class _Plan:
    pipeline = "p"
    config = {"trainer": {"steps": 4}}


def _write(tmp_path, step, keep=0):
    from rlgraph.runtime.checkpoint import write_checkpoint

    return write_checkpoint(tmp_path, step, {"actor_0": {"w": torch.full((4,), float(step)), "step": step},
                                             "source": {"position": step}}, _Plan(), keep=keep)


def test_every_file_sha256_is_in_meta_and_verified(tmp_path):
    from rlgraph.runtime.checkpoint import file_sha256, resume_checkpoint, verify_checkpoint

    ckpt = _write(tmp_path, 1)
    meta = json.loads((ckpt / "meta.json").read_text())
    assert sorted(meta["files"]) == ["actor_0.json", "actor_0.safetensors", "source.json"]
    assert all(meta["files"][n] == file_sha256(ckpt / n) for n in meta["files"])
    verify_checkpoint(ckpt)
    assert resume_checkpoint(tmp_path) == ckpt
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


def _flip_a_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_bit_names_the_file_and_the_last_good_checkpoint(tmp_path):
    from rlgraph.runtime.checkpoint import CheckpointDamaged, resume_checkpoint

    _write(tmp_path, 1)
    _write(tmp_path, 3)
    bad = tmp_path / "checkpoints" / "step_3"
    _flip_a_bit(bad / "actor_0.safetensors")
    with pytest.raises(CheckpointDamaged) as e:
        resume_checkpoint(tmp_path)
    good = tmp_path / "checkpoints" / "step_1"
    assert str(e.value).startswith(f"checkpoint {str(bad)!r} is damaged: actor_0.safetensors has sha256 ")
    assert f"the newest good checkpoint is {str(good)!r}: resume from it with --resume --fallback" in str(e.value)
    assert e.value.file == "actor_0.safetensors" and e.value.good == good
    assert bad.is_dir()  # nothing moved without --fallback
    # --fallback: the damaged one moves aside (kept, never deleted), the good one is resumed
    with pytest.warns(RuntimeWarning, match="--fallback: resuming from"):
        assert resume_checkpoint(tmp_path, fallback=True) == good
    assert (tmp_path / "checkpoints" / "step_3.damaged" / "actor_0.safetensors").is_file()
    assert not bad.exists()


def test_a_missing_file_with_no_good_checkpoint_behind_it(tmp_path):
    from rlgraph.runtime.checkpoint import CheckpointDamaged, resume_checkpoint

    ckpt = _write(tmp_path, 2)
    (ckpt / "source.json").unlink()
    with pytest.raises(CheckpointDamaged, match=r"is damaged: source\.json is missing; no earlier checkpoint checks "
                                                r"out either"):
        resume_checkpoint(tmp_path, fallback=True)
    assert ckpt.is_dir()


def test_only_the_newest_keep_checkpoints_stay(tmp_path):
    from rlgraph.runtime.checkpoint import checkpoint_steps

    for k in range(5):
        _write(tmp_path, k, keep=2)
    assert checkpoint_steps(tmp_path) == [3, 4]
    for k in range(5, 7):
        _write(tmp_path, k)  # keep=0: all kept
    assert checkpoint_steps(tmp_path) == [3, 4, 5, 6]
