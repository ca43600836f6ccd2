"""The agent loop: every trajectory of a call, turn by turn, token-exact, finished groups first.

A trajectory starts from its prompt's token ids. Each turn:

1. the model continues the trajectory's ids (all unfinished trajectories of the call together:
   one batched generate on transformers), stopping at EOS, at a stop string of the tool format
   (e.g. ``</tool_call>``), or at the turn's token limit;
2. those sampled ids are appended as they are, ``response_mask`` 1, with their log-probs;
3. the environment's ``step`` gets the turn's text (decoded for reading only) and answers; the
   observation is tokenised on its own (`observation_ids`) and appended, ``response_mask`` 0,
   log-prob 0;
4. the trajectory ends when the environment says ``done`` (for tool use: a turn without a
   call, the answer), at ``max_turns``, or when the response budget is spent (``truncated``).
   A turn ending in EOS is a chat model's end of turn, not the end of the trajectory.

The history is never decoded and re-tokenised: the next turn's input is the ids so far. Every
response token also gets its turn's index (``turn_ids``), so turn boundaries are exact. The
environment steps of a turn run concurrently on threads, each with a time limit; a step that
raises or overruns ends its trajectory and is counted, never stopping the others.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import torch

from rlgraph.ops.agents.env import Environment, as_step_result, call_maybe_async
from rlgraph.seeds import stable_seed

__all__ = ["AgentLimits", "HFSampler", "Sampler", "Trajectory", "chat_observations", "observation_ids", "run_trajectories", "summary"]


@dataclass(frozen=True)
class AgentLimits:
    max_turns: int = 4
    max_response_tokens: int = 256
    """model and observation tokens of a trajectory together"""
    max_turn_tokens: int = 64
    """new tokens per model turn"""
    max_obs_tokens: int = 64
    """tokens of one observation (a longer one is cut)"""
    env_timeout_s: float = 60.0


@dataclass
class Trajectory:
    """One sample's state; the response lists grow turn by turn."""

    pos: int
    prompt: list[int]
    env: Environment | None
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)
    turns: int = 0
    reward: float = 0.0
    done: bool = False
    truncated: bool = False
    env_error: str = ""
    tool_calls: int = 0

    def add(self, ids: Sequence[int], model: bool, log_probs: Sequence[float] | None = None) -> None:
        self.response += list(ids)
        self.mask += [1 if model else 0] * len(ids)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(ids)
        self.turn_ids += [self.turns] * len(ids)


class Sampler(Protocol):
    """Continues each history by at most `max_new` tokens, ending at `eos` or a `stop` string:
    returns per history the new ids (the stop token included) and their log-probs."""

    def __call__(self, histories: Sequence[Sequence[int]], max_new: int, stop: Sequence[str],
                 seed: int) -> list[tuple[list[int], list[float]]]: ...


def _stop_cut(tokenizer: Any, ids: list[int], stop: Sequence[str], eos: set[int]) -> int:
    """Length of `ids` up to and including the first EOS or the token that completes a stop string."""
    end = len(ids)
    for k, t in enumerate(ids):
        if t in eos:
            end = k + 1
            break
    if stop:
        text = tokenizer.decode(ids[:end])
        if any(s in text for s in stop):  # the shortest prefix whose text holds a stop string
            lo, hi = 1, end
            while lo < hi:
                mid = (lo + hi) // 2
                if any(s in tokenizer.decode(ids[:mid]) for s in stop):
                    hi = mid
                else:
                    lo = mid + 1
            end = lo
    return end


class _StopOnText:
    """A transformers stopping criterion: a row is done once its new text holds a stop string."""

    def __init__(self, tokenizer: Any, stop: Sequence[str], start: int) -> None:
        self.tokenizer, self.stop, self.start = tokenizer, list(stop), start
        self.window = 4 * max((len(s) for s in stop), default=1) + 8

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        new = input_ids[:, self.start:]
        tail = new[:, -self.window:].tolist()
        return torch.tensor([any(s in self.tokenizer.decode(row) for s in self.stop) for row in tail],
                            dtype=torch.bool, device=input_ids.device)


