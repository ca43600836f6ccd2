"""Checkpoints without pickles: tensors in safetensors, everything else in JSON.

A state (an op's state column, a worker class's ``state_dict()``, the data source's position)
is a nested structure of dicts, lists, numbers, strings and tensors. `save_state` splits it:
each tensor goes into one safetensors file under a path key, the rest into a JSON skeleton
that refers to those keys. Loading never unpickles anything, so a checkpoint from elsewhere
cannot run code.

Layout: ``DIR/checkpoints/step_<k>/`` holding ``meta.json`` (format, step, pipeline, config) and
one ``<name>.json`` + ``<name>.safetensors`` pair per state (``<group>_<rank>`` per worker,
``source`` for the data source). A run's checkpoint is written to ``step_<k>.tmp`` and renamed
into place when complete (`write_checkpoint`); `read_checkpoint` reads one back, and
`check_compatible` refuses to resume a run with a config other than the one that wrote it.

Checkpoints prove themselves: `write_checkpoint` records every file's sha256 in ``meta.json``
(``"files"``), fsyncs the files and the folder before the rename, and keeps the newest
``trainer.keep_checkpoints``. `verify_checkpoint` checks the sums; `resume_checkpoint` picks the
checkpoint a resumed run continues from, and raises `CheckpointDamaged` naming the damaged file and
the newest good checkpoint, or (``fallback``) moves the damaged ones aside as ``step_<k>.damaged``
and continues from that good one.

Every load path here reads only JSON (`json.loads`) and safetensors (`safetensors.torch.load_file`,
which parses a JSON header and raw tensor bytes); nothing calls `pickle`, `torch.load` or Ray's
deserialiser on a file. A damaged file, or one from another checkpoint format, raises
`CheckpointError` naming the file and what to do.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from rlgraph.errors import RLGraphError
from rlgraph.graph.plan import Plan
from rlgraph.runtime.rundir import checkpoint_steps, fsync

if TYPE_CHECKING:
    import torch

__all__ = ["CheckpointError", "save_state", "load_state", "latest_checkpoint", "read_meta", "CHECKPOINT_FORMAT",
           "write_checkpoint", "read_checkpoint", "checkpoint_step", "check_compatible", "has_state",
           "RESUMABLE_KEYS", "state_skeleton", "load_part", "checkpoint_steps", "CheckpointDamaged",
           "verify_checkpoint", "resume_checkpoint", "file_sha256"]

# v2: op bodies moved into ops/ families (reward.fn's default path changed) and the policy weights carry
# their writing step as "step" and one "policy_version": a v1 checkpoint's config and weights do not fit
CHECKPOINT_FORMAT = "rlgraph.checkpoint.v2"
_TENSOR = "__tensor__"


class CheckpointError(RLGraphError):
    """A state could not be saved (an object that is neither JSON nor a tensor) or loaded."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint file is missing or its sha256 differs from the one ``meta.json`` recorded."""

    def __init__(self, message: str, ckpt: Path, file: str, good: Path | None) -> None:
        super().__init__(message)
        self.ckpt, self.file, self.good = ckpt, file, good


def _split(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    import torch  # here, not at the top: the driver starts the workers before it imports torch (actor)

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
            return tensors[obj[_TENSOR]]  # a missing key: KeyError, reported by load_state
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
        from safetensors.torch import save_file

        save_file(tensors, str(directory / f"{name}.safetensors"))
    (directory / f"{name}.json").write_text(json.dumps(skeleton, sort_keys=True))


def _read_json(path: Path, fix: str) -> Any:
    """The JSON document in `path` (never anything but JSON); `CheckpointError` if it is not one."""
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint file {str(path)!r}: {e.strerror}; {fix}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"checkpoint file {str(path)!r} is not valid JSON ({type(e).__name__}: {e}); "
                              f"it is damaged or not an rlgraph checkpoint; {fix}") from None


