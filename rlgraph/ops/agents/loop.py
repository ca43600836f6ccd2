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
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import torch

from rlgraph.ops.agents.env import Environment, as_step_result, call_maybe_async
from rlgraph.ops.rollout.parts import _cut
from rlgraph.seeds import stable_seed

__all__ = ["AgentLimits", "HFSampler", "Sampler", "Trajectory", "VLLMSampler", "chat_observations", "observation_ids", "run_trajectories", "summary"]


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
    """Continues each history by at most `max_new` tokens, ending at EOS or a `stop` string, each
    history sampled from its own seed (so what a trajectory draws does not depend on which others
    share its batch): returns per history the new ids (the stop token included) and their log-probs."""

    def __call__(self, histories: Sequence[Sequence[int]], max_new: int, stop: Sequence[str],
                 seeds: Sequence[int]) -> list[tuple[list[int], list[float]]]: ...


def _stop_cut(tokenizer: Any, ids: list[int], stop: Sequence[str], eos: set[int]) -> int:
    """Length of `ids` up to and including the first EOS or the token that completes a stop string."""
    end = _cut(ids, eos)
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


def _filter(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' own top-k then top-p warpers on `[B, V]` scores (removed entries at -inf), as
    its ``generate`` applies them."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores


class HFSampler:
    """Turns on a transformers model: the histories left-padded into one batch, decoded with the
    KV cache, each row sampled by the Gumbel-max trick from noise of its own seed (the same draw
    whatever batch it is in, up to the float rounding of batched matmuls). Log-probs are those of
    the processed distribution (temperature, top-k, top-p), as `hf_parts` reports them."""

    def __init__(self, model: Any, tokenizer: Any, *, temperature: float, top_p: float, top_k: int,
                 logprobs: bool = True) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.temperature, self.top_p, self.top_k, self.logprobs = temperature, top_p, top_k, logprobs
        self.eos = tokenizer.eos_token_id

    def _stopped(self, rows: list[list[int]], stop: Sequence[str]) -> list[bool]:
        window = 4 * max(len(x) for x in stop) + 8
        return [any(x in self.tokenizer.decode(r[-window:]) for x in stop) for r in rows]

    @torch.no_grad()
    def __call__(self, histories: Sequence[Sequence[int]], max_new: int, stop: Sequence[str],
                 seeds: Sequence[int]) -> list[tuple[list[int], list[float]]]:
        pad = self.tokenizer.pad_token_id
        B, width = len(histories), max(len(h) for h in histories)
        ids = torch.full((B, width), pad, dtype=torch.long)
        mask = torch.zeros((B, width), dtype=torch.long)
        for j, h in enumerate(histories):
            ids[j, width - len(h):] = torch.tensor(list(h), dtype=torch.long)
            mask[j, width - len(h):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        dev = next(self.model.parameters()).device  # the worker's GPU when it has one; sampling stays on CPU
        out = self.model(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=positions.to(dev),
                         use_cache=True)
        logits, past = out.logits[:, -1, :].cpu(), out.past_key_values
        vocab = logits.shape[-1]
        sample = self.temperature > 0
        if sample:  # each row's noise for the whole turn, from its own seed
            gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
            u = torch.stack([torch.rand((max_new, vocab), generator=g) for g in gens])
            gumbel = -torch.log(-torch.log(u.clamp_min(1e-20)))
        new: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        done = torch.zeros(B, dtype=torch.bool)
        pos = positions[:, -1:]
        for step in range(max_new):
            scores = logits.float()
            if sample:
                scores = _filter(scores / self.temperature, self.top_k, self.top_p)
            logp = torch.log_softmax(scores, dim=-1)
            tok = torch.argmax(logp + gumbel[:, step] if sample else logp, dim=-1)
            tok_lp = logp.gather(-1, tok[:, None]).squeeze(-1)
            for j in torch.nonzero(~done).flatten().tolist():
                new[j].append(int(tok[j]))
                lps[j].append(float(tok_lp[j]))
            done |= tok == self.eos
            if stop:
                open_rows = torch.nonzero(~done).flatten().tolist()
                for j, hit in zip(open_rows, self._stopped([new[j] for j in open_rows], stop)):
                    done[j] = done[j] or hit
            if bool(done.all()) or step == max_new - 1:
                break
            mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.long)], dim=1)
            pos = pos + 1
            out = self.model(input_ids=tok.masked_fill(done, pad)[:, None].to(dev), attention_mask=mask.to(dev),
                             position_ids=pos.to(dev), past_key_values=past, use_cache=True)
            logits, past = out.logits[:, -1, :].cpu(), out.past_key_values
        eos = {self.eos}
        results = []
        for j in range(B):
            n = _stop_cut(self.tokenizer, new[j], stop, eos)
            results.append((new[j][:n], lps[j][:n] if self.logprobs else [0.0] * n))
        return results


