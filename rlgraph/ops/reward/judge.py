"""A judge model as the reward (``stages.reward_model(kind="generative")``): ask a served model to grade
each response with a prompt template, and parse a score from its answer.

The judge is a vLLM engine per rank of the op's worker group (``judge.backend=vllm``: its own pool,
or colocated with another group) or an OpenAI-compatible chat-completions endpoint
(``judge.backend=openai``, ``judge.url``; the key is read from the environment variable
``judge.api_key_env``, never from the config). For each real sample the template's ``{prompt}``,
``{response}`` and ``{ground_truth}`` are filled with the sample's text (decoded with the policy's
tokenizer, as the rule reward decodes), the judge answers (greedy by default), and the first match
of ``judge.score_pattern`` is the score, divided by ``judge.score_scale``, placed on the response's
last token.

Nothing stalls a step: every request has a deadline (``judge.timeout_s``), a failed request is
retried with back-off (``judge.retries``; time-outs, connection errors, 429 and 5xx), and a sample
whose judgement timed out, failed or could not be parsed is handled by ``judge.on_error``: fail the
step naming the answer, score it 0, or drop its group. Every case is counted in the op's metrics
(``judged_count``, ``unparsable_count``, ``timeout_count``, ``error_count``, ``retries``).
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rlgraph.errors import OpError
from rlgraph.ops.models import tokenizer_at
from rlgraph.ops.settings import ActorSettings, DataSettings, JudgeSettings

__all__ = ["JudgeWorker", "JudgeError", "Verdict", "parse_score", "ask_openai"]


class JudgeError(OpError):
    """The judge could not grade samples and ``judge.on_error=fail``."""


@dataclass
class Verdict:
    """One sample's judgement."""

    answer: str = ""
    score: float | None = None  # None: no score (see `problem`)
    problem: str = ""  # "", "timeout", "error: ...", "unparsable"
    retries: int = 0


def parse_score(answer: str, pattern: str, scale: float) -> float | None:
    """The first match's first group of `pattern` in `answer`, divided by `scale`; None if there is none."""
    m = re.search(pattern, answer)
    if m is None:
        return None
    try:
        return float(m.group(1)) / scale
    except (IndexError, ValueError):
        return None