def load_state(directory: Path, name: str) -> Any:
    """Read a state written by `save_state`: JSON and safetensors only, never a pickle."""
    directory = Path(directory)
    fix = f"delete {str(directory)!r} to resume from an earlier checkpoint, or run without --resume"
    js = directory / f"{name}.json"
    if not js.is_file():
        raise CheckpointError(f"checkpoint {str(directory)!r} has no state {name!r} ({js.name} is missing); "
                              f"it was written by another pipeline or plan, or is incomplete; {fix}")
    st = directory / f"{name}.safetensors"
    tensors: dict[str, torch.Tensor] = {}
    if st.is_file():
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(st))
        except Exception as e:  # safetensors raises its own SafetensorError (and OSError) on bad files
            raise CheckpointError(f"checkpoint file {str(st)!r} is not a valid safetensors file "
                                  f"({type(e).__name__}: {e}); {fix}") from None
    skeleton = _read_json(js, fix)
    try:
        return _join(skeleton, tensors)
    except KeyError as e:
        raise CheckpointError(f"checkpoint state {str(js)!r} refers to tensor {e.args[0]!r}, which "
                              f"{st.name} does not hold (the two files do not belong together); {fix}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"checkpoint state {str(js)!r} is malformed ({type(e).__name__}: {e}); {fix}") from None


def _tensor_keys(obj: Any) -> Iterable[str]:
    if isinstance(obj, dict):
        if _TENSOR in obj:
            yield obj[_TENSOR]
        else:
            for v in obj.values():
                yield from _tensor_keys(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _tensor_keys(v)


def state_skeleton(directory: Path, name: str) -> Any:
    """The JSON skeleton of state `name`: its structure, with ``{"__tensor__": key}`` for each tensor."""
    js = Path(directory) / f"{name}.json"
    if not js.is_file():
        raise CheckpointError(f"checkpoint {str(directory)!r} has no state {name!r} ({js.name} is missing)")
    return _read_json(js, "it is damaged or not an rlgraph checkpoint")


def load_part(directory: Path, name: str, path: Sequence[str]) -> Any:
    """The part of state `name` found under the dict keys `path`, reading only that part's tensors
    from the safetensors file (a model's weights without its optimizer state, say)."""
    directory = Path(directory)
    node = state_skeleton(directory, name)
    for key in path:
        inner = node.get("__dict__") if isinstance(node, dict) else None
        if not isinstance(inner, dict) or key not in inner:
            raise CheckpointError(f"checkpoint state {str(directory / name)!r} has nothing at "
                                  f"{'.'.join(path)!r} (no key {key!r})")
        node = inner[key]
    keys = sorted(set(_tensor_keys(node)))
    tensors: dict[str, torch.Tensor] = {}
    if keys:
        st = directory / f"{name}.safetensors"
        from safetensors import safe_open

        try:
            with safe_open(str(st), framework="pt") as f:
                tensors = {k: f.get_tensor(k) for k in keys}
        except Exception as e:  # safetensors raises its own SafetensorError (and OSError) on bad files
            raise CheckpointError(f"cannot read tensors {keys[:3]}... of {str(st)!r} "
                                  f"({type(e).__name__}: {e})") from None
    return _join(node, tensors)


def read_meta(ckpt: Path) -> dict[str, Any]:
    """The ``meta.json`` of checkpoint folder `ckpt`, checked: this format, a step number."""
    ckpt = Path(ckpt)
    fix = f"delete {str(ckpt)!r} to resume from an earlier checkpoint, or run without --resume"
    meta = _read_json(ckpt / "meta.json", fix)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{str(ckpt / 'meta.json')!r} holds a JSON {type(meta).__name__}, not the checkpoint's "
                              f"metadata object; {fix}")
    fmt = meta.get("format")
    if fmt != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{str(ckpt / 'meta.json')!r} is checkpoint format {fmt!r}, but this rlgraph reads "
            f"{CHECKPOINT_FORMAT!r}; resume it with the rlgraph that wrote it, or {fix.replace('delete', 'move away')}")
    step = meta.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{str(ckpt / 'meta.json')!r} has no valid step number (\"step\": {step!r}); {fix}")
    return meta


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The newest complete ``step_<k>`` checkpoint under ``out_dir/checkpoints`` (has meta.json).

    Its ``meta.json`` is checked (`read_meta`), so a damaged checkpoint, or one from another
    checkpoint format, fails with a `CheckpointError` before anything is restored from it.
    """
    steps = checkpoint_steps(out_dir)
    if not steps:
        return None
    latest = Path(out_dir) / "checkpoints" / f"step_{steps[-1]}"
    read_meta(latest)
    return latest


# --------------------------------------------------------------------------- a run's checkpoints
# config keys that may differ between a checkpoint and the run resuming it: they do not change results
RESUMABLE_KEYS = ("trainer.steps", "trainer.val_every", "trainer.save_every", "trainer.keep_checkpoints",
                  "trainer.max_retries",
                  "trainer.schedule", "trainer.logger", "trainer.project", "trainer.run_name")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_checkpoint(out_dir: Path, step: int, states: Mapping[str, Any], plan: Plan, keep: int = 0) -> Path:
    """Write `states` (name -> state) as ``out_dir/checkpoints/step_<step>``, complete or not at all:
    written into ``step_<step>.tmp``, every file's sha256 in meta.json, files and folder fsynced, then
    renamed into place. With `keep` > 0 only the newest `keep` checkpoints stay."""
    d = Path(out_dir) / "checkpoints" / f"step_{step}"
    tmp = d.with_name(d.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    for name, state in states.items():
        save_state(state, tmp, name)
    files = {p.name: file_sha256(p) for p in sorted(tmp.iterdir())}
    (tmp / "meta.json").write_text(json.dumps({"format": CHECKPOINT_FORMAT, "step": step, "pipeline": plan.pipeline,
                                               "config": plan.config, "files": files}))
    for p in tmp.iterdir():
        fsync(p)
    fsync(tmp)
    if d.exists():
        shutil.rmtree(d)
    tmp.rename(d)
    fsync(d.parent)
    if keep > 0:
        for old in checkpoint_steps(out_dir)[:-keep]:
            shutil.rmtree(Path(out_dir) / "checkpoints" / f"step_{old}", ignore_errors=True)
    return d


def _damage(ckpt: Path) -> tuple[str, str] | None:
    """The first file of `ckpt` that is missing or whose sha256 differs from meta.json's, with what is
    wrong; None if every recorded file checks out."""
    meta = read_meta(ckpt)
    files = meta.get("files")
    if files is None:
        warnings.warn(f"checkpoint {str(ckpt)!r} records no checksums (written by an older rlgraph); it is used "
                      f"unchecked", RuntimeWarning, stacklevel=3)
        return None
    if not isinstance(files, dict):
        return "meta.json", f"its \"files\" entry is a JSON {type(files).__name__}, not an object of sha256 sums"
    for name, digest in sorted(files.items()):
        path = ckpt / name
        if not path.is_file():
            return name, "is missing"
        got = file_sha256(path)
        if got != digest:
            return name, f"has sha256 {got[:12]}..., but meta.json recorded {str(digest)[:12]}... (a changed or corrupted file)"
    return None


def verify_checkpoint(ckpt: Path) -> None:
    """Check every file of checkpoint `ckpt` against the sha256 sums in its meta.json."""
    ckpt = Path(ckpt)
    bad = _damage(ckpt)
    if bad is not None:
        good = _newest_good(ckpt.parent, below=checkpoint_step(ckpt))
        raise _damaged(ckpt, bad, good)


def _newest_good(root: Path, below: int) -> Path | None:
    for k in reversed([k for k in checkpoint_steps(root.parent) if k < below]):
        ckpt = root / f"step_{k}"
        try:
            if _damage(ckpt) is None:
                return ckpt
        except CheckpointError:
            continue
    return None


def _damaged(ckpt: Path, bad: tuple[str, str], good: Path | None) -> CheckpointDamaged:
    name, what = bad
    if good is not None:
        fix = (f"the newest good checkpoint is {str(good)!r}: resume from it with --resume --fallback (which moves "
               f"the damaged one aside as {ckpt.name}.damaged), or restore {name} from a backup")
    else:
        fix = "no earlier checkpoint checks out either: restore the file from a backup, or start over with --overwrite"
    return CheckpointDamaged(f"checkpoint {str(ckpt)!r} is damaged: {name} {what}; {fix}", ckpt, name, good)


def resume_checkpoint(out_dir: Path, fallback: bool = False) -> Path | None:
    """The checkpoint a resumed run continues from: the newest, checked against its sha256 sums.
    A damaged one raises `CheckpointDamaged` (naming the file and the newest good checkpoint); with
    `fallback`, every damaged checkpoint newer than the newest good one is renamed
    ``step_<k>.damaged`` and that good one is returned."""
    steps = checkpoint_steps(out_dir)
    if not steps:
        return None
    root = Path(out_dir) / "checkpoints"
    latest = root / f"step_{steps[-1]}"
    try:
        verify_checkpoint(latest)
        return latest
    except CheckpointDamaged as e:
        if not fallback or e.good is None:
            raise
        good_step = checkpoint_step(e.good)
        for k in steps:
            if k > good_step:
                bad = root / f"step_{k}"
                aside = bad.with_name(bad.name + ".damaged")
                if aside.exists():
                    shutil.rmtree(aside)
                bad.rename(aside)
        warnings.warn(f"{e}; --fallback: resuming from {str(e.good)!r}", RuntimeWarning, stacklevel=2)
        return e.good


def read_checkpoint(ckpt: Path, names: Iterable[str]) -> tuple[int, dict[str, Any]]:
    """The step of checkpoint `ckpt` and its states `names` (each checked, JSON and safetensors only)."""
    step = checkpoint_step(ckpt)
    return step, {name: load_state(ckpt, name) for name in names}


def has_state(ckpt: Path, name: str) -> bool:
    """Whether checkpoint `ckpt` holds state `name` (older checkpoints lack newer entries)."""
    return (Path(ckpt) / f"{name}.json").exists()


def checkpoint_step(ckpt: Path) -> int:
    return int(read_meta(ckpt)["step"])


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def check_compatible(ckpt: Path, plan: Plan) -> None:
    """--resume continues a run only with the config that wrote the checkpoint (steps may grow)."""
    meta = read_meta(ckpt)
    if meta.get("pipeline") not in (None, plan.pipeline):
        raise CheckpointError(f"checkpoint {str(ckpt)!r} was written by pipeline {meta['pipeline']!r}, not "
                              f"{plan.pipeline!r}; resume with the plan that wrote it, or use another output dir")
    if "config" not in meta:
        return
    old, new = _flat(meta["config"]), _flat(plan.config)
    diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and k not in RESUMABLE_KEYS)
    if diff:
        shown = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in diff[:6])
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r} was written with another config ({shown}{' ...' if len(diff) > 6 else ''}); "
            f"--resume continues a run only with the same config (trainer.steps may change). Resume with the "
            f"original overrides, or start a fresh run in another output dir")
