"""``rlgraph export``: a run's trained policy (or critic) as a Hugging Face model directory.

A checkpoint keeps each worker's state in rlgraph's own layout (`checkpoint.py`). Export finds
the worker that trained the model (the instance of `ActorWorker` or `CriticWorker` with trainer
state), reads only that model's weights (no optimizer state), loads them into the architecture
of the model the run started from (``actor.model_path``, or ``critic.model_path``; ``--base``
when that directory has moved), and writes a ``save_pretrained`` directory: ``config.json``,
safetensors weights, the tokenizer and ``generation_config.json``. Loading is strict: a weight
missing from the checkpoint, or one the architecture does not have, is an `ExportError`, never a
model with silently random layers. `AutoModelForCausalLM.from_pretrained` and the vLLM rollout
backend load an exported policy as they load any checkpoint.

The critic is exported as ``AutoModelForTokenClassification`` with one label, the form verl's
critic and `load_critic` use; ``model(input_ids).logits[..., 0]`` is its value per token.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

from rlgraph.errors import RLGraphError
from rlgraph.runtime.checkpoint import latest_checkpoint, load_part, read_meta, state_skeleton

__all__ = ["ExportError", "Exported", "export_model", "WORKER_CLASSES"]

# which worker class holds each exportable model, and the config keys naming its starting point
WORKER_CLASSES: Mapping[str, str] = {"actor": "rlgraph.ops.actor:ActorWorker",
                                     "critic": "rlgraph.ops.critic:CriticWorker"}
_BASE_KEYS: Mapping[str, tuple[str, ...]] = {"actor": ("actor.model_path", "rollout.model_path"),
                                             "critic": ("critic.model_path", "actor.model_path")}
_NOT_STATE = {"meta", "source", "state_versions"}


class ExportError(RLGraphError):
    """A run directory, checkpoint or base model from which no Hugging Face model can be written."""


@dataclass(frozen=True)
class Exported:
    """What `export_model` wrote."""

    out_dir: Path
    what: str
    step: int  # the checkpoint's step (the weights after that step's update)
    state: str  # the checkpoint state it came from, <group>_<rank>
    base: Path  # the model directory whose config and tokenizer it reuses
    parameters: int


def _checkpoint(run_dir: Path, step: int | None) -> Path:
    if not run_dir.is_dir():
        raise ExportError(f"run directory {str(run_dir)!r} does not exist; give the -o directory of `rlgraph run`")
    if step is None:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            raise ExportError(f"run directory {str(run_dir)!r} has no checkpoint; run with trainer.save_every=K "
                              f"(a checkpoint every K steps) to export its model")
        return ckpt
    ckpt = run_dir / "checkpoints" / f"step_{step}"
    if not (ckpt / "meta.json").is_file():
        have = sorted(int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*")
                      if p.name[5:].isdigit() and (p / "meta.json").is_file())
        raise ExportError(f"run directory {str(run_dir)!r} has no checkpoint of step {step}; it has steps {have} "
                          f"(--step takes one of them; without --step the latest is used)")
    return ckpt


def _trained_model(ckpt: Path, what: str) -> tuple[str, list[str]]:
    """The state name and key path of the `what` model's weights: the rank-0 worker of the group
    whose `what` worker class has trainer state (the group that ran the update)."""
    cls = WORKER_CLASSES[what]
    found: list[tuple[bool, str]] = []  # (trained, state name)
    for js in sorted(ckpt.glob("*.json")):
        name = js.stem
        if name in _NOT_STATE or not name.rsplit("_", 1)[-1].isdigit():
            continue
        inst = state_skeleton(ckpt, name).get("__dict__", {}).get("instances", {}).get("__dict__", {})
        if cls in inst:
            trainer = inst[cls].get("__dict__", {}).get("trainer")
            found.append((isinstance(trainer, dict) and "model" in trainer.get("__dict__", {}), name))
    if not found:
        other = "critic" if what == "actor" else "actor"
        raise ExportError(f"checkpoint {str(ckpt)!r} holds no {what} model (no {cls} worker state): the pipeline "
                          f"has no {what}" + (f"; export the {other} with --what {other}" if what == "critic" else ""))
    trained = sorted(n for t, n in found if t)
    name = next((n for n in trained if n.endswith("_0")), trained[0] if trained else sorted(n for _, n in found)[0])
    if name in trained:  # the engine's copy: the full weights even under ZeRO-3
        return name, ["instances", cls, "trainer", "model"]
    return name, ["instances", cls, "model"]


def _base(config: Mapping[str, Any], what: str, base: Path | None) -> Path:
    if base is not None:
        path, how = Path(base).expanduser(), "--base"
    else:
        keys = _BASE_KEYS[what]
        values = [config.get(k.split(".")[0], {}).get(k.split(".")[1]) for k in keys]
        chosen = next(((k, v) for k, v in zip(keys, values) if v), None)
        if chosen is None:
            raise ExportError(f"the run's config names no base model ({' or '.join(keys)}); pass --base DIR, the "
                              f"Hugging Face directory the run started from")
        path, how = Path(chosen[1]).expanduser(), f"the run's {chosen[0]}"
    if not (path / "config.json").is_file():
        raise ExportError(f"base model {str(path)!r} ({how}) is not a Hugging Face model directory (no config.json); "
                          f"the export takes the architecture and tokenizer from it: pass --base DIR with the model "
                          f"the run started from")
    return path


def _build(what: str, base: Path) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(base, local_files_only=True)
    if what == "actor":
        return AutoModelForCausalLM.from_config(config)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    return AutoModelForTokenClassification.from_config(config)


def export_model(run_dir: str | Path, out_dir: str | Path, *, step: int | None = None,
                 what: Literal["actor", "critic"] = "actor", base: str | Path | None = None,
                 overwrite: bool = False) -> Exported:
    """Write the `what` model of `run_dir`'s checkpoint `step` (default: the latest) to `out_dir`
    as a Hugging Face ``save_pretrained`` directory."""
    import torch

    from rlgraph.ops.models import load_tokenizer

    if what not in WORKER_CLASSES:
        raise ExportError(f"--what {what!r}: choose one of {', '.join(WORKER_CLASSES)}")
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    ckpt = _checkpoint(run_dir, step)
    meta = read_meta(ckpt)
    name, path = _trained_model(ckpt, what)
    base_dir = _base(meta.get("config", {}), what, None if base is None else Path(base))
    if out_dir.exists() and any(out_dir.iterdir()):
        if not overwrite:
            raise ExportError(f"output directory {str(out_dir)!r} is not empty; give a new one, or --overwrite")
        shutil.rmtree(out_dir)

    weights = load_part(ckpt, name, path)
    model = _build(what, base_dir)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing or extra:
        raise ExportError(f"the {what} weights in {str(ckpt / name)!r} do not fit the architecture of "
                          f"{str(base_dir)!r}: missing {missing[:5]}, unexpected {extra[:5]}; pass --base with the "
                          f"model the run started from")
    wrong = [f"{k}: {tuple(weights[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items()
             if tuple(weights[k].shape) != tuple(v.shape)]
    if wrong:
        raise ExportError(f"the {what} weights in {str(ckpt / name)!r} have other shapes than {str(base_dir)!r}'s "
                          f"architecture ({'; '.join(wrong[:3])}); pass --base with the model the run started from")
    with torch.no_grad():
        model.load_state_dict({k: weights[k].to(expected[k].dtype) for k in expected}, strict=True)
    model.eval()

    tokenizer = load_tokenizer(base_dir)
    if what == "actor":
        from transformers import GenerationConfig

        try:  # the base model's sampling defaults and special ids, as the run generated with them
            model.generation_config = GenerationConfig.from_pretrained(base_dir, local_files_only=True)
        except OSError:
            model.generation_config = GenerationConfig.from_model_config(model.config)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    done = Exported(out_dir=out_dir, what=what, step=int(meta["step"]), state=name, base=base_dir,
                    parameters=sum(int(t.numel()) for t in expected.values()))
    (out_dir / "rlgraph_export.json").write_text(json.dumps({
        "run_dir": str(run_dir.resolve()), "checkpoint": str(ckpt.resolve()), "step": done.step, "what": what,
        "state": name, "base": str(base_dir.resolve()), "pipeline": meta.get("pipeline")}, indent=1) + "\n")
    return done
