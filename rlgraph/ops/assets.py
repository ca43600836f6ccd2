"""Local assets that a pipeline's prepare hook makes once (a tiny model, a data file): `build_once`.

Importable without torch: ``rlgraph run`` calls the prepare hook while Ray starts, and a hook whose
model is already built then costs the driver nothing of torch's import (`rlgraph.runtime.actor`).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

__all__ = ["build_once"]


def build_once(path: str | Path, build: Callable[[Path], None]) -> Path:
    """Make `path` (``~`` expanded) by calling ``build(tmp)`` once: a no-op when `path` already holds a
    model (``config.json``); a file lock keeps parallel runs from racing; `build` writes into
    ``<path>.partial``, renamed to `path` only when complete."""
    out = Path(path).expanduser()
    if (out / "config.json").is_file():
        return out
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if (out / "config.json").is_file():  # another run made it while we waited
            return out
        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        build(tmp)
        tmp.rename(out)
    return out
