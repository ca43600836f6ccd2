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

A LoRA run (``actor.lora_rank > 0``) checkpoints the adapters only. Its export is the adapter in
peft's layout (``adapter_config.json``, ``adapter_model.safetensors``, loadable with
``PeftModel.from_pretrained(base, DIR)`` or served by vLLM's LoRA support), or with ``merge`` the
base model with the adapters merged into its weights, a plain ``save_pretrained`` directory. Under
FSDP2 the trainer's state is the rank's shards, so the weights come from the worker's whole copy.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

from rlgraph.errors import RLGraphError
from rlgraph.graph.config import flatten
from rlgraph.runtime.checkpoint import checkpoint_steps, load_part, read_meta, state_skeleton

__all__ = ["ExportError", "Exported", "export_model", "WORKER_CLASSES"]

# which worker class holds each exportable model, and the config keys naming its starting point
WORKER_CLASSES: Mapping[str, str] = {"actor": "rlgraph.ops.train.actor:ActorWorker",
                                     "critic": "rlgraph.ops.train.critic:CriticWorker"}
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
    kind: str = "model"  # model, adapter (a LoRA run's, peft layout) or merged (LoRA merged into the base)


def _checkpoint(run_dir: Path, step: int | None) -> Path:
    if not run_dir.is_dir():
        raise ExportError(f"run directory {str(run_dir)!r} does not exist; give the -o directory of `rlgraph run`")
    have = checkpoint_steps(run_dir)
    if not have:
        raise ExportError(f"run directory {str(run_dir)!r} has no checkpoint; run with trainer.save_every=K "
                          f"(a checkpoint every K steps) to export its model")
    if step is None:
        step = have[-1]  # the latest (export_model reads and checks its meta.json)
    elif step not in have:
        raise ExportError(f"run directory {str(run_dir)!r} has no checkpoint of step {step}; it has steps {have} "
                          f"(--step takes one of them; without --step the latest is used)")
    return run_dir / "checkpoints" / f"step_{step}"


def _trained_model(ckpt: Path, what: str) -> tuple[str, list[str]]:
    """The state name and key path of the `what` model's weights: the rank-0 worker of the group
    whose `what` worker class has trainer state (the group that ran the update)."""
    cls = WORKER_CLASSES[what]
    held, trained = [], []  # state names holding the worker class; those with trainer state
    sharded: dict[str, bool] = {}  # FSDP2: the trainer holds shards; the worker's own "model" is whole
    for js in sorted(ckpt.glob("*.json")):
        name = js.stem
        if name in _NOT_STATE or not name.rsplit("_", 1)[-1].isdigit():
            continue
        inst = state_skeleton(ckpt, name).get("__dict__", {}).get("instances", {}).get("__dict__", {})
        if cls in inst:
            held.append(name)
            trainer = inst[cls].get("__dict__", {}).get("trainer")
            if isinstance(trainer, dict) and "model" in trainer.get("__dict__", {}):
                trained.append(name)
                sharded[name] = trainer["__dict__"].get("backend") == "fsdp2"
    if not held:
        other = "critic" if what == "actor" else "actor"
        raise ExportError(f"checkpoint {str(ckpt)!r} holds no {what} model (no {cls} worker state): the pipeline "
                          f"has no {what}" + (f"; export the {other} with --what {other}" if what == "critic" else ""))
    if not trained:  # e.g. a checkpoint written during critic_warmup, before the first actor update
        raise ExportError(f"checkpoint {str(ckpt)!r} holds no trained {what}: no {what} worker had been updated when "
                          f"it was written ({', '.join(held)} hold untrained copies); export a later --step")
    # rank 0 of the (first) group that trains it; the engine's copy is the full weights even under ZeRO-3
    name = next((n for n in trained if n.endswith("_0")), trained[0])
    return name, ["instances", cls, "model"] if sharded[name] else ["instances", cls, "trainer", "model"]


def _base(config: Mapping[str, Any], what: str, base: Path | None) -> Path:
    if base is not None:
        path, how = Path(base).expanduser(), "--base"
    else:
        keys, flat = _BASE_KEYS[what], flatten(config)
        chosen = next(((k, flat[k]) for k in keys if flat.get(k)), None)
        if chosen is None:
            raise ExportError(f"the run's config names no base model ({' or '.join(keys)}); pass --base DIR, the "
                              f"Hugging Face directory the run started from")
        path, how = Path(chosen[1]).expanduser(), f"the run's {chosen[0]}"
    if not (path / "config.json").is_file():
        raise ExportError(f"base model {str(path)!r} ({how}) is not a Hugging Face model directory (no config.json); "
                          f"the export takes the architecture and tokenizer from it: pass --base DIR with the model "
                          f"the run started from")
    return path