class HFSampler:
    """Turns on a transformers model: the histories left-padded into one batch."""

    def __init__(self, model: Any, tokenizer: Any, *, temperature: float, top_p: float, top_k: int,
                 logprobs: bool = True) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.temperature, self.top_p, self.top_k, self.logprobs = temperature, top_p, top_k, logprobs
        self.eos = {tokenizer.eos_token_id}

    @torch.no_grad()
    def __call__(self, histories: Sequence[Sequence[int]], max_new: int, stop: Sequence[str],
                 seed: int) -> list[tuple[list[int], list[float]]]:
        from transformers import StoppingCriteriaList

        pad = self.tokenizer.pad_token_id
        width = max(len(h) for h in histories)
        ids = torch.full((len(histories), width), pad, dtype=torch.long)
        mask = torch.zeros((len(histories), width), dtype=torch.long)
        for j, h in enumerate(histories):
            ids[j, width - len(h):] = torch.tensor(list(h), dtype=torch.long)
            mask[j, width - len(h):] = 1
        torch.manual_seed(seed)
        sample = self.temperature > 0
        out = self.model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=sample,
            temperature=self.temperature if sample else None, top_p=self.top_p if sample else None,
            top_k=(self.top_k or None) if sample else None, pad_token_id=pad, eos_token_id=sorted(self.eos),
            stopping_criteria=StoppingCriteriaList([_StopOnText(self.tokenizer, stop, width)]) if stop else None,
            return_dict_in_generate=True, output_scores=self.logprobs)
        new = out.sequences[:, width:]
        results = []
        for j in range(len(histories)):
            row = new[j].tolist()
            n = _stop_cut(self.tokenizer, row, stop, self.eos)
            lps = [0.0] * n
            if self.logprobs and n:
                scores = torch.stack([s[j] for s in out.scores[:n]]).float()
                lps = torch.log_softmax(scores, dim=-1).gather(-1, new[j, :n, None]).squeeze(-1).tolist()
            results.append((row[:n], lps))
        return results