def ask_openai(url: str, model: str, prompt: str, *, max_tokens: int, temperature: float, timeout_s: float,
               retries: int, api_key: str = "") -> Verdict:
    """One chat completion from an OpenAI-compatible endpoint, retried on time-outs, connection errors, 429
    and 5xx with exponential back-off (0.25 s, 0.5 s, ...); the whole thing ends by ``timeout_s`` per attempt."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": temperature}).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    endpoint = url.rstrip("/") + "/chat/completions"
    last = Verdict(problem="error: no attempt")
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(0.25 * 2 ** (attempt - 1))
        try:
            req = urllib.request.Request(endpoint, data=body, headers=headers, method="POST")
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                data = json.loads(resp.read().decode())
            return Verdict(answer=str(data["choices"][0]["message"]["content"] or ""), retries=attempt)
        except urllib.error.HTTPError as e:
            last = Verdict(problem=f"error: HTTP {e.code} from {endpoint}", retries=attempt)
            if e.code != 429 and e.code < 500:  # the request itself is wrong: another try gives the same
                return last
        except (TimeoutError, OSError) as e:  # socket.timeout is a TimeoutError; URLError an OSError
            timed_out = isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError)
            last = Verdict(problem="timeout" if timed_out else f"error: {type(e).__name__}: {e}", retries=attempt)
        except (KeyError, IndexError, ValueError) as e:
            return Verdict(problem=f"error: malformed reply from {endpoint}: {e}", retries=attempt)
    return last


class JudgeWorker:
    def setup(self, ctx: Any) -> None:
        self.s = JudgeSettings.of(ctx)
        self.decode_with = DataSettings.value(ctx, "tokenizer") or ActorSettings.value(ctx, "model_path")
        self.tokenizer: Any = None
        self.engine: Any = None
        self.judge_tokenizer: Any = None
        self.seed = int(ctx.seed)

    def compute_judge_score(self, prompts: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor,
                            ground_truth: list, *, ctx: Any) -> dict[str, Any]:
        s = self.s
        lengths = ctx.lengths["response_len"]
        prompt_lengths = ctx.lengths.get("prompt_len") or [int((p != 0).sum()) for p in prompts]
        rows = len(lengths)
        real = [i for i in range(rows) if not ctx.is_padding[i]]
        tok = self._decoder()
        asks = [s.template.format(prompt=tok.decode(prompts[i, :prompt_lengths[i]].tolist(), skip_special_tokens=True),
                                  response=tok.decode(responses[i, :lengths[i]].tolist(), skip_special_tokens=True),
                                  ground_truth=ground_truth[i] if ground_truth is not None else "") for i in real]
        verdicts = self._vllm(asks, s, ctx.rank) if s.backend == "vllm" else self._openai(asks, s)
        for v in verdicts:
            if not v.problem:
                v.score = parse_score(v.answer, s.score_pattern, s.score_scale)
                if v.score is None:
                    v.problem = "unparsable"
        failed = [(i, v) for i, v in zip(real, verdicts) if v.problem]
        if failed and s.on_error == "fail":
            shown = "; ".join(f"row {i}: {v.problem}" + (f" (answer {v.answer[:80]!r})" if v.answer else "")
                              for i, v in failed[:3])
            raise JudgeError(f"the judge could not grade {len(failed)} of {len(real)} samples: {shown}"
                             f"{' ...' if len(failed) > 3 else ''}. Fix the template or score_pattern, or set "
                             f"judge.on_error=zero (score them 0) or judge.on_error=drop_group")
        score_col, metrics_col = ctx.outputs[0], ctx.outputs[1]
        scores = torch.zeros((rows, max(lengths, default=0)), dtype=torch.float32)
        for i, v in zip(real, verdicts):
            if v.problem:
                if s.on_error == "drop_group":
                    ctx.drop(i, "judge_" + v.problem.split(":")[0], group=True)
                continue
            if lengths[i] > 0:
                scores[i, lengths[i] - 1] = float(v.score)
        metrics = {"judged_count": float(len(real)),
                   "unparsable_count": float(sum(v.problem == "unparsable" for v in verdicts)),
                   "timeout_count": float(sum(v.problem == "timeout" for v in verdicts)),
                   "error_count": float(sum(v.problem.startswith("error") for v in verdicts)),
                   "retries": float(sum(v.retries for v in verdicts))}
        return {score_col: scores, metrics_col: metrics}

    def _decoder(self) -> Any:
        if self.tokenizer is None:
            if not self.decode_with:
                raise JudgeError("the judge has no tokenizer to decode samples with: data.tokenizer and "
                                 "actor.model_path are empty; set data.tokenizer to the policy's HF directory")
            self.tokenizer = tokenizer_at(self.decode_with)
        return self.tokenizer

    def _openai(self, asks: Sequence[str], s: JudgeSettings) -> list[Verdict]:
        key = os.environ.get(s.api_key_env, "") if s.api_key_env else ""
        with ThreadPoolExecutor(max_workers=s.concurrency) as pool:
            return list(pool.map(lambda text: ask_openai(s.url, s.model, text, max_tokens=s.max_new_tokens,
                                                          temperature=s.temperature, timeout_s=s.timeout_s,
                                                          retries=s.retries, api_key=key), asks))

    def _vllm(self, asks: Sequence[str], s: JudgeSettings, rank: int) -> list[Verdict]:
        from rlgraph.ops.models import encode_prompt, load_tokenizer
        from rlgraph.ops.rollout.vllm_engine import VLLMEngine

        if self.engine is None or self.engine.ensure_running():
            if self.engine is None:
                self.engine = VLLMEngine(s.model_path, rank=rank, seed=self.seed,
                                         gpu_memory_utilization=s.gpu_memory_utilization)
                self.judge_tokenizer = load_tokenizer(s.model_path)
        jt = self.judge_tokenizer
        if getattr(jt, "chat_template", None):  # as the prompts of a run are encoded
            ids = [encode_prompt(jt, [{"role": "user", "content": a}]) for a in asks]
        else:
            ids = [jt(a, add_special_tokens=True)["input_ids"] for a in asks]
        verdicts = [Verdict(problem="timeout") for _ in asks]
        deadline = time.time() + s.timeout_s
        gen = self.engine.generate(ids, n=1, temperature=s.temperature, top_p=1.0, top_k=0,
                                   max_tokens=s.max_new_tokens, stop_token_ids=(), seeds=[self.seed + k for k in
                                                                                          range(len(ids))],
                                   logprobs=False)
        try:
            for done in gen:
                verdicts[done.index] = Verdict(answer=jt.decode(done.tokens[0], skip_special_tokens=True))
                if time.time() > deadline:  # the rest are abandoned (aborted in the engine) and count as timed out
                    break
        finally:
            gen.close()
        return verdicts

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
