"""The agent rollout op's body (``ActorWorker.agent_rollout`` calls `agent_parts`).

One call per rank holds its share of the step's prompts; every trajectory runs in
`rlgraph.ops.agents.loop`, and each group is yielded as a part the moment its last trajectory
ends, with the generate op's columns plus ``turn_ids`` and ``env_rewards``. Padding rows get
the generate op's minimal row (one EOS, mask 0).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch

from rlgraph.ops.agents.env import Environment, ToolEnvironment, call_maybe_async
from rlgraph.ops.agents.formats import ToolFormat, load_format
from rlgraph.ops.agents.loop import AgentLimits, Sampler, Trajectory, run_trajectories, summary
from rlgraph.ops.agents.tools import ToolBox, load_tools
from rlgraph.ops.refs import RefError, import_ref
from rlgraph.ops.rollout.parts import groups_of, response_columns

__all__ = ["AgentKit", "agent_parts", "load_kit"]


@dataclass
class AgentKit:
    """What a worker loads once per (env, tools, format): the env factory, the tool box, the format."""

    make_env: Any
    toolbox: ToolBox
    fmt: ToolFormat

    def env(self) -> Environment:
        return ToolEnvironment(self.fmt, self.toolbox) if self.make_env is None else self.make_env()


def load_kit(env: str, tools: str, tool_format: str, tool_concurrency: int = 8, tool_timeout_s: float = 10.0) -> AgentKit:
    """Resolve the op's references (what `rlgraph validate` checks too); `RefError` names a bad one."""
    fmt = load_format(tool_format)
    toolset = load_tools(tools) if tools else []
    make_env = None
    if env:
        make_env = import_ref(env, "rollout.env")
        if not callable(make_env):
            raise RefError(f"rollout.env {env!r} is a {type(make_env).__name__}; name an Environment class")
        if isinstance(make_env, type) and not issubclass(make_env, Environment):
            raise RefError(f"rollout.env {env!r} is not an Environment subclass (rlgraph.ops.agents.Environment)")
    elif not toolset:
        raise RefError("the agent op has neither rollout.env nor rollout.tools: give an Environment class or the "
                       "tools the model may call")
    return AgentKit(make_env, ToolBox(toolset, tool_concurrency, tool_timeout_s), fmt)


def _row(k: int, data: Mapping[str, Sequence[Any] | None], prompt_text: str) -> dict[str, Any]:
    row = {name: (values[k] if values is not None else None) for name, values in data.items()}
    row["prompt"] = prompt_text
    return row


def agent_parts(sampler: Sampler, tokenizer: Any, kit: AgentKit, prompts: Sequence[torch.Tensor],
                is_padding: Sequence[bool], data: Mapping[str, Sequence[Any] | None], *, n: int, seed: int,
                limits: AgentLimits, metrics: dict[str, float],
                record: Any = None) -> Iterator[tuple[list[int], dict[str, Any]]]:
    """Parts ``(positions, columns)``: the padding rows first, then each group as it finishes.
    Fills `metrics` with the call's agent metrics when it ends; `record` (``ctx.event``) gets the
    first trajectories' turns and steps for the timeline."""
    eos = tokenizer.eos_token_id
    padding, groups = groups_of(is_padding, n)
    if padding:
        yield padding, _columns([Trajectory(i, prompts[i].tolist(), None, [eos], [0], [0.0], [0]) for i in padding],
                                prompts, is_padding)
    t0 = time.time()
    trajs: dict[int, Trajectory] = {}
    for g in groups:
        text = tokenizer.decode(prompts[g[0]].tolist(), skip_special_tokens=True)
        for i in g:
            env = kit.env()
            first = call_maybe_async(env.reset, _row(i, data, text))
            t = trajs[i] = Trajectory(i, prompts[i].tolist(), env)
            if first:  # the environment's opening text follows the prompt, as an observation
                t.add(list(tokenizer.encode(str(first), add_special_tokens=False))[:limits.max_obs_tokens], False)
    order = [trajs[i] for g in groups for i in g]
    index = {t.pos: k for k, t in enumerate(order)}
    kit.toolbox.take_counts()
    for done in run_trajectories(order, [[index[i] for i in g] for g in groups], sampler, tokenizer, limits,
                                 kit.fmt.stop, seed, record=record):
        finished = [order[k] for k in done]
        for t in finished:
            if t.env is not None:
                t.env.close()
        yield [t.pos for t in finished], _columns(finished, prompts, is_padding)
    counts = kit.toolbox.take_counts()
    metrics.update(summary(order, [True] * len(order)))
    metrics.update(tool_calls=float(counts.calls), tool_errors=float(counts.errors),
                   tool_timeouts=float(counts.timeouts), tool_abandoned=float(counts.abandoned),
                   tool_s=counts.seconds, rollout_s=time.time() - t0)


def _columns(trajs: Sequence[Trajectory], prompts: Sequence[torch.Tensor], is_padding: Sequence[bool]) -> dict[str, Any]:
    pos = [t.pos for t in trajs]
    cols = response_columns([prompts[i] for i in pos], [torch.tensor(t.response, dtype=torch.long) for t in trajs],
                            [is_padding[i] for i in pos], [torch.tensor(t.log_probs) for t in trajs])
    # response_columns' mask is 1 on every token of a real row; the agent's is 1 on model tokens only
    cols["response_mask"] = [torch.tensor(t.mask, dtype=torch.long) for t in trajs]
    cols["turn_ids"] = [torch.tensor(t.turn_ids, dtype=torch.long) for t in trajs]
    cols["env_rewards"] = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    return cols
