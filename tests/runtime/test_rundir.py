"""rlgraph.runtime.rundir: an earlier run is never overwritten, a bad directory fails before start-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from rlgraph.runtime.rundir import RUN_OUTPUTS, RunDirError, check_run_dir, run_dir_state, write_atomic

ROOT = Path(__file__).resolve().parents[2]
RLGRAPH = str(Path(sys.executable).with_name("rlgraph"))
PIPELINE = str(ROOT / "tests" / "resources" / "tensor_pipeline.py")


def _earlier_run(d: Path, steps: int = 2, checkpoints: tuple[int, ...] = ()) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i}) + "\n" for i in range(steps)))
    for k in checkpoints:
        c = d / "checkpoints" / f"step_{k}"
        c.mkdir(parents=True)
        (c / "meta.json").write_text("{}")


def test_a_new_directory_is_created_and_checked(tmp_path):
    state = check_run_dir(tmp_path / "a" / "b")
    assert not state.earlier_run and (tmp_path / "a" / "b").is_dir()
    assert list((tmp_path / "a" / "b").iterdir()) == []  # the write probe is gone


def test_an_earlier_run_is_refused_naming_resume_and_overwrite(tmp_path):
    _earlier_run(tmp_path, steps=2, checkpoints=(1,))
    with pytest.raises(RunDirError) as e:
        check_run_dir(tmp_path)
    assert str(e.value) == (
        f"{str(tmp_path)!r} holds an earlier run (metrics.jsonl with 2 step(s) and checkpoint(s) of step 1); a new "
        f"run there would overwrite it. Continue it with --resume, replace it with --overwrite, or give another "
        f"output directory (-o DIR)")
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2  # untouched


def test_a_compiled_plan_alone_is_not_an_earlier_run(tmp_path):
    (tmp_path / "plan.json").write_text("{}")
    (tmp_path / "pipeline.svg").write_text("<svg/>")
    (tmp_path / "metrics.jsonl").write_text("")  # an empty file: no step was written
    assert not check_run_dir(tmp_path).earlier_run


def test_resume_without_a_checkpoint_names_save_every(tmp_path):
    _earlier_run(tmp_path, steps=3)
    with pytest.raises(RunDirError, match=r"^--resume: .* has no checkpoint to resume from \(it holds metrics\.jsonl "
                                          r"with 3 step\(s\)\); a run writes checkpoints only with "
                                          r"trainer\.save_every=K"):
        check_run_dir(tmp_path, resume=True)
    with pytest.raises(RunDirError, match="trainer.save_every=K"):
        check_run_dir(tmp_path / "never_ran", resume=True)
    _earlier_run(tmp_path / "saved", checkpoints=(0,))
    assert check_run_dir(tmp_path / "saved", resume=True).checkpoints == (0,)


def test_overwrite_deletes_the_run_outputs_and_nothing_else(tmp_path):
    _earlier_run(tmp_path, checkpoints=(0, 1))
    for name in ("trace.json", "timeline.svg", "reward_curve.svg", "placement.json", "plan.json", "notes.txt"):
        (tmp_path / name).write_text("x")
    (tmp_path / "tensorboard").mkdir()
    state = check_run_dir(tmp_path, overwrite=True)
    assert not state.earlier_run and not run_dir_state(tmp_path).earlier_run
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["notes.txt", "plan.json"]
    assert not set(left) & set(RUN_OUTPUTS)
    with pytest.raises(RunDirError, match="contradict"):
        check_run_dir(tmp_path, resume=True, overwrite=True)


def test_a_path_through_a_file_is_one_typed_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunDirError, match=r"^cannot write the run directory '.*file/run': .*give a writable "
                                          r"directory with -o DIR"):
        check_run_dir(tmp_path / "file" / "run")


def test_too_little_free_space_is_refused(tmp_path):
    with pytest.raises(RunDirError, match=r"^the run directory .* MiB free; a run needs at least"):
        check_run_dir(tmp_path, min_free_bytes=1 << 60)


def test_a_directory_another_user_cannot_write(tmp_path, request):
    """Checked in a child that became `nobody` (root ignores file modes): permission denied is one
    typed message."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to another user")
    import pwd

    import shutil
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="rlgraph-test-"))  # under /tmp, which every user may enter
    request.addfinalizer(lambda: shutil.rmtree(top, ignore_errors=True))
    os.chmod(top, 0o755)
    d = top / "locked"
    d.mkdir()
    os.chmod(d, 0o555)
    hidden = tmp_path / "run"  # pytest's own folder is root's (0700): not even readable
    nobody = pwd.getpwnam("nobody")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: file operations only, then _exit
        code = 3
        try:
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            for where in (d, hidden):
                try:
                    check_run_dir(where)
                except RunDirError as e:
                    os.write(w, (str(e) + "\n").encode())
            code = 2
        except BaseException as e:  # shown by the assertion below
            os.write(w, repr(e).encode())
        finally:
            os._exit(code)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    message = os.read(r, 4096).decode()
    os.close(r)
    assert os.waitstatus_to_exitcode(status) == 2, message
    assert message.splitlines() == [
        f"cannot write the run directory {str(d)!r}: permission denied for this user; give a writable directory "
        f"with -o DIR",
        f"cannot read the run directory {str(hidden)!r}: permission denied for this user; give a directory this "
        f"user can read and write with -o DIR"]


@pytest.fixture
def small_mount(tmp_path):
    """A 1 MiB tmpfs (root and mount rights needed; skipped elsewhere)."""
    mnt = tmp_path / f"mnt_{uuid.uuid4().hex[:6]}"
    mnt.mkdir()

    def mount(*opts: str) -> Path:
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(("size=1m", *opts)), "tmpfs", str(mnt)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
        return mnt

    yield mount
    subprocess.run(["umount", str(mnt)], capture_output=True)


def test_a_read_only_file_system_is_one_typed_error(small_mount):
    mnt = small_mount("ro")
    with pytest.raises(RunDirError, match=r"^cannot write the run directory '.*': it is on a read-only file system"):
        check_run_dir(mnt)


def test_a_full_file_system_is_one_typed_error(small_mount):
    mnt = small_mount()
    with (mnt / "filler").open("wb") as f:
        try:
            f.write(b"\0" * (2 << 20))
        except OSError:
            pass
    with pytest.raises(RunDirError, match=r"^cannot write the run directory '.*': its file system is full"):
        check_run_dir(mnt, min_free_bytes=0)


def test_write_atomic_replaces_whole(tmp_path):
    p = tmp_path / "f.json"
    write_atomic(p, "old")
    write_atomic(p, b"new")
    assert p.read_text() == "new" and sorted(x.name for x in tmp_path.iterdir()) == ["f.json"]


def test_cli_refuses_before_anything_starts(tmp_path):
    """`rlgraph run` into a directory holding an earlier run: exit 2, nothing written, no Ray started."""
    _earlier_run(tmp_path, steps=2)
    res = subprocess.run([RLGRAPH, "run", PIPELINE, "-o", str(tmp_path), "--steps", "1"], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith(f"Error: {str(tmp_path)!r} holds an earlier run")
    assert "--resume" in res.stderr and "--overwrite" in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no plan.json, nothing else
    res = subprocess.run([RLGRAPH, "run", PIPELINE, "-o", str(tmp_path), "--resume"], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 2 and "trainer.save_every=K" in res.stderr, res.stderr
