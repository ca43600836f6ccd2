"""How a model's text calls tools, and how tool results are written back (``agent.format``).

A format says three things: the strings that end a model turn that calls a tool (so generation
stops there and the tool runs), how to find the calls in a turn's text, and the text of the
observation that carries the results back. Two are built in:

- ``hermes`` (Qwen, Hermes, verl's tool agent): ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``, several per turn; results come back as ``<tool_response>\\n...\\n</tool_response>``.
- ``inline``: ``[name argument text]``, one per turn, the whole argument text passed as the
  tool's one string parameter; the result comes back as ``=result]``. Short enough for a tiny
  model with a character tokenizer to learn (see examples/agent_tools.py).

Any other: ``"module:Class"`` naming a `ToolFormat` subclass with a no-argument constructor.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FORMATS", "Hermes", "Inline", "ToolCall", "ToolFormat", "load_format"]


@dataclass(frozen=True)
class ToolCall:
    """One call found in a model turn; `error` says why it could not be read (then `name` may be "")."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str = ""


class ToolFormat:
    """Base of tool-call formats. `stop`: strings whose appearance ends a model turn."""

    stop: tuple[str, ...] = ()

    def parse(self, text: str) -> list[ToolCall]:
        """The calls in one model turn's text ([] when it calls nothing: its answer)."""
        raise TypeError(f"{type(self).__name__} must define parse(text) -> list[ToolCall]")

    def render(self, results: list[str]) -> str:
        """The observation text that carries `results` (one per call, in order) back to the model."""
        raise TypeError(f"{type(self).__name__} must define render(results) -> str")


class Hermes(ToolFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn."""

    stop = ("</tool_call>",)
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for body in self._CALL.findall(text):
            try:
                obj = json.loads(body)
            except json.JSONDecodeError as e:
                calls.append(ToolCall("", error=f"the tool call is not JSON ({e.msg} at {e.pos}): {body.strip()[:200]}"))
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                calls.append(ToolCall("", error='a tool call needs {"name": "...", "arguments": {...}}'))
                continue
            args = obj.get("arguments", {})
            if isinstance(args, str):  # some models write the arguments as a JSON string
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    pass
            if not isinstance(args, dict):
                calls.append(ToolCall(obj["name"], error="the tool call's arguments must be a JSON object"))
                continue
            calls.append(ToolCall(obj["name"], args))
        return calls

    def render(self, results: list[str]) -> str:
        return "".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)


class Inline(ToolFormat):
    """``[name argument text]``: the first call of a turn (a name of letters and ``_``); its text
    goes to the tool's first parameter. The result comes back as ``=result]``. Subclass it to pick other delimiters
    (``open``, ``close``, ``result``), e.g. ones a character tokenizer knows."""

    open, close, result = "[", "]", "="

    def __init__(self) -> None:
        self.stop = (self.close,)
        o, c = re.escape(self.open), re.escape(self.close)
        self._call = re.compile(rf"{o}([A-Za-z_]+)\s*((?:(?!{c}).)*){c}", re.S)

    def parse(self, text: str) -> list[ToolCall]:
        m = self._call.search(text)
        if m is None:
            return []
        return [ToolCall(m.group(1), {"": m.group(2).strip()})]  # "": the tool's first parameter

    def render(self, results: list[str]) -> str:
        return "".join(f"{self.result}{r}{self.close}" for r in results)


FORMATS: dict[str, type[ToolFormat]] = {"hermes": Hermes, "inline": Inline}


def load_format(name: str) -> ToolFormat:
    """``hermes``, ``inline`` or ``module:Class`` (a `ToolFormat` subclass)."""
    if name in FORMATS:
        return FORMATS[name]()
    from rlgraph.ops.refs import RefError, import_ref

    cls = import_ref(name, "agent.format")
    if not (isinstance(cls, type) and issubclass(cls, ToolFormat)):
        raise RefError(f"agent.format {name!r} is not a ToolFormat subclass; give 'hermes', 'inline' or "
                       f"'module:Class' naming one")
    return cls()