class VLLMSampler:
    """Turns on a vLLM engine (`rlgraph.ops.rollout.vllm_engine.VLLMEngine`): every history goes in
    as token ids, one request each with its own seed, so the engine batches them continuously and
    its prefix cache reuses what earlier turns computed."""

    def __init__(self, engine: Any, tokenizer: Any, *, temperature: float, top_p: float, top_k: int,
                 logprobs: bool = True) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.temperature, self.top_p, self.top_k, self.logprobs = temperature, top_p, top_k, logprobs
        self.eos = {tokenizer.eos_token_id}

    def __call__(self, histories: Sequence[Sequence[int]], max_new: int, stop: Sequence[str],
                 seeds: Sequence[int]) -> list[tuple[list[int], list[float]]]:
        out: list[tuple[list[int], list[float]]] = [([], [])] * len(histories)
        for done in self.engine.generate([list(h) for h in histories], n=1, temperature=self.temperature,
                                         top_p=self.top_p, top_k=self.top_k, max_tokens=max_new,
                                         stop_token_ids=[], seeds=list(seeds), logprobs=self.logprobs, stop=stop):
            ids = list(done.tokens[0])
            lps = list(done.logprobs[0]) if done.logprobs else [0.0] * len(ids)
            n = _stop_cut(self.tokenizer, ids, stop, self.eos)
            out[done.index] = (ids[:n], lps[:n])
        return out


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


