"""Typed config parameters, `key=value` overrides, and resolution against a schema.

Every configurable value of a pipeline has a dotted key (``actor.lr``, ``data.batch_size``,
``groups.actor.dp``) and a declared `Param` (type, default, doc). Overrides from the CLI are
strings parsed by the declared type; values given in Python are type-checked. Unknown keys and
wrong types are reported as problems that name the key, the expected type and close matches.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any, Mapping

from rlgraph.errors import ConfigError, DeclarationError, Problem

__all__ = ["Param", "parse_overrides", "resolve_config", "nest", "flatten"]

_TYPES = (int, float, str, bool)
_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


@dataclass(frozen=True)
class Param:
    """A config parameter: its type (int, float, str or bool), default, doc, and allowed choices.

    ``optional=True`` allows ``None`` (written ``null`` or ``none`` on the command line).
    ``setup=True`` marks a param that a worker class reads once in its ``setup`` (a model path,
    a rollout backend), so it is not passed to each call of the op's body. ``verl`` names the verl
    config keys that stand for it (``trainer.total_training_steps`` for ``trainer.steps``).

    The built-in sections' params are made from their settings models (`rlgraph.graph.settings`,
    `rlgraph.ops.settings`); a custom op declares its own.
    """

    type: type
    default: Any = None
    doc: str = ""
    choices: tuple[Any, ...] | None = None
    optional: bool = False
    minimum: float | None = None
    setup: bool = False
    verl: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.type not in _TYPES:
            raise DeclarationError(f"Param type {self.type!r} must be one of int, float, str, bool")
        if self.default is None and not self.optional:
            raise DeclarationError(f"Param of type {self.type.__name__} needs a default (or optional=True)")
        if self.default is not None:
            err = self.check(self.default)
            if err:
                raise DeclarationError(f"Param default {self.default!r}: {err}")

    @property
    def type_name(self) -> str:
        return self.type.__name__ + (" or null" if self.optional else "")

    def check(self, value: Any) -> str | None:
        """None if `value` is valid for this param, else what is wrong."""
        if value is None:
            return None if self.optional else f"expected {self.type_name}, got null"
        if self.type is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif self.type is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, self.type)
        if not ok:
            return f"expected {self.type_name}, got {type(value).__name__} {value!r}"
        if self.type is float and not math.isfinite(value):
            return f"expected a finite {self.type_name}, got {value!r}"
        if self.choices is not None and value not in self.choices:
            return f"{value!r} is not one of {', '.join(repr(c) for c in self.choices)}"
        if self.minimum is not None and value < self.minimum:
            return f"{value!r} is below the minimum {self.minimum!r}"
        return None

    def fix_for(self, key: str, value: Any, override: bool = False) -> str:
        """The fix for `value` failing `check` at `key`: the choices, the minimum, or the type (written as
        an override's ``key=...`` when `override`)."""
        if self.choices is not None and self.check(value) and isinstance(value, self.type) and not isinstance(value, bool):
            close = difflib.get_close_matches(str(value), [str(c) for c in self.choices], n=1, cutoff=0.5)
            mean = f" (did you mean {close[0]!r}?)" if close else ""
            shown = ", ".join(str(c) if override else repr(c) for c in self.choices)
            return (f"write {key}= one of {shown}" if override else f"give {key!r} one of {shown}") + mean
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if self.minimum is not None and numeric and value < self.minimum:
            low = int(self.minimum) if self.type is int else self.minimum
            return f"write {key}=<{self.type_name} >= {low}>" if override else f"give {key!r} a value of at least {low}"
        if self.type is float and numeric and not math.isfinite(value):
            return f"write {key}=<a finite float>" if override else f"give {key!r} a finite number"
        return f"write {key}=<{self.type_name}>" if override else f"give {key!r} a value of type {self.type_name}"

    def parse(self, text: str) -> Any:
        """Parse a command-line string by this param's type; raises ValueError with the reason."""
        t = text.strip()
        if self.optional and t.lower() in ("null", "none", "~"):
            return None
        if self.type is bool:
            if t.lower() in _TRUE:
                return True
            if t.lower() in _FALSE:
                return False
            raise ValueError(f"expected a bool (true/false), got {text!r}")
        if self.type is int:
            try:
                return int(t)
            except ValueError:
                raise ValueError(f"expected an int, got {text!r}") from None
        if self.type is float:
            try:
                value = float(t)
            except ValueError:
                raise ValueError(f"expected a float, got {text!r}") from None
            if not math.isfinite(value):
                raise ValueError(f"expected a finite float, got {text!r}")
            return value
        return text


def parse_overrides(items: list[str] | tuple[str, ...]) -> dict[str, str]:
    """Split ``["actor.lr=1e-6", "data.batch_size=45"]`` into a dict of raw strings.

    Raises `ConfigError` for an item without ``=`` or with an empty key.
    """
    out: dict[str, str] = {}
    if isinstance(items, str):  # a lone "a=1" would otherwise be split into characters
        items = [items]
    for item in items:
        if not isinstance(item, str):
            raise ConfigError(
                f"config override {item!r} ({type(item).__name__}) is not a 'key=value' string; "
                f"write e.g. 'actor.lr=1e-6' (or pass typed values in a dict to compile_pipeline)"
            )
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(
                f"config override {item!r} is not of the form key=value; write e.g. actor.lr=1e-6"
            )
        out[key] = value
    return out


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a.b": 1}`` -> ``{"a": {"b": 1}}``."""
    out: dict[str, Any] = {}
    for key in sorted(flat):
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = flat[key]
    return out


def _unknown_key(key: str, schema: Mapping[str, Param], origin: str) -> Problem:
    close = difflib.get_close_matches(key, list(schema), n=3, cutoff=0.6)
    namespace = key.split(".")[0]
    if close:
        fix = f"did you mean {' or '.join(repr(c) for c in close)}?"
    else:
        same_ns = sorted(k for k in schema if k.split(".")[0] == namespace)
        if same_ns:
            fix = f"keys under {namespace!r} are: {', '.join(same_ns)}"
        else:
            namespaces = sorted({k.split('.')[0] for k in schema})
            fix = f"known namespaces are: {', '.join(namespaces)}; `rlgraph describe` lists every key"
    return Problem("config-unknown-key", f"{origin} sets unknown config key {key!r}", fix)


def resolve_config(
    schema: Mapping[str, Param],
    values: Mapping[str, Any],
    overrides: Mapping[str, Any],
) -> tuple[dict[str, Any], list[Problem]]:
    """Defaults, then Python-given `values`, then string `overrides`; every problem collected.

    Returns the flat resolved config (every schema key present) and the problems found.
    """
    problems: list[Problem] = []
    resolved = {k: p.default for k, p in schema.items()}
    for key, value in values.items():
        param = schema.get(key)
        if param is None:
            problems.append(_unknown_key(key, schema, "the pipeline's config"))
            continue
        err = param.check(value)
        if err:
            problems.append(
                Problem("config-type", f"config key {key!r} in the pipeline: {err}", param.fix_for(key, value))
            )
            continue
        resolved[key] = value
    for key, text in overrides.items():
        param = schema.get(key)
        if param is None:
            problems.append(_unknown_key(key, schema, f"override {key}={text}"))
            continue
        try:
            value = param.parse(text) if isinstance(text, str) else text  # typed values from Python
        except ValueError as e:
            problems.append(
                Problem("config-type", f"override {key}={text}: {e}",
                        f"write {key}=<{param.type_name}>" + (f"; {param.doc}" if param.doc else ""))
            )
            continue
        err = param.check(value)
        if err:
            problems.append(Problem("config-type", f"override {key}={text}: {err}", param.fix_for(key, value, True)))
            continue
        resolved[key] = value
    return resolved, problems
