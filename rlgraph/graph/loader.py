"""Load a PIPELINE argument: a Python file (``examples/ppo.py``) or ``module:attr``.

In a file, the pipeline is the module-level ``pipeline`` if there is one, else the only
`Pipeline` object defined there. ``attr`` may also name a function taking no arguments that
returns a `Pipeline`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from rlgraph.errors import OpError, PipelineLoadError, RLGraphError
from rlgraph.graph.dsl import Pipeline

__all__ = ["load_pipeline", "import_file", "resolve_impl"]


def import_file(path: str | Path) -> ModuleType:
    """Import a Python file as a module registered in `sys.modules` (so its ops can be found)."""
    path = Path(path).resolve()
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
    name = f"rlgraph_user_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PipelineLoadError(f"cannot import {str(path)!r} as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except RLGraphError:
        sys.modules.pop(name, None)
        raise
    except Exception as e:
        sys.modules.pop(name, None)
        tb = traceback.extract_tb(e.__traceback__)
        where = next((f"{f.filename}:{f.lineno}" for f in reversed(tb) if f.filename == str(path)), str(path))
        raise PipelineLoadError(
            f"importing pipeline file {str(path)!r} failed at {where}: {type(e).__name__}: {e}"
        ) from e
    return module


def resolve_impl(ref: str, impl_file: str | None = None) -> tuple[Any, str | None]:
    """Import ``module:qualname``. Returns (object, class name) where the object is the function,
    or the class when the qualname is ``Class.method`` (the caller instantiates it once)."""
    module_name, sep, qualname = ref.partition(":")
    if not sep:
        raise OpError(f"op body reference {ref!r} is not of the form module:qualname")
    try:
        if module_name == "__main__" and impl_file:
            # a script's ops: import the script as a module (its `if __name__ == "__main__":`
            # block does not run), never the worker's own __main__
            raise ImportError("defined in a script")
        module = importlib.import_module(module_name)
    except ImportError as e:
        if not impl_file:
            raise OpError(f"cannot import {module_name!r} for op body {ref!r}: {e}") from e
        module = import_file(impl_file)
    parts = qualname.split(".")
    obj: Any = module
    for i, part in enumerate(parts):
        if not hasattr(obj, part):
            raise OpError(f"op body {ref!r}: {'.'.join(parts[:i]) or module_name!r} has no attribute {part!r}")
        if i == len(parts) - 1 and inspect.isclass(obj):
            return obj, part
        obj = getattr(obj, part)
    return obj, None


def _import_module(module_name: str, ref: str) -> ModuleType:
    """Import `module_name` for the reference `ref`; any failure becomes a `PipelineLoadError`."""
    try:
        return importlib.import_module(module_name)
    except RLGraphError:
        raise
    except ImportError as e:
        raise PipelineLoadError(f"cannot import module {module_name!r} from {ref!r}: {e}") from e
    except Exception as e:  # the user's module raised while being imported
        tb = traceback.extract_tb(e.__traceback__)
        where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
        raise PipelineLoadError(
            f"importing module {module_name!r} (from {ref!r}) failed{where}: {type(e).__name__}: {e}"
        ) from e


def _as_pipeline(obj: Any, what: str) -> Pipeline:
    if callable(obj) and not isinstance(obj, Pipeline):
        try:
            obj = obj()
        except RLGraphError:
            raise
        except TypeError as e:
            raise PipelineLoadError(f"{what} is a function but calling it with no arguments failed: {e}") from e
    if not isinstance(obj, Pipeline):
        raise PipelineLoadError(f"{what} is a {type(obj).__name__}, not an rlgraph Pipeline")
    return obj


def load_pipeline(ref: str) -> tuple[Pipeline, str]:
    """The `Pipeline` named by `ref`, and a canonical ref to record in the plan."""
    path = Path(ref)
    file_part, colon, attr = ref.rpartition(":")
    if colon and file_part.endswith(".py") and Path(file_part).is_file() and attr.isidentifier():
        module = import_file(Path(file_part))  # a file and one of its pipelines: examples/distill.py:grpo
        if not hasattr(module, attr):
            raise PipelineLoadError(f"{file_part} has no attribute {attr!r}")
        return _as_pipeline(getattr(module, attr), f"`{attr}` in {file_part}"), f"{Path(file_part).resolve()}:{attr}"
    if ref.endswith(".py") or path.is_file():
        if not path.is_file():
            raise PipelineLoadError(f"pipeline file {ref!r} does not exist")
        module = import_file(path)
        if hasattr(module, "pipeline"):
            return _as_pipeline(module.pipeline, f"`pipeline` in {ref}"), str(path.resolve())
        found = [(k, v) for k, v in vars(module).items() if isinstance(v, Pipeline)]
        if len(found) == 1:
            return found[0][1], str(path.resolve())
        if not found:
            raise PipelineLoadError(
                f"{ref} defines no Pipeline; assign one to a module-level variable named `pipeline`"
            )
        names = ", ".join(k for k, _ in found)
        raise PipelineLoadError(
            f"{ref} defines several Pipelines ({names}); name the one to use as `pipeline`, or pass "
            f"a module:attr reference"
        )
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise PipelineLoadError(
            f"{ref!r} is neither a Python file nor a module:attr reference (e.g. examples/ppo.py or "
            f"mypkg.pipelines:ppo)"
        )
    module = _import_module(module_name, ref)
    if not hasattr(module, attr):
        raise PipelineLoadError(f"module {module_name!r} has no attribute {attr!r}")
    return _as_pipeline(getattr(module, attr), f"{ref}"), ref
