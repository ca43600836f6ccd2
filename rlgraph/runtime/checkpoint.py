"""Checkpoints without pickles: tensors in safetensors, everything else in JSON.

A state (an op's state column, a worker class's ``state_dict()``, the data source's position)
is a nested structure of dicts, lists, numbers, strings and tensors. `save_state` splits it:
each tensor goes into one safetensors file under a path key, the rest into a JSON skeleton
that refers to those keys. Loading never unpickles anything, so a checkpoint from elsewhere
cannot run code.

Layout: ``DIR/checkpoints/step_<k>/`` holding ``meta.json`` (step, source position, format) and
one ``<name>.json`` + ``<name>.safetensors`` pair per state.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rlgraph.errors import RLGraphError

__all__ = ["CheckpointError", "save_state", "load_state", "latest_checkpoint", "CHECKPOINT_FORMAT"]

CHECKPOINT_FORMAT = "rlgraph.checkpoint.v1"
_TENSOR = "__tensor__"


class CheckpointError(RLGraphError):
    """A state could not be saved (an object that is neither JSON nor a tensor) or loaded."""


def _split(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        key = path or "value"
        tensors[key] = obj.detach().cpu().contiguous()
        return {_TENSOR: key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {"__dict__": {k: _split(v, f"{path}.{k}" if path else k, tensors) for k, v in obj.items()}}
        if all(isinstance(k, int) and not isinstance(k, bool) for k in obj):  # optimizer state: param ids
            return {"__intdict__": {str(k): _split(v, f"{path}.{k}" if path else str(k), tensors)
                                    for k, v in obj.items()}}
        raise CheckpointError(f"state at {path or '<root>'!r} mixes key types; use all-str or all-int keys")
    if isinstance(obj, (list, tuple)):
        return {"__list__": [_split(v, f"{path}[{i}]", tensors) for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if obj == obj and abs(obj) != float("inf") else {"__float__": repr(obj)}  # nan/inf
    raise CheckpointError(
        f"cannot checkpoint {type(obj).__name__} at {path or '<root>'!r}: states must be tensors, dicts, lists, "
        f"numbers or strings (return state_dict()-style values)"
    )


def _join(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if _TENSOR in obj:
            return tensors[obj[_TENSOR]]
        if "__dict__" in obj:
            return {k: _join(v, tensors) for k, v in obj["__dict__"].items()}
        if "__intdict__" in obj:
            return {int(k): _join(v, tensors) for k, v in obj["__intdict__"].items()}
        if "__list__" in obj:
            return [_join(v, tensors) for v in obj["__list__"]]
        if "__float__" in obj:
            return float(obj["__float__"])
    return obj


def save_state(state: Any, directory: Path, name: str) -> None:
    """Write `state` as ``name.json`` (+ ``name.safetensors`` when it holds tensors)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _split(state, "", tensors)
    # safetensors refuses tensors sharing storage; clone the rare shared ones
    seen: set[int] = set()
    for k, t in tensors.items():
        ptr = t.untyped_storage().data_ptr() if t.numel() else id(t)
        if ptr in seen:
            tensors[k] = t.clone()
        seen.add(ptr)
    if tensors:
        save_file(tensors, str(directory / f"{name}.safetensors"))
    (directory / f"{name}.json").write_text(json.dumps(skeleton, sort_keys=True))


def load_state(directory: Path, name: str) -> Any:
    """Read a state written by `save_state`."""
    js = directory / f"{name}.json"
    if not js.is_file():
        raise CheckpointError(f"checkpoint {str(directory)!r} has no state {name!r} ({js.name} is missing)")
    st = directory / f"{name}.safetensors"
    tensors = load_file(str(st)) if st.is_file() else {}
    return _join(json.loads(js.read_text()), tensors)


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The newest complete ``step_<k>`` checkpoint under ``out_dir/checkpoints`` (has meta.json)."""
    root = out_dir / "checkpoints"
    if not root.is_dir():
        return None
    done = [p for p in root.glob("step_*") if (p / "meta.json").is_file() and p.name[5:].isdigit()]
    return max(done, key=lambda p: int(p.name[5:]), default=None)
