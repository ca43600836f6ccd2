"""Tools: plain Python functions an agent's model may call, with an OpenAI-style JSON schema.

    from rlgraph.ops.agents import tool

    @tool(timeout_s=2.0)
    def calc(expression: str) -> str:
        '''Evaluate an arithmetic expression.'''
        ...

`agent.tools` names them (``"my_tools.py:calc,my_tools.py:search"``, or one name holding a list);
a plain function is made a `Tool` with the schema its signature gives. `ToolBox` runs a turn's
calls: at most ``agent.tool_concurrency`` at once over all trajectories, each with its time
limit. Whatever a call does (raises, hangs, returns something unprintable, names no tool, gives
wrong arguments) becomes an error *observation* the model reads, counted in the ``agent/*``
metrics; it never stops the run. A call that overran its limit is abandoned: its thread runs
on until the function returns (a Python thread cannot be stopped), so tools that may never
return should run their work in a process (`rlgraph.ops.agents.sandbox`, which kills it).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence, get_type_hints

from rlgraph.ops.agents.formats import ToolCall

__all__ = ["Tool", "ToolBox", "ToolResult", "describe", "load_tools", "schema_of", "tool"]

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
MAX_RESULT_CHARS = 4096  # a longer result is cut (the observation budget cuts it again in tokens)


@dataclass(frozen=True)
class Tool:
    """A callable the model may call by `name`; `schema` is the OpenAI function schema."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]
    timeout_s: float | None = None

    @property
    def params(self) -> list[str]:
        return list(self.schema["function"]["parameters"]["properties"])

    @property
    def required(self) -> list[str]:
        return list(self.schema["function"]["parameters"].get("required", []))


def schema_of(fn: Callable[..., Any], name: str | None = None, description: str | None = None) -> dict[str, Any]:
    """The OpenAI function schema of `fn`: one property per parameter (typed by its annotation:
    str, int, float, bool, list, dict; anything else is a string), required when it has no default."""
    sig = inspect.signature(fn)
    try:
        hints = get_type_hints(fn)
    except Exception:  # unresolvable annotations: every parameter is a string
        hints = {}
    props: dict[str, Any] = {}
    required = []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        props[p.name] = {"type": _JSON_TYPES.get(hints.get(p.name), "string")}
        if p.default is p.empty:
            required.append(p.name)
    doc = description if description is not None else inspect.getdoc(fn) or ""
    return {"type": "function", "function": {
        "name": name or fn.__name__, "description": doc.strip().split("\n\n")[0],
        "parameters": {"type": "object", "properties": props, "required": required}}}


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None,
         timeout_s: float | None = None) -> Any:
    """Make `fn` a `Tool` (as ``@tool`` or ``@tool(name=..., timeout_s=...)``)."""
    def make(f: Callable[..., Any]) -> Tool:
        return Tool(name or f.__name__, f, schema_of(f, name, description), timeout_s)
    return make(fn) if fn is not None else make


def _as_tool(obj: Any, ref: str) -> Tool:
    from rlgraph.ops.refs import RefError

    if isinstance(obj, Tool):
        return obj
    if callable(obj):
        return tool(obj)
    raise RefError(f"agent.tools {ref!r} is a {type(obj).__name__}, not a function or a Tool")


