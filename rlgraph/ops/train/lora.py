"""LoRA through peft: adapters on the policy, the frozen base as the reference, merged weights for serving.

`apply_lora(model, rank, alpha, target_modules)` injects peft LoRA adapters into a transformers
causal LM in place and freezes everything else, so only the adapters train (and are
checkpointed: `rlgraph.ops.train.engine.base.model_state` keeps trainable parameters only). The
model object stays the transformers model it was (the engine, DDP and FSDP2 wrap it as before);
its parameter names gain peft's ``base_layer`` / ``lora_A`` / ``lora_B`` parts.

- The reference policy is the same model with the adapters switched off (`adapters_disabled`):
  LoRA starts at B = 0, so the base is the policy at step 0, and no second copy of the weights
  is loaded.
- Whoever serves the policy elsewhere (a vLLM engine, a generation-only group, ``rlgraph export
  --merge``) gets `merged_weights`: ``W + (alpha / rank) * B @ A`` under the base model's own
  names, computed on the side; the trained model is never merged in place.
- ``rlgraph export`` without ``--merge`` writes the adapter in peft's layout (`save_adapter`), loadable
  with ``PeftModel.from_pretrained(base, DIR)`` or vLLM's LoRA support.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor

from rlgraph.errors import ConfigError

__all__ = ["apply_lora", "has_lora", "adapters_disabled", "merged_weights", "save_adapter", "lora_targets",
           "ADAPTER"]

ADAPTER = "default"  # peft's name of the one adapter


def _peft() -> Any:
    try:
        import peft
    except ImportError as e:
        raise ConfigError("actor.lora_rank > 0 needs peft: install it with pip install 'rlgraph[lora]' (or "
                          "scripts/setup.sh, which installs it)") from e
    return peft


def lora_targets(spec: str) -> str | list[str]:
    """``actor.lora_target_modules`` as peft takes it: 'all-linear' or a list of module names."""
    spec = spec.strip()
    if spec in ("", "all-linear", "all_linear"):
        return "all-linear"
    return [s.strip() for s in spec.split(",") if s.strip()]


def apply_lora(model: torch.nn.Module, rank: int, alpha: float, target_modules: str | Sequence[str],
               dropout: float = 0.0) -> torch.nn.Module:
    """Inject LoRA adapters (rank `rank`, scale alpha / rank) into `model`'s `target_modules` in place;
    freeze everything else. Returns `model`. An unknown module name is a `ConfigError` naming the
    model's linear layers."""
    peft = _peft()
    targets = lora_targets(target_modules) if isinstance(target_modules, str) else list(target_modules)
    if targets != "all-linear":
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        unknown = [t for t in targets if t not in linear]
        if unknown:
            raise ConfigError(f"actor.lora_target_modules names {unknown}, which this model has no linear layer "
                              f"called; its linear layers are {linear} (or use all-linear)")
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=dropout, bias="none",
                             task_type="CAUSAL_LM")
    peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    model._rlgraph_lora = {"rank": rank, "alpha": alpha, "target_modules": targets, "dropout": dropout}
    return model


def has_lora(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "_rlgraph_lora", None))


def _lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Run `model` as its frozen base: every LoRA layer passes its input to the base layer only."""
    layers = [m for _, m in _lora_layers(model)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)


@torch.no_grad()
def merged_weights(model: torch.nn.Module) -> dict[str, Tensor]:
    """The policy's weights under the base model's names, with every adapter's ``scale * B @ A``
    added to its layer's weight (new tensors; the model is unchanged)."""
    sd = model.state_dict()
    out = {k.replace(".base_layer.", "."): v for k, v in sd.items() if ".lora_" not in k}
    for name, layer in _lora_layers(model):
        key = f"{name}.weight"
        out[key] = out[key] + layer.get_delta_weight(ADAPTER).to(out[key].dtype)
    return out


def save_adapter(model: torch.nn.Module, out_dir: str | Path, base_model: str) -> Path:
    """The adapter in peft's layout: ``adapter_config.json`` and ``adapter_model.safetensors``."""
    peft = _peft()
    from safetensors.torch import save_file

    settings = model._rlgraph_lora
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = peft.get_peft_model_state_dict(model, adapter_name=ADAPTER)
    # the names PeftModel.save_pretrained writes: the model sits under PeftModel's base_model.model
    save_file({f"base_model.model.{k}": v.detach().contiguous().cpu() for k, v in state.items()},
              str(out / "adapter_model.safetensors"))
    config = peft.LoraConfig(r=settings["rank"], lora_alpha=settings["alpha"],
                             target_modules=settings["target_modules"], lora_dropout=settings["dropout"],
                             bias="none", task_type="CAUSAL_LM", base_model_name_or_path=str(base_model))
    (out / "adapter_config.json").write_text(json.dumps(config.to_dict(), indent=2, default=_jsonable) + "\n")
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)