def chat_observations(tokenizer: Any) -> bool:
    """Whether observations go through the tokenizer's chat template: it has one, and that template
    renders a lone ``tool`` message into known tokens (a character tokenizer's does not)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    try:
        ids = tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], add_generation_prompt=True,
                                            tokenize=True)
        tokenizer.apply_chat_template([{}], add_generation_prompt=False, tokenize=True)
    except Exception:  # a template that cannot render a lone tool message or an empty one
        return False
    ids = ids["input_ids"] if isinstance(ids, Mapping) else ids
    return tokenizer.unk_token_id is None or tokenizer.unk_token_id not in list(ids)


def observation_ids(tokenizer: Any, text: str, chat: bool = False) -> list[int]:
    """An observation's token ids, tokenised on its own. With `chat` (`chat_observations`): the
    template of one ``tool`` message with the generation prompt after it, less the template's own
    prefix (as verl's tool agent does); else the text's plain encoding."""
    if not text:
        return []
    if chat:
        prefix = tokenizer.apply_chat_template([{}], add_generation_prompt=False, tokenize=True)
        full = tokenizer.apply_chat_template([{"role": "tool", "content": text}], add_generation_prompt=True,
                                             tokenize=True)
        prefix = list(prefix["input_ids"] if isinstance(prefix, Mapping) else prefix)
        full = list(full["input_ids"] if isinstance(full, Mapping) else full)
        return full[len(prefix):] if full[:len(prefix)] == prefix else full
    return list(tokenizer.encode(text, add_special_tokens=False))


def _step_all(trajs: list[Trajectory], actions: list[str], timeout_s: float) -> list[Any]:
    """Each trajectory's env step on a thread of its own; an error or a timeout is returned as an
    exception in its place."""
    out: list[Any] = [None] * len(trajs)
    events = []
    for k, (t, action) in enumerate(zip(trajs, actions)):
        done = threading.Event()

        def target(k: int = k, env: Environment = t.env, action: str = action, done: threading.Event = done) -> None:
            try:
                out[k] = as_step_result(call_maybe_async(env.step, action))
            except BaseException as e:  # the environment's failure ends its trajectory, not the run
                out[k] = e
            finally:
                done.set()
        threading.Thread(target=target, name="rlgraph_env_step", daemon=True).start()
        events.append(done)
    for k, done in enumerate(events):
        if not done.wait(timeout_s or None) and out[k] is None:
            out[k] = TimeoutError(f"the environment's step took longer than agent.env_timeout_s={timeout_s:g}s")
    return out


def run_trajectories(trajs: list[Trajectory], groups: list[list[int]], sampler: Sampler, tokenizer: Any,
                     limits: AgentLimits, stop: Sequence[str], seed: int,
                     observe: Callable[[str], list[int]] | None = None) -> Iterator[list[int]]:
    """Run every trajectory to its end; yield each group (positions into `trajs`) once all its
    trajectories have ended."""
    chat = observe is None and chat_observations(tokenizer)
    observe = observe or (lambda text: observation_ids(tokenizer, text, chat))
    open_groups = [list(g) for g in groups]
    turn = 0
    while True:
        finished = [g for g in open_groups if all(trajs[i].done for i in g)]
        for g in finished:
            open_groups.remove(g)
            yield g
        active = [t for t in trajs if not t.done]
        if not active:
            return
        budget = [min(limits.max_turn_tokens, limits.max_response_tokens - len(t.response)) for t in active]
        outs = sampler([t.prompt + t.response for t in active], max(budget), stop, stable_seed(seed, turn))
        stepping, actions = [], []
        for t, b, (ids, lps) in zip(active, budget, outs):
            cut = ids[:b]
            t.add(cut, True, lps[:b])
            if t.env is None:
                t.done = True
                continue
            # a turn may end with EOS (a chat model's end of turn): the environment decides whether the
            # trajectory goes on, and reads the turn even when the budget is spent
            stepping.append(t)
            actions.append(tokenizer.decode(cut, skip_special_tokens=True))
            if len(t.response) >= limits.max_response_tokens:
                t.done = t.truncated = True
        for t, result in zip(stepping, _step_all(stepping, actions, limits.env_timeout_s)):
            if isinstance(result, BaseException):
                t.env_error = f"{type(result).__name__}: {result}"
                t.done = True
                continue
            t.reward += result.reward
            t.tool_calls += result.tool_calls
            if result.done:
                t.done = True
            if t.done:
                continue
            # a chat template wraps tool results itself; without one the format's text carries them
            text = "\n".join(result.tool_results) if chat and result.tool_results else result.observation
            obs = observe(text)[:limits.max_obs_tokens]
            room = limits.max_response_tokens - len(t.response)
            if len(obs) >= room:
                obs, t.truncated, t.done = obs[:room], True, True
            t.add(obs, False)
        for t in active:
            t.turns += 1
            if not t.done and t.turns >= limits.max_turns:
                t.done = True
        turn += 1


def summary(trajs: Sequence[Trajectory], real: Sequence[bool]) -> Mapping[str, float]:
    """The agent metrics of a call's real trajectories."""
    ts = [t for t, r in zip(trajs, real) if r]
    if not ts:
        return {}
    n = len(ts)
    model = [sum(t.mask) for t in ts]
    return {
        "turns_mean": sum(t.turns for t in ts) / n,
        "turns_max": float(max(t.turns for t in ts)),
        "tool_calls_per_trajectory": sum(t.tool_calls for t in ts) / n,
        "truncated_frac": sum(t.truncated for t in ts) / n,
        "env_errors": float(sum(bool(t.env_error) for t in ts)),
        "model_tokens_mean": sum(model) / n,
        "observation_tokens_mean": sum(len(t.mask) - m for t, m in zip(ts, model)) / n,
        "env_reward_mean": sum(t.reward for t in ts) / n,
    }

