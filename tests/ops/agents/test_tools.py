"""Tools and tool-call formats: schemas from signatures, calls parsed from text, and every way a
tool call can fail turned into an observation the model reads, never an exception."""

import asyncio
import time

import pytest

from rlgraph.ops.agents import Hermes, Inline, ToolBox, ToolCall, tool
from rlgraph.ops.agents.formats import load_format
from rlgraph.ops.agents.rollout import load_kit
from rlgraph.ops.agents.tools import load_tools, schema_of
from rlgraph.ops.refs import RefError


def lookup(city: str, days: int = 1, metric: bool = True) -> dict:
    """Weather for a city.

    More text that is not the description."""
    return {"city": city, "days": days}


def test_the_schema_comes_from_the_signature_and_docstring():
    s = schema_of(lookup)
    assert s == {"type": "function", "function": {
        "name": "lookup", "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                        "metric": {"type": "boolean"}},
                       "required": ["city"]}}}


def test_hermes_finds_every_call_and_names_a_broken_one():
    text = ('think <tool_call>{"name": "lookup", "arguments": {"city": "Oslo"}}</tool_call> and '
            '<tool_call>{"name": "lookup", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>'
            '<tool_call>not json</tool_call><tool_call>[1]</tool_call>')
    calls = Hermes().parse(text)
    assert [c.name for c in calls[:2]] == ["lookup", "lookup"]
    assert calls[0].arguments == {"city": "Oslo"} and calls[1].arguments == {"city": "Rome"}
    assert "not JSON" in calls[2].error and "name" in calls[3].error
    assert Hermes().parse("the answer is 7") == []
    assert Hermes().render(["a", "b"]) == "<tool_response>\na\n</tool_response><tool_response>\nb\n</tool_response>"


def test_inline_takes_the_first_call_and_other_delimiters_by_subclassing():
    assert Inline().parse("x [calc 1+2] [calc 3]") == [ToolCall("calc", {"": "1+2"})]

    class Parens(Inline):
        open, close, result = "(", ")", "->"

    p = Parens()
    assert p.parse("(calc 4*5)") == [ToolCall("calc", {"": "4*5"})] and p.stop == (")",)
    assert p.render(["20"]) == "->20)"


def test_formats_load_by_name_or_reference():
    assert isinstance(load_format("hermes"), Hermes)
    with pytest.raises(RefError, match="not of the form"):
        load_format("nonsense")
    with pytest.raises(RefError, match="not a ToolFormat"):
        load_format("tests.ops.agents.test_tools:lookup")


def _box(**kw):
    @tool(timeout_s=0.3)
    def hang(x: str) -> str:
        time.sleep(10)
        return x

    def boom(x: str) -> str:
        raise ValueError("bad input " + x)

    def garbage(x: str):
        class Unprintable:
            def __repr__(self):
                raise RuntimeError("no repr")
        return Unprintable()

    async def later(x: str) -> str:
        await asyncio.sleep(0.01)
        return x.upper()

    async def never(x: str) -> str:
        await asyncio.sleep(10)
        return x

    return ToolBox([hang, tool(boom), tool(garbage), tool(later), tool(never), tool(lookup)], timeout_s=0.3, **kw)


@pytest.mark.parametrize("call, text, counts", [
    (ToolCall("lookup", {"city": "Oslo"}), '{"city": "Oslo", "days": 1}', (0, 0)),
    (ToolCall("later", {"x": "hi"}), "HI", (0, 0)),
    (ToolCall("boom", {"x": "7"}), "error: ValueError: bad input 7", (1, 0)),
    (ToolCall("hang", {"x": "1"}), "error: tool 'hang' timed out after 0.3s", (1, 1)),
    (ToolCall("never", {"x": "1"}), "error: tool 'never' timed out after 0.3s", (1, 1)),
    (ToolCall("garbage", {"x": "1"}), "error: tool 'garbage' returned an unprintable", (1, 0)),
    (ToolCall("nope", {}), "error: there is no tool 'nope'", (1, 0)),
    (ToolCall("lookup", {"town": "Oslo"}), "error: tool 'lookup' takes ['city', 'days', 'metric']; unknown ['town']; "
                                           "missing ['city']", (1, 0)),
    (ToolCall("", error="the tool call is not JSON"), "error: the tool call is not JSON", (1, 0)),
])
def test_every_failure_is_an_observation_and_counted(call, text, counts):
    box = _box()
    t0 = time.monotonic()
    result = box.run(call)
    assert time.monotonic() - t0 < 3
    assert result.text.startswith(text), result.text
    assert (box.counts.errors, box.counts.timeouts) == counts and box.counts.calls == 1
    box.close()


def test_load_tools_and_the_kit_name_what_is_wrong():
    tools = load_tools("tests.ops.agents.test_tools:lookup, tests.ops.agents.test_loop:calc")
    assert [t.name for t in tools] == ["lookup", "calc"]
    with pytest.raises(RefError, match="more than once"):
        load_tools("tests.ops.agents.test_tools:lookup,tests.ops.agents.test_tools:lookup")
    with pytest.raises(RefError, match="has no attribute 'nope'"):
        load_tools("tests.ops.agents.test_tools:nope")
    with pytest.raises(RefError, match="neither rollout.env nor rollout.tools"):
        load_kit("", "", "hermes")
    with pytest.raises(RefError, match="not an Environment subclass"):
        load_kit("tests.ops.agents.test_tools:ToolCall", "", "hermes")
