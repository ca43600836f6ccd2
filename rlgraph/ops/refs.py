"""User code named in a config: ``"module:name"`` or ``"path/to/file.py:name"``.

Reward functions (`reward.fn`), agent environments (`agent.env`) and tools (`agent.tools`) are
named this way, so a pipeline's config says which code runs and `rlgraph validate` can import it
before anything starts. A failure is a `RefError` naming the reference and what went wrong.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

from rlgraph.errors import OpError

__all__ = ["RefError", "import_ref"]


class RefError(OpError):
    """A ``module:name`` reference in a config does not resolve; the message names it and why."""


def _module(target: str, ref: str, what: str) -> ModuleType:
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise RefError(f"{what} {ref!r}: file {target!r} does not exist")
            spec = importlib.util.spec_from_file_location(f"_rlgraph_ref_{path.stem}", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        return importlib.import_module(target)
    except RefError:
        raise
    except Exception as e:  # the user's module failed to import (ImportError, SyntaxError, ...)
        raise RefError(f"cannot import {target!r} for {what} {ref!r}: {type(e).__name__}: {e}") from e


def import_ref(ref: str, what: str) -> Any:
    """The object ``ref`` names (``"module:name"``, ``"file.py:name"``, ``name`` may be dotted).
    `what` names the setting in messages (e.g. "reward function", "agent.env")."""
    target, sep, name = ref.rpartition(":")
    if not sep or not target or not name:
        raise RefError(f"{what} {ref!r} is not of the form 'module:name' or 'path/to/file.py:name'")
    obj: Any = _module(target, ref, what)
    for part in name.split("."):
        if not hasattr(obj, part):
            raise RefError(f"{what} {ref!r}: module {target!r} has no attribute {name!r}")
        obj = getattr(obj, part)
    return obj