def load_tools(spec: str) -> list[Tool]:
    """``"module:fn,file.py:other"`` (each a function, a `Tool`, or a list of them) -> tools, with
    unique names."""
    from rlgraph.ops.refs import RefError, import_ref

    tools: list[Tool] = []
    for ref in (r.strip() for r in spec.split(",")):
        if not ref:
            continue
        obj = import_ref(ref, "agent.tools")
        items = obj if isinstance(obj, (list, tuple)) else [obj]
        tools += [_as_tool(o, ref) for o in items]
    names = [t.name for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise RefError(f"agent.tools names tools {dup} more than once; give each tool its own name")
    return tools


@dataclass
class ToolResult:
    """What one call gave the model: `text`, and whether it was an error or a timeout."""

    text: str
    error: bool = False
    timeout: bool = False


@dataclass
class _Counts:
    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    abandoned: int = 0
    seconds: float = 0.0


def _text(value: Any) -> str:
    if isinstance(value, str):
        out = value
    else:
        try:
            out = json.dumps(value)
        except (TypeError, ValueError):
            out = repr(value)
    return out if len(out) <= MAX_RESULT_CHARS else out[:MAX_RESULT_CHARS] + "..."


class ToolBox:
    """Runs tool calls of many trajectories: `concurrency` at once, `timeout_s` each (a tool's own
    `timeout_s` wins), errors turned into observations. ``counts`` feeds the agent metrics."""

    def __init__(self, tools: Sequence[Tool], concurrency: int = 8, timeout_s: float = 10.0) -> None:
        self.tools = {t.name: t for t in tools}
        self.timeout_s = timeout_s
        self._slots = threading.BoundedSemaphore(max(1, concurrency))
        self._lock = threading.Lock()
        self.counts = _Counts()
        self._loop: asyncio.AbstractEventLoop | None = None

    def _check(self, call: ToolCall) -> tuple[Tool | None, dict[str, Any], str]:
        if call.error:
            return None, {}, call.error
        t = self.tools.get(call.name)
        if t is None:
            return None, {}, f"there is no tool {call.name!r}; the tools are {sorted(self.tools)}"
        args = dict(call.arguments)
        if "" in args:  # a format that passes one unnamed argument (inline): the first parameter
            if not t.params:
                return None, {}, f"tool {t.name!r} takes no arguments"
            args[t.params[0]] = args.pop("")
        unknown = sorted(set(args) - set(t.params))
        missing = [p for p in t.required if p not in args]
        if unknown or missing:
            return None, {}, (f"tool {t.name!r} takes {t.params}" + (f"; unknown {unknown}" if unknown else "")
                              + (f"; missing {missing}" if missing else ""))
        return t, args, ""

    def _async_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="rlgraph_tools_loop", daemon=True).start()
            return self._loop

    def _run_one(self, t: Tool, args: dict[str, Any]) -> ToolResult:
        limit = t.timeout_s if t.timeout_s is not None else self.timeout_s
        box: dict[str, Any] = {}
        done = threading.Event()
        if inspect.iscoroutinefunction(t.fn):
            fut = asyncio.run_coroutine_threadsafe(asyncio.wait_for(t.fn(**args), limit or None), self._async_loop())
            fut.add_done_callback(lambda f: (box.update(value=f.result()) if not f.exception()
                                             else box.update(error=f.exception()), done.set()))
        else:
            def target() -> None:
                try:
                    box["value"] = t.fn(**args)
                except BaseException as e:  # the tool's failure becomes the model's observation
                    box["error"] = e
                finally:
                    done.set()
            threading.Thread(target=target, name=f"rlgraph_tool_{t.name}", daemon=True).start()
        # a coroutine is cancelled by wait_for at its limit: wait a little past it for that answer
        grace = 1.0 if inspect.iscoroutinefunction(t.fn) else 0.0
        if not done.wait(limit + grace if limit else None):
            with self._lock:
                self.counts.abandoned += 1
            return ToolResult(f"error: tool {t.name!r} timed out after {limit:g}s", error=True, timeout=True)
        err = box.get("error")
        if isinstance(err, asyncio.TimeoutError):
            return ToolResult(f"error: tool {t.name!r} timed out after {limit:g}s", error=True, timeout=True)
        if err is not None:
            return ToolResult(f"error: {type(err).__name__}: {_text(str(err))}", error=True)
        try:
            return ToolResult(_text(box.get("value")))
        except Exception as e:  # a value whose repr raises: garbage
            return ToolResult(f"error: tool {t.name!r} returned an unprintable {type(box.get('value')).__name__}: "
                              f"{type(e).__name__}", error=True)

    def run(self, call: ToolCall) -> ToolResult:
        """One call (blocks for a free slot), never raising."""
        t, args, problem = self._check(call)
        if t is None:
            result = ToolResult(f"error: {problem}", error=True)
        else:
            with self._slots:
                t0 = time.monotonic()
                result = self._run_one(t, args)
                spent = time.monotonic() - t0
            with self._lock:
                self.counts.seconds += spent
        with self._lock:
            self.counts.calls += 1
            self.counts.errors += result.error
            self.counts.timeouts += result.timeout
        return result

    def take_counts(self) -> _Counts:
        """The counts since the last take (a call's metrics), reset."""
        with self._lock:
            out, self.counts = self.counts, _Counts()
        return out

    def close(self) -> None:
        """Stop the loop of async tools, cancelling calls still running on it."""
        loop, self._loop = self._loop, None
        if loop is not None:
            def stop() -> None:
                for task in asyncio.all_tasks(loop):
                    task.cancel()
                loop.call_soon(loop.stop)
            loop.call_soon_threadsafe(stop)


def describe(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The tools' schemas (what a chat template's ``tools=`` takes)."""
    return [t.schema for t in tools]

