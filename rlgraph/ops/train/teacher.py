"""The distillation teacher: log-probs of the student's sampled tokens under another model.

`stages.teacher_logprob()` runs `TeacherWorker.compute_teacher_log_prob` on the student's
responses as they stream out of generation, like ``ref``: on a worker group of its own (the usual
placement: the teacher is often larger than the student) or colocated with the actor. The teacher
is any Hugging Face causal LM with the student's tokenizer; the compiler refuses another tokenizer
(`rlgraph.ops.tokenizers`) and the worker checks again when it starts, for model directories that
did not exist at compile time.

Backends (``teacher.backend``): ``hf``, a transformers forward with the policy's chunked log-probs
(``actor.logprob_chunk_size``, the packed layout with ``actor.packing``) in bfloat16 on a GPU; or
``vllm``, a vLLM engine per rank that scores prompt + response as one prompt and returns its
prompt log-probs (the teacher's log-prob of every token given those before it, and with
``teacher.top_k`` the k most likely tokens at each position), started on the first call. The
result is ``teacher_log_probs`` ``[rows, R]``, 0 past each response. With ``teacher.top_k``, the
same pass also writes each position's k most likely tokens and their log-probs
(``teacher_topk_ids``, ``teacher_topk_log_probs``, ``[rows, R, k]``) for the update's dense
distillation loss (``actor.distill_coef``, `rlgraph.ops.algos.distill`).
"""

from __future__ import annotations

from typing import Any

import torch

from rlgraph.errors import ConfigError
from rlgraph.ops.algos.distill import NO_TOKEN
from rlgraph.ops.models import forward_dtype, load_causal_lm, load_tokenizer, worker_device
from rlgraph.ops.settings import ActorSettings, RolloutSettings, TeacherSettings
from rlgraph.ops.tokenizers import tokenizer_mismatch
from rlgraph.ops.train.logprobs import enable_token_logprobs, score_rows_top_k

__all__ = ["TeacherWorker", "TeacherError"]


class TeacherError(ConfigError):
    """The teacher cannot score the student's tokens (no model, another tokenizer)."""


class TeacherWorker:
    def setup(self, ctx: Any) -> None:
        teacher, actor = TeacherSettings.of(ctx), ActorSettings.of(ctx)
        if not teacher.model_path:
            raise TeacherError("teacher_logprob has no teacher: set teacher.model_path to a local Hugging Face model "
                               "directory with the student's tokenizer")
        student = actor.model_path or RolloutSettings.of(ctx).model_path
        why = tokenizer_mismatch(student, teacher.model_path) if student else None
        if why:
            raise TeacherError(f"the teacher {teacher.model_path!r} and the student {student!r} tokenize differently: "
                               f"{why}; distil from a teacher with the student's tokenizer")
        self.path, self.backend = teacher.model_path, teacher.backend
        self.temperature, self.top_k = teacher.temperature, teacher.top_k
        self.chunk, self.packing = actor.logprob_chunk_size, actor.packing
        self.gpu_memory_utilization = teacher.gpu_memory_utilization
        self.seed = int(ctx.seed)
        self.tokenizer = load_tokenizer(self.path)
        self.model: Any = None
        self.engine: Any = None
        if self.backend == "hf":
            device = worker_device()
            self.model = load_causal_lm(self.path, dtype=forward_dtype(device)).to(device).eval()
            self.model.requires_grad_(False)
            enable_token_logprobs(self.model)

    def compute_teacher_log_prob(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                 position_ids: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor, *,
                                 max_tokens_per_micro_batch: int = 0, ctx: Any) -> dict[str, Any]:
        resp = list(ctx.lengths["response_len"])
        if self.backend == "vllm":
            return _columns(*self._vllm(input_ids, attention_mask, resp, ctx.rank))
        s = score_rows_top_k(self.model, input_ids, attention_mask, resp, self.tokenizer.pad_token_id,
                             self.temperature, self.chunk, self.packing, max_tokens_per_micro_batch,
                             top_k=self.top_k)
        return _columns(s.logp, s.side_ids, s.side_logp)

    def _vllm(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, resp: list[int], rank: int
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        from rlgraph.ops.rollout.vllm_engine import VLLMEngine

        if self.engine is None or self.engine.ensure_running():
            if self.engine is None:
                self.engine = VLLMEngine(self.path, rank=rank, seed=self.seed,
                                         gpu_memory_utilization=self.gpu_memory_utilization,
                                         max_logprobs=max(20, self.top_k))
        totals = attention_mask.sum(dim=1).tolist()
        seqs = [input_ids[i, :n].tolist() for i, n in enumerate(totals)]
        R = max(resp) if resp else 0
        out = torch.zeros((len(seqs), R))
        k = min(self.top_k, self.engine.vocab_size()) if self.top_k else 0
        top_ids = torch.zeros((len(seqs), R, k), dtype=torch.long) if k else None
        top_lp = torch.zeros((len(seqs), R, k)) if k else None
        todo = [i for i, r in enumerate(resp) if r > 0]
        scored = self.engine.prompt_top_logprobs([seqs[i] for i in todo], k)
        for i, (lps, tops) in zip(todo, scored):
            p = totals[i] - resp[i]  # the response's first token is at position p; lps[k] scores token k
            out[i, :resp[i]] = torch.tensor(lps[p:p + resp[i]], dtype=torch.float32)
            if top_ids is not None and top_lp is not None:
                # fewer than asked at a position: the rest are empty slots with no probability
                rows = [tops[p + t][:k] + [(NO_TOKEN, -1e4)] * (k - len(tops[p + t][:k])) for t in range(resp[i])]
                top_ids[i, :resp[i]] = torch.tensor([[tok for tok, _ in r] for r in rows], dtype=torch.long)
                top_lp[i, :resp[i]] = torch.tensor([[lp for _, lp in r] for r in rows], dtype=torch.float32)
        return out, top_ids, top_lp

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def _columns(logp: torch.Tensor, top_ids: torch.Tensor | None, top_lp: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The op's outputs. Without a top-k (teacher.top_k=0) its columns are empty: nothing reads them then, and
    the compiler keeps them out of the data plane."""
    if top_ids is None or top_lp is None:
        top_ids, top_lp = torch.zeros((*logp.shape, 0), dtype=torch.long), torch.zeros((*logp.shape, 0))
    return {"teacher_log_probs": logp, "teacher_topk_ids": top_ids, "teacher_topk_log_probs": top_lp}
