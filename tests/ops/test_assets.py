"""`build_once`: a prepare hook's asset (a model directory) made once, atomically, under a lock."""

import pytest

from rlgraph.ops.assets import build_once


def _model(tmp, calls):
    calls.append(tmp)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text("{}")


def test_build_once_builds_into_a_partial_directory_then_never_again(tmp_path):
    calls = []
    out = build_once(tmp_path / "m", lambda tmp: _model(tmp, calls))
    assert out == tmp_path / "m" and (out / "config.json").is_file()
    assert calls == [tmp_path / "m.partial"] and not (tmp_path / "m.partial").exists()
    assert build_once(tmp_path / "m", lambda tmp: _model(tmp, calls)) == out and len(calls) == 1


def test_a_failed_build_leaves_no_model_and_the_next_call_builds_again(tmp_path):
    def broken(tmp):
        tmp.mkdir(parents=True)
        (tmp / "half").write_text("x")
        raise RuntimeError("out of disk")

    with pytest.raises(RuntimeError, match="out of disk"):
        build_once(tmp_path / "m", broken)
    assert not (tmp_path / "m").exists()
    calls = []
    out = build_once(tmp_path / "m", lambda tmp: _model(tmp, calls))
    assert calls and (out / "config.json").is_file() and not (out / "half").exists()
