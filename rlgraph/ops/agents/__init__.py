"""Multi-turn agent rollouts: environments, tools, tool-call formats and the token-exact loop.

- `Environment` (env.py): ``reset(row) -> str``, ``step(action) -> (observation, reward, done, info)``,
  sync or async; `ToolEnvironment` is tool use.
- `tool`, `Tool`, `ToolBox` (tools.py): Python functions with an OpenAI-style schema, run with a
  concurrency limit and a time limit, their failures turned into observations.
- `Hermes`, `Inline`, `ToolFormat` (formats.py): how the model's text calls tools.
- the loop (loop.py) and the op's body (rollout.py); the op is `rlgraph.ops.stages.agent_rollout`.
- `run_python` (sandbox.py): code run in a separate, limited process (the code tool, code rewards).

docs/agents.md explains them for users.
"""

from rlgraph.ops.agents.env import Environment, StepResult, ToolEnvironment
from rlgraph.ops.agents.formats import Hermes, Inline, ToolCall, ToolFormat
from rlgraph.ops.agents.tools import Tool, ToolBox, ToolResult, tool

__all__ = ["Environment", "Hermes", "Inline", "StepResult", "Tool", "ToolBox", "ToolCall", "ToolEnvironment",
           "ToolFormat", "ToolResult", "tool"]
