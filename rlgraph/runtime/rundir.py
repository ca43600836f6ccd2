"""The run directory: never destroy an earlier run's outputs, and fail before start-up when the
directory cannot take this run's.

`check_run_dir` runs before Ray starts (the CLI calls it first thing, the runner again before it
writes): a directory that holds an earlier run's metrics or checkpoints is refused unless the run
continues it (``--resume``, which needs a checkpoint: ``trainer.save_every``) or replaces it
(``--overwrite``, which deletes rlgraph's own outputs there and nothing else). A directory that
cannot be written (read-only, not ours, full) is one `RunDirError` naming it and the reason.

`write_atomic` writes a whole file so that a reader sees the old or the new content, never a
part: a temp file beside it, fsynced, renamed over it, and the directory fsynced.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from rlgraph.errors import RLGraphError

__all__ = ["RunDirError", "RunDirState", "check_run_dir", "run_dir_state", "write_atomic", "fsync", "checkpoint_steps",
           "RUN_OUTPUTS", "MIN_FREE_BYTES"]

# what `rlgraph run` writes into its directory; --overwrite deletes these and nothing else (plan.json
# and pipeline.svg, written by `rlgraph compile` into the same directory, stay)
RUN_OUTPUTS = ("metrics.jsonl", ".metrics.jsonl.tmp", "checkpoints", "trace.json", "timeline.svg", "timeline.png",
               "reward_curve.svg", "reward_curve.png", "placement.json", "logger_runs.json", "tensorboard", "mlruns",
               "wandb")
# the least free space a run starts with: metrics, traces and charts of a long run, before checkpoints
MIN_FREE_BYTES = 64 * 2**20
_PROBE = ".rlgraph-write-check"


class RunDirError(RLGraphError):
    """The run directory holds an earlier run that this run would overwrite, has no checkpoint to
    resume from, or cannot be written (read-only, no permission, full). Exit status 2."""


@dataclass(frozen=True)
class RunDirState:
    """What an earlier run left in a directory."""

    steps: int  # lines in metrics.jsonl
    checkpoints: tuple[int, ...]  # steps of complete checkpoints

    @property
    def earlier_run(self) -> bool:
        return bool(self.steps or self.checkpoints)

    def describe(self) -> str:
        parts = []
        if self.steps:
            parts.append(f"metrics.jsonl with {self.steps} step(s)")
        if self.checkpoints:
            parts.append(f"checkpoint(s) of step {', '.join(map(str, self.checkpoints[-3:]))}")
        return " and ".join(parts)


def checkpoint_steps(out_dir: Path) -> list[int]:
    """The steps of the complete ``step_<k>`` checkpoints under ``out_dir/checkpoints`` (those with a
    meta.json), sorted. Here, not in `checkpoint` (which imports torch): the CLI checks a run
    directory before anything heavy is imported."""
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in root.glob("step_*") if p.name[5:].isdigit() and (p / "meta.json").is_file())


def run_dir_state(out: Path) -> RunDirState:
    metrics = Path(out) / "metrics.jsonl"
    steps = 0
    if metrics.is_file():
        with metrics.open("rb") as f:
            steps = sum(1 for line in f if line.strip())
    return RunDirState(steps, tuple(checkpoint_steps(out)))


def _why(e: OSError) -> str:
    if e.errno == errno.EROFS:
        return "it is on a read-only file system"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "permission denied for this user"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "its file system is full (no space left, or over quota)"
    return f"{e.strerror or type(e).__name__}" + (f" ({e.filename})" if e.filename else "")


def check_run_dir(out: Path, *, resume: bool = False, overwrite: bool = False,
                  min_free_bytes: int = MIN_FREE_BYTES) -> RunDirState:
    """Check (and with `overwrite`, clear) run directory `out` before anything starts; returns what
    an earlier run left there. Raises `RunDirError` naming the directory and the fix."""
    out = Path(out)
    where = str(out)
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite contradict each other: --resume continues the run in "
                          f"{where!r}, --overwrite deletes it; give one of them")
    try:
        state = run_dir_state(out) if out.is_dir() else RunDirState(0, ())
    except OSError as e:
        raise RunDirError(f"cannot read the run directory {where!r}: {_why(e)}; give a directory this user can "
                          f"read and write with -o DIR") from None
    if resume and not state.checkpoints:
        had = f" (it holds {state.describe()})" if state.earlier_run else ""
        raise RunDirError(
            f"--resume: {where!r} has no checkpoint to resume from{had}; a run writes checkpoints only with "
            f"trainer.save_every=K (every K steps; the default 0 writes none). Start it again with "
            f"trainer.save_every=K, or run without --resume{' and with --overwrite' if state.earlier_run else ''}")
    if state.earlier_run and not resume and not overwrite:
        raise RunDirError(
            f"{where!r} holds an earlier run ({state.describe()}); a new run there would overwrite it. "
            f"Continue it with --resume, replace it with --overwrite, or give another output directory (-o DIR)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        if overwrite and state.earlier_run:
            for name in RUN_OUTPUTS:
                p = out / name
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                elif p.exists() or p.is_symlink():
                    p.unlink()
            state = RunDirState(0, ())
        probe = out / _PROBE
        with probe.open("wb") as f:  # a write, not os.access: root ignores modes, a full disk takes no bytes
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        raise RunDirError(f"cannot write the run directory {where!r}: {_why(e)}; give a writable directory "
                          f"with -o DIR") from None
    free = shutil.disk_usage(out).free
    if free < min_free_bytes:
        raise RunDirError(f"the run directory {where!r} has {free / 2**20:.1f} MiB free; a run needs at least "
                          f"{min_free_bytes / 2**20:.0f} MiB (metrics, trace, charts; checkpoints more). Free some "
                          f"space, or give another directory with -o DIR")
    return state


def fsync(path: Path) -> None:
    """Make a file, or a rename or new entry in a directory, durable (a no-op where it cannot be opened or
    the file system cannot sync it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | str) -> Path:
    """Write `data` to `path` whole or not at all: a temp file beside it, fsynced, renamed over it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync(path.parent)
    return path