def _build(what: str, base: Path, dtype: Any) -> Any:
    """The base's architecture in `dtype` (the trained weights'), not in the dtype its config names."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    from rlgraph.ops.models import critic_config

    try:
        config = AutoConfig.from_pretrained(base, local_files_only=True)
        if what == "actor":
            return AutoModelForCausalLM.from_config(config, dtype=dtype)
        return AutoModelForTokenClassification.from_config(critic_config(config), dtype=dtype)
    except (OSError, ValueError, KeyError) as e:
        raise ExportError(f"cannot build the {what}'s architecture from {str(base)!r}: {e}; pass --base with the "
                          f"model the run started from") from e


def _inside(a: Path, b: Path) -> bool:
    """Whether `a` is `b` or a folder above it (deleting `a` would delete `b`)."""
    a, b = a.resolve(), b.resolve()
    return a == b or a in b.parents


def export_model(run_dir: str | Path, out_dir: str | Path, *, step: int | None = None,
                 what: Literal["actor", "critic"] = "actor", base: str | Path | None = None,
                 overwrite: bool = False, merge: bool = False) -> Exported:
    """Write the `what` model of `run_dir`'s checkpoint `step` (default: the latest) to `out_dir`
    as a Hugging Face ``save_pretrained`` directory (a LoRA run: its adapter, or with `merge` the
    merged model)."""
    import torch

    from rlgraph.ops.models import load_tokenizer

    if what not in WORKER_CLASSES:
        raise ExportError(f"--what {what!r}: choose one of {', '.join(WORKER_CLASSES)}")
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    ckpt = _checkpoint(run_dir, step)
    meta = read_meta(ckpt)
    name, path = _trained_model(ckpt, what)
    base_dir = _base(meta.get("config", {}), what, None if base is None else Path(base))
    for inner, what_it_is in ((run_dir, "the run directory"), (base_dir, "the base model")):
        if _inside(out_dir, inner):
            raise ExportError(f"output directory {str(out_dir)!r} is (or holds) {what_it_is} {str(inner)!r}; "
                              f"give a new directory")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ExportError(f"output directory {str(out_dir)!r} is not empty; give a new one, or --overwrite")

    weights = load_part(ckpt, name, path)
    lora = any(".lora_" in k for k in weights)
    if merge and not lora:
        raise ExportError(f"--merge merges LoRA adapters, but the {what} of {str(run_dir)!r} trained all its weights "
                          f"(no actor.lora_rank); export without --merge")
    adapter = None
    if lora:
        adapter = _lora_model(weights, meta.get("config", {}), base_dir, ckpt / name)
        model = _merged(adapter, base_dir) if merge else None
    else:
        model = _loaded(what, weights, base_dir, ckpt / name)

    tokenizer = load_tokenizer(base_dir)
    if model is not None and what == "actor":
        from transformers import GenerationConfig

        try:  # the base model's sampling defaults and special ids, as the run generated with them
            model.generation_config = GenerationConfig.from_pretrained(base_dir, local_files_only=True)
        except OSError:
            model.generation_config = GenerationConfig.from_model_config(model.config)
    # written next to the target and swapped in complete: a failed export leaves the old one as it was
    tmp = out_dir.with_name(out_dir.name + ".rlgraph-export.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    if model is not None:
        model.save_pretrained(tmp, safe_serialization=True)
        parameters = sum(int(p.numel()) for p in model.parameters())
    else:
        from rlgraph.ops.train.lora import save_adapter

        save_adapter(adapter, tmp, base_dir)
        parameters = sum(int(t.numel()) for t in weights.values())
    tokenizer.save_pretrained(tmp)
    kind = "adapter" if model is None else ("merged" if lora else "model")
    done = Exported(out_dir=out_dir, what=what, step=int(meta["step"]), state=name, base=base_dir,
                    parameters=parameters, kind=kind)
    (tmp / "rlgraph_export.json").write_text(json.dumps({
        "run_dir": str(run_dir.resolve()), "checkpoint": str(ckpt.resolve()), "step": done.step, "what": what,
        "state": name, "base": str(base_dir.resolve()), "pipeline": meta.get("pipeline"), "kind": kind},
        indent=1) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return done


def _loaded(what: str, weights: Mapping[str, Any], base_dir: Path, where: Path) -> Any:
    """The base's architecture holding `weights`, strictly: every weight present, none extra, same shapes."""
    import torch

    dtypes = {t.dtype for t in weights.values() if t.is_floating_point()}
    model = _build(what, base_dir, dtypes.pop() if len(dtypes) == 1 else torch.float32)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing or extra:
        raise ExportError(f"the {what} weights in {str(where)!r} do not fit the architecture of "
                          f"{str(base_dir)!r}: missing {missing[:5]}, unexpected {extra[:5]}; pass --base with the "
                          f"model the run started from")
    wrong = [f"{k}: {tuple(weights[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items()
             if tuple(weights[k].shape) != tuple(v.shape)]
    if wrong:
        raise ExportError(f"the {what} weights in {str(where)!r} have other shapes than {str(base_dir)!r}'s "
                          f"architecture ({'; '.join(wrong[:3])}); pass --base with the model the run started from")
    with torch.no_grad():
        model.load_state_dict({k: weights[k] for k in expected}, strict=True)
    return model.eval()


def _lora_model(weights: Mapping[str, Any], config: Mapping[str, Any], base_dir: Path, where: Path) -> Any:
    """The base model (its own weights) with the run's LoRA adapters, holding the trained adapter weights."""
    from rlgraph.ops.models import load_causal_lm
    from rlgraph.ops.settings import ActorSettings
    from rlgraph.ops.train.lora import apply_lora

    s = ActorSettings.of(config)
    if not s.lora_rank:
        raise ExportError(f"{str(where)!r} holds LoRA adapter weights but the run's config has no actor.lora_rank")
    model = load_causal_lm(base_dir)
    apply_lora(model, s.lora_rank, s.lora_alpha, s.lora_target_modules, s.lora_dropout)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    if names != set(weights):
        raise ExportError(f"the adapters in {str(where)!r} do not fit {str(base_dir)!r} with the run's LoRA settings: "
                          f"missing {sorted(names - set(weights))[:5]}, unexpected {sorted(set(weights) - names)[:5]}; "
                          f"pass --base with the model the run started from")
    model.load_state_dict(dict(weights), strict=False)
    return model.eval()


def _merged(adapter_model: Any, base_dir: Path) -> Any:
    from rlgraph.ops.train.lora import merged_weights

    merged = merged_weights(adapter_model)
    model = _build("actor", base_dir, next(iter(merged.values())).dtype)
    model.load_state_dict(merged, strict=True)
    return model.eval()