class _Steps:
    """Environment steps on threads of their own: `start` returns at once, `collect` waits for
    finished (or timed-out) ones. A step that overran its limit is abandoned: its thread runs on,
    its trajectory ends with a `TimeoutError`."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.cv = threading.Condition()
        self.running: dict[int, tuple[Trajectory, float]] = {}
        self.finished: list[tuple[Trajectory, Any, float, float]] = []

    def start(self, t: Trajectory, action: str) -> None:
        start = time.time()
        self.running[id(t)] = (t, start)

        def target() -> None:
            try:
                result: Any = as_step_result(call_maybe_async(t.env.step, action))
            except BaseException as e:  # the environment's failure ends its trajectory, not the run
                result = e
            with self.cv:
                if self.running.pop(id(t), None) is not None:  # not given up on
                    self.finished.append((t, result, start, time.time()))
                    self.cv.notify_all()
        threading.Thread(target=target, name="rlgraph_env_step", daemon=True).start()

    def _expire(self) -> float | None:
        """Give up on overrun steps; seconds until the next deadline (None: no limit or none running)."""
        if not self.timeout_s or not self.running:
            return None
        now = time.time()
        for key, (t, start) in list(self.running.items()):
            if now - start >= self.timeout_s:
                del self.running[key]
                self.finished.append((t, TimeoutError(f"the environment's step took longer than "
                                                      f"rollout.env_timeout_s={self.timeout_s:g}s"), start, now))
        return min((start + self.timeout_s - now for _, start in self.running.values()), default=None)

    def collect(self, gather_s: float) -> list[tuple[Trajectory, Any, float, float]]:
        """Wait until a step has ended, then up to `gather_s` more while others are still running
        (so that fast steps' trajectories take their next turn together)."""
        with self.cv:
            while not self.finished and self.running:
                wait = self._expire()
                if not self.finished:
                    self.cv.wait(wait)
            until = time.time() + gather_s
            while self.running and time.time() < until:
                self.cv.wait(max(0.0, min(until - time.time(), self._expire() or gather_s)))
            self._expire()
            out, self.finished = self.finished, []
        return out


TRACE_LANES = 16  # trajectories of a call whose turns go to the timeline (`record`)
GATHER_S = 0.02  # after an environment step ends, how long the loop waits for others to batch their next turn


def run_trajectories(trajs: list[Trajectory], groups: list[list[int]], sampler: Sampler, tokenizer: Any,
                     limits: AgentLimits, stop: Sequence[str], seed: int,
                     observe: Callable[[str], list[int]] | None = None,
                     record: Callable[[float, float, int, str], None] | None = None) -> Iterator[list[int]]:
    """Run every trajectory to its end; yield each group (positions into `trajs`) once all its
    trajectories have ended. A trajectory takes its next turn as soon as its environment step is
    done (with the others done by then, `GATHER_S`): one waiting on a slow tool holds no one else.
    Its tokens depend only on its history and its seed (the call's seed, its position, the turn),
    never on which others shared a batch. `record(start, end, lane, label)` gets the model turns and
    the tool or environment steps of the first `TRACE_LANES` trajectories (lane: its ``pos``)."""
    traced = {id(t) for t in trajs[:TRACE_LANES]} if record is not None else set()
    chat = observe is None and chat_observations(tokenizer)
    observe = observe or (lambda text: observation_ids(tokenizer, text, chat))
    open_groups = [list(g) for g in groups]
    steps = _Steps(limits.env_timeout_s)
    ready = [t for t in trajs if not t.done]
    while True:
        finished = [g for g in open_groups if all(trajs[i].done for i in g)]
        for g in finished:
            open_groups.remove(g)
            yield g
        if not ready and not steps.running and not steps.finished:
            return
        if ready:
            batch, ready = sorted(ready, key=lambda t: t.pos), []
            budget = [min(limits.max_turn_tokens, limits.max_response_tokens - len(t.response)) for t in batch]
            t_turn = time.time()
            outs = sampler([t.prompt + t.response for t in batch], max(budget), stop,
                           [stable_seed(seed, t.pos, t.turns) for t in batch])
            t_done = time.time()
            for t, b, (ids, lps) in zip(batch, budget, outs):
                if id(t) in traced:
                    record(t_turn, t_done, t.pos, f"turn {t.turns}")
                cut = ids[:b]
                t.add(cut, True, lps[:b])
                if t.env is None:
                    t.done = True
                    t.turns += 1
                    continue
                # a turn may end with EOS (a chat model's end of turn): the environment decides whether the
                # trajectory goes on, and reads the turn even when the budget is spent
                if len(t.response) >= limits.max_response_tokens:
                    t.done = t.truncated = True
                steps.start(t, tokenizer.decode(cut, skip_special_tokens=True))
        for t, result, t0, t1 in steps.collect(GATHER_S):
            if id(t) in traced:
                record(t0, t1, t.pos, "tool call" if getattr(result, "tool_calls", 0) else "env step")
            if isinstance(result, BaseException):
                t.env_error = f"{type(result).__name__}: {result}"
                t.done = True
                t.turns += 1
                continue
            t.reward += result.reward
            t.tool_calls += result.tool_calls
            if result.done:
                t.done = True
            if not t.done:  # the observation shares the turn id of the model turn it answers
                # a chat template wraps tool results itself; without one the format's text carries them
                text = "\n".join(result.tool_results) if chat and result.tool_results else result.observation
                obs = observe(text)[:limits.max_obs_tokens]
                room = limits.max_response_tokens - len(t.response)
                if len(obs) >= room:
                    obs, t.truncated, t.done = obs[:room], True, True
                t.add(obs, False)
            t.turns += 1
            if not t.done and t.turns >= limits.max_turns:
                t.done = True
            if not t.done:
                ready.append(t)


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

