"""The policy worker: generation, old log-probs, reference log-probs and the PPO update.

One `ActorWorker` per data-parallel rank of its group. When generate, old_logprob and
update_actor share a group (colocation, like verl's actor_rollout_ref), they share one model:
the update changes the weights generation uses, with no copy. When generation runs in a group
of its own, it loads the ``policy_weights`` state column each step (the runtime moves it
between groups through Ray).

Generation runs on transformers (``rollout.backend=hf``) or on a vLLM engine of this rank
(``vllm``, started on the first generate call). The engine holds its own copy of the weights:
before it generates, it is given the model's current weights whenever they changed (an update
here, weights from another group, a restored checkpoint), in place; ``rollout_metrics`` report
the time and bytes. On a GPU shared with the update, the engine sleeps during the update.

Log-probs are computed at the rollout temperature (``rollout.temperature``), as the sampler saw
the distribution; the model path is ``actor.model_path`` (``rollout.model_path`` for a
generation-only group, ``ref.model_path`` for the reference, defaulting to the actor's).
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Mapping

import torch

from rlgraph.errors import InvariantError, OpError
from rlgraph.graph.settings import TrainerSettings
from rlgraph.ops.algos import (agg_loss, decoupled_weights, gspo_policy_loss, kl_loss, masked_mean, policy_loss,
                               drop_unusable, rollout_probs_diff, top_k_distill_loss, truncated_is_weights,
                               usable_ids)
from rlgraph.ops.models import forward_dtype, load_causal_lm, load_tokenizer, worker_device
from rlgraph.ops.rollout.parts import VERSIONS, hf_parts, parse_token_ids, vllm_parts
from rlgraph.ops.settings import ActorSettings, RolloutSettings
from rlgraph.ops.train.engine.balance import balance_across_ranks
from rlgraph.ops.train.engine.base import load_model_state, model_state, valid_counts
from rlgraph.ops.train.logprobs import Scores, enable_token_logprobs, score_rows, scored
from rlgraph.ops.train.lora import adapters_disabled, apply_lora, has_lora, merged_weights
from rlgraph.ops.train.sequences import Packed, repack
from rlgraph.ops.train.update import TrainerMixin, kept_rows
from rlgraph.rows import Rows, trimmed_rows

__all__ = ["ActorWorker", "StalenessError"]


class StalenessError(InvariantError):
    """The update was given samples from a policy more than trainer.max_staleness versions older
    than its own: the runtime's cross-step order is broken (a bug), never silently trained on."""

_ENGINE_OPTIONS = ("dtype", "max_model_len", "gpu_memory_utilization", "cpu_kv_cache_gb", "enforce_eager",
                   "sleep_mode")


def _one_forward(ctx: Any, rows: int, tokens: int, budget: int) -> bool:
    """Whether the engine runs this rank's update as one forward over all its rows (one mini-batch
    of one epoch, one micro-batch, one rank): the engine's own split (`TrainEngine._micro_batches`)."""
    b = ctx.batching
    if b is None or ctx.dp != 1 or b.updates_per_step != 1 or rows > max(1, (b.rank_mini_batch or [rows])[0]):
        return False
    return tokens <= budget if budget else rows <= b.micro_batch_size


class ActorWorker(TrainerMixin):
    """Policy model on one rank; reference model loaded on first use; a vLLM engine on demand."""

    def setup(self, ctx: Any) -> None:
        self.ctx = ctx
        actor, rollout, trainer = ActorSettings.of(ctx), RolloutSettings.of(ctx), TrainerSettings.of(ctx)
        self.model_path = actor.model_path or rollout.model_path
        if not self.model_path:
            raise ValueError("no model: set actor.model_path (or rollout.model_path) to a local Hugging Face "
                             "model directory")
        self.temperature = rollout.temperature or 1.0  # greedy sampling (0): log-probs of the plain distribution
        self.seed = trainer.seed
        torch.manual_seed(self.seed)
        self.tokenizer = load_tokenizer(self.model_path, padding_side="left")
        self.device = worker_device()  # the GPU this worker was given, else the CPU
        self.model = load_causal_lm(self.model_path).to(self.device)
        head = self.model.get_output_embeddings()  # the rows its logits have (the config's may be rounded)
        self.vocab_size = int(head.weight.shape[0]) if head is not None else int(self.model.config.vocab_size)
        self.packing, self.chunk = actor.packing, actor.logprob_chunk_size
        # LoRA only where the policy trains: a generation-only group loads the merged weights it is sent
        if actor.lora_rank and any(i.endswith("ActorWorker.update_actor") for i in ctx.group_impls):
            apply_lora(self.model, actor.lora_rank, actor.lora_alpha, actor.lora_target_modules, actor.lora_dropout)
        if actor.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        enable_token_logprobs(self.model)
        self.model.eval()
        self.ref_model = None
        # weights made by any rank of this group are ours: DDP keeps the replicas identical, so
        # only a generation-only group (another name) loads policy_weights
        self.id = ctx.group
        # the one version counter: how many updates the loaded weights have had (0: the weights
        # at model_path), made here or in the group that trains them; generate writes it into each
        # sample's policy_version column, and the update checks staleness against it
        self.policy_version = 0
        self.max_staleness = trainer.max_staleness
        self.backend = rollout.backend
        self.rollout_options = {k: getattr(rollout, k) for k in _ENGINE_OPTIONS}
        self.rollout_engine: Any = None  # a VLLMEngine, started on the first generate call
        self.engine_holds: int | None = None  # the policy_version the engine holds (None: unknown, sync it)
        self.init_trainer(ctx, actor)

    # ------------------------------------------------------------------ weights
    def _sync(self, policy_weights: Mapping[str, Any] | None) -> None:
        """Load weights produced by an update in another group (a no-op when they are ours)."""
        if not policy_weights or policy_weights.get("owner") == self.id:
            return
        # the runtime hands each step exactly the weights it must use (rlgraph.runtime.window): with
        # steps in flight, or after a restore, they may be older than the ones loaded last. Each kept
        # version was written by an update, so two versions never share a policy_version
        if int(policy_weights["policy_version"]) != self.policy_version:
            self.model.load_state_dict(policy_weights["state"])
            self.policy_version = int(policy_weights["policy_version"])

    def _weights(self, step: int, with_state: bool = True) -> dict[str, Any]:
        """The policy_weights state column: the weights (none when no other worker takes them), their
        version, and the step that wrote them."""
        return {"step": step, "policy_version": self.policy_version, "owner": self.id,
                "state": self._policy_state() if with_state else {}}

    def _policy_state(self) -> dict[str, torch.Tensor]:
        """The policy's weights under the base model's names (LoRA: merged, computed on the side), in
        CPU memory (they go through Ray and the data plane)."""
        state = merged_weights(self.model) if has_lora(self.model) else self.model.state_dict()
        return state if self.device.type == "cpu" else {k: v.detach().cpu() for k, v in state.items()}

    def _engine_ready(self, rank: int) -> dict[str, float]:
        """Start the vLLM engine if needed, wake it, give it the current weights; what it cost."""
        from rlgraph.ops.rollout.vllm_engine import VLLMEngine

        metrics: dict[str, float] = {}
        if self.rollout_engine is None or self.rollout_engine.ensure_running():
            if self.rollout_engine is None:
                self.rollout_engine = VLLMEngine(self.model_path, rank=rank, seed=self.seed, **self.rollout_options)
            self.engine_holds = 0  # a fresh engine holds the weights at model_path
            metrics["engine_start_s"] = self.rollout_engine.start_s
        self.rollout_engine.wake_up()
        metrics["weight_sync_s"], metrics["weight_sync_bytes"] = 0.0, 0.0
        if self.engine_holds != self.policy_version:
            t0 = time.time()
            metrics["weight_sync_bytes"] = float(self._to_engine())
            metrics["weight_sync_s"] = time.time() - t0
        return metrics

    def _to_engine(self) -> int:
        """Give the engine the model's weights, labelled with their policy version; bytes sent."""
        sent = self.rollout_engine.load_weights(self._policy_state(), label=self.policy_version)
        self.engine_holds = self.policy_version
        return sent

    # ------------------------------------------------------------------ generate
    def generate(self, prompt_ids: torch.Tensor, policy_weights: Mapping[str, Any] | None = None, *,
                 temperature: float, top_p: float, top_k: int, max_new_tokens: int, stop_token_ids: str,
                 micro_batch_size: int, max_batch_tokens: int = 16384, partial: bool = False,
                 ctx: Any) -> Iterator[tuple[list[int], dict[str, Any]]]:
        """All of this rank's prompts; yields each finished part (a group on vLLM, a micro-batch on hf).
        With `partial`, newer policy weights that reach this worker while it generates are loaded at
        once (vLLM: between engine steps; hf: between micro-batches)."""
        self._sync(policy_weights)
        t0 = time.time()
        prompts = trimmed_rows(prompt_ids, ctx.lengths["prompt_len"])
        sampling = dict(n=ctx.group_size, seed=ctx.seed, temperature=temperature, top_p=top_p, top_k=top_k,
                        max_new_tokens=max_new_tokens, stop_token_ids=parse_token_ids(stop_token_ids),
                        logprobs="rollout_log_probs" in ctx.wanted)
        metrics: dict[str, float] = {}
        swaps = {"n": 0, "s": 0.0, "bytes": 0.0}

        def refresh() -> bool:
            t = time.time()
            if not self._take_newer(ctx):
                return False
            if self.backend == "vllm":
                swaps["bytes"] += self._to_engine()
            swaps["n"] += 1
            swaps["s"] += time.time() - t
            return True

        if self.backend == "vllm":
            metrics.update(self._engine_ready(ctx.rank))
            parts = vllm_parts(self.rollout_engine, prompts, ctx.is_padding, self.tokenizer.eos_token_id,
                               refresh=refresh if partial else None, **sampling)
        else:
            parts = hf_parts(self.model, self.tokenizer, prompts, ctx.is_padding, micro_batch_size=micro_batch_size,
                             max_batch_tokens=max_batch_tokens, refresh=refresh if partial else None, **sampling)
        tokens = n_parts = spanning = real = 0
        for rows, cols in parts:
            # the policy version of each response's first and last token (vLLM labels every token)
            versions = cols.pop(VERSIONS, None) or [(self.policy_version, self.policy_version)] * len(rows)
            cols["policy_version"] = torch.tensor([a for a, _ in versions], dtype=torch.int64)
            cols["policy_version_end"] = torch.tensor([b for _, b in versions], dtype=torch.int64)
            responses = cols["responses"]  # a Rows's lengths, without its row views
            lens = responses.lengths if type(responses) is Rows and responses.flat is not None \
                else [len(r) for r in responses]
            for j, pos in enumerate(rows):
                if not ctx.is_padding[pos]:
                    tokens += lens[j]
                    real += 1
                    spanning += versions[j][0] != versions[j][1]
            n_parts += 1
            yield rows, cols
        seconds = time.time() - t0
        metrics.update(generate_s=seconds, parts=float(n_parts), response_tokens_count=float(tokens),
                       tokens_per_s=tokens / seconds if seconds > 0 else 0.0)
        if partial:
            metrics.update(partial_swaps=float(swaps["n"]), partial_swap_s=swaps["s"],
                           partial_swap_bytes=swaps["bytes"], partial_frac=spanning / real if real else 0.0)
        return {"rollout_metrics": metrics}

    def agent_rollout(self, prompt_ids: torch.Tensor, policy_weights: Mapping[str, Any] | None = None,
                      data_source: list | None = None, ground_truth: list | None = None, extra_info: list | None = None,
                      *, temperature: float, top_p: float, top_k: int, max_new_tokens: int, ctx: Any,
                      **settings: Any) -> Iterator[tuple[list[int], dict[str, Any]]]:
        """Multi-turn rollouts with tools or an environment (`rlgraph.ops.agents`); yields each finished
        group. `settings`: the agent's rollout.* keys (AgentSettings) and the generate op's others."""
        from rlgraph.ops.agents.loop import AgentLimits, HFSampler, VLLMSampler
        from rlgraph.ops.agents.rollout import agent_parts, load_kit

        self._sync(policy_weights)
        key = (settings["env"], settings["tools"], settings["tool_format"], settings["tool_concurrency"],
               settings["tool_timeout_s"])
        kits = self.__dict__.setdefault("_agent_kits", {})
        if key not in kits:
            kits[key] = load_kit(*key)
        limits = AgentLimits(max_turns=settings["max_turns"], max_response_tokens=settings["max_response_tokens"],
                             max_turn_tokens=max_new_tokens, max_obs_tokens=settings["max_obs_tokens"],
                             env_timeout_s=settings["env_timeout_s"])
        prompts = trimmed_rows(prompt_ids, ctx.lengths["prompt_len"])
        metrics: dict[str, float] = {}
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, logprobs="rollout_log_probs" in ctx.wanted)
        if self.backend == "vllm":  # turns go to this rank's engine as token ids
            metrics.update(self._engine_ready(ctx.rank))
            sampler: Any = VLLMSampler(self.rollout_engine, self.tokenizer, **sampling)
        else:
            sampler = HFSampler(self.model, self.tokenizer, **sampling)
        data = {"data_source": data_source, "ground_truth": ground_truth, "extra_info": extra_info}
        for rows, cols in agent_parts(sampler, self.tokenizer, kits[key], prompts, ctx.is_padding, data,
                                      n=ctx.group_size, seed=ctx.seed, limits=limits, metrics=metrics,
                                      record=getattr(ctx, "event", None)):
            cols["policy_version"] = torch.full((len(rows),), self.policy_version, dtype=torch.int64)
            cols["policy_version_end"] = torch.full((len(rows),), self.policy_version, dtype=torch.int64)
            yield rows, cols
        return {"rollout_metrics": metrics}

    def _take_newer(self, ctx: Any) -> bool:
        """Partial rollout: load policy weights imported into this worker while the call runs, if
        they are newer than the loaded ones and this step may read them (written before it)."""
        w = ctx.state.get("policy_weights")
        if not w or w.get("owner") == self.id:
            return False
        if int(w["policy_version"]) <= self.policy_version or int(w["step"]) > ctx.step - 1:
            return False
        self._sync(w)
        return True

    # ------------------------------------------------------------------ forward passes
    def _scored(self, model: Any, packed: Packed, with_entropy: bool, loss_mask: torch.Tensor | None = None,
                device: torch.device | None = None, at_ids: torch.Tensor | None = None) -> Scores:
        """Log-probs (and entropy; with `at_ids` ``[b, R, k]``, the log-probs of those ids) of `packed`'s
        responses, ``[b, R]``, on the model's device."""
        return scored(model, packed, self.temperature, self.chunk, self.packing, with_entropy, loss_mask, device,
                      at_ids=at_ids)

    def _log_probs(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   ctx: Any, with_entropy: bool, budget: int = 0,
                   rows_per_pass: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The call's rows in forward passes of at most `budget` tokens (0: of `rows_per_pass` rows; 0: one
        pass), ``[b, R]`` results."""
        return score_rows(model, input_ids, attention_mask, ctx.lengths["response_len"], self.tokenizer.pad_token_id,
                          self.temperature, self.chunk, self.packing, budget, with_entropy, rows_per_pass)

    def compute_log_prob(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                         responses: torch.Tensor, response_mask: torch.Tensor,
                         policy_weights: Mapping[str, Any] | None = None,
                         rollout_log_probs: torch.Tensor | None = None, *, compare_rollout: bool,
                         max_tokens_per_micro_batch: int = 0, ctx: Any) -> dict[str, Any]:
        self._sync(policy_weights)
        logp, ent = self._log_probs(self.model, input_ids, attention_mask, ctx, with_entropy=True,
                                    budget=max_tokens_per_micro_batch)
        metrics: dict[str, float] = {}
        if compare_rollout and rollout_log_probs is not None:
            R = logp.shape[1]
            mask = response_mask[:, :R].long() * kept_rows(ctx)
            diff = rollout_probs_diff(logp, rollout_log_probs[:, :R].float(), mask)
            metrics = {"rollout_probs_diff_mean": diff.mean, "rollout_probs_diff_max": diff.max}
        return {"old_log_probs": logp, "entropy": ent, "old_logprob_metrics": metrics}

    def compute_ref_log_prob(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                             responses: torch.Tensor, response_mask: torch.Tensor, *, model_path: str = "",
                             max_tokens_per_micro_batch: int = 0, ctx: Any) -> dict[str, Any]:
        path = model_path or self.model_path
        if has_lora(self.model) and path == self.model_path:  # the base: this model with the adapters off
            with adapters_disabled(self.model):
                logp, _ = self._log_probs(self.model, input_ids, attention_mask, ctx, with_entropy=False,
                                          budget=max_tokens_per_micro_batch)
            return {"ref_log_prob": logp}
        if self.ref_model is None:
            self.ref_model = load_causal_lm(path, dtype=forward_dtype(self.device)).to(self.device)
            self.ref_model.eval()
            self.ref_model.requires_grad_(False)
            enable_token_logprobs(self.ref_model)
        logp, _ = self._log_probs(self.ref_model, input_ids, attention_mask, ctx, with_entropy=False,
                                  budget=max_tokens_per_micro_batch)
        return {"ref_log_prob": logp}

    # ------------------------------------------------------------------ update
    def update_actor(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                     responses: torch.Tensor, response_mask: torch.Tensor, advantages: torch.Tensor,
                     old_log_probs: torch.Tensor | None = None, ref_log_prob: torch.Tensor | None = None,
                     rollout_log_probs: torch.Tensor | None = None, policy_version: torch.Tensor | None = None,
                     policy_version_end: torch.Tensor | None = None, teacher_topk_ids: torch.Tensor | None = None,
                     teacher_topk_log_probs: torch.Tensor | None = None, *, lr: float,
                     weight_decay: float, grad_clip: float, lr_warmup_steps: int, backend: str, zero_stage: int,
                     loss_agg_mode: str, clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float,
                     loss_mode: str,
                     entropy_coeff: float, use_kl_loss: bool, kl_loss_coef: float, kl_loss_type: str,
                     tis_cap: float, decoupled_cap: float, max_tokens_per_micro_batch: int = 0,
                     distill_coef: float = 0.0, distill_beta: float = 0.5, ctx: Any) -> dict[str, Any]:
        if self.rollout_engine is not None:
            self.rollout_engine.sleep()  # on a GPU shared with the engine: free its memory while training
        staleness = self._staleness(policy_version, policy_version_end, ctx)
        proximal = old_log_probs is None and decoupled_cap > 0  # decoupled PPO, its proximal pass left out
        if proximal and ctx.dp > 1:  # before the rows move between ranks: take them from a pass of its own
            old_log_probs = self._proximal(input_ids, attention_mask, ctx, max_tokens_per_micro_batch)
        # padding rows have response_mask 0, and rows dropped this step (e.g. a failed reward) arrive
        # tagged as padding: no loss, no gradient, not in the token counts
        rows = {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask,
                "advantages": advantages, "kept": kept_rows(ctx)[:, 0],
                "response_len": torch.as_tensor(list(ctx.lengths["response_len"]), dtype=torch.long)}
        for name, col in (("old_log_probs", old_log_probs), ("ref_log_prob", ref_log_prob if use_kl_loss else None),
                          ("rollout_log_probs", rollout_log_probs if tis_cap > 0 or decoupled_cap > 0 else None),
                          ("teacher_topk_ids", teacher_topk_ids if distill_coef else None),
                          ("teacher_topk_log_probs", teacher_topk_log_probs if distill_coef else None)):
            if col is not None:
                rows[name] = col
        if max_tokens_per_micro_batch and ctx.dp > 1:  # every rank about the same tokens: none waits at the all-reduces
            rows, balance = balance_across_ranks(rows, attention_mask.sum(dim=1) * rows["kept"], ctx.rank, ctx.dp)
            staleness.update(balance)
        input_ids, attention_mask, response_mask, advantages = (rows["input_ids"], rows["attention_mask"],
                                                                rows["response_mask"], rows["advantages"])
        old_log_probs, ref_log_prob, rollout_log_probs = (rows.get("old_log_probs"), rows.get("ref_log_prob"),
                                                          rows.get("rollout_log_probs"))
        packed = repack(input_ids, attention_mask, rows["response_len"].tolist(), self.tokenizer.pad_token_id)
        R = packed.response_width
        mdt = packed.response_mask.dtype
        mask = packed.response_mask * response_mask[:, :R].to(mdt) * rows["kept"][:, None].to(mdt)
        # tokens each row costs a forward (packed: rows with nothing to learn from are left out)
        cost = packed.attention_mask.sum(dim=1) * ((mask.sum(dim=1) > 0) if self.packing else 1)
        batch = {"input_ids": packed.input_ids, "attention_mask": packed.attention_mask,
                 "position_ids": packed.position_ids, "response_mask": mask, "real_mask": packed.response_mask,
                 "advantages": advantages[:, :R], "seq_tokens": cost}
        if old_log_probs is None and (ctx.batching is None or ctx.batching.updates_per_step != 1):
            raise OpError(f"{ctx.op}: no old_log_probs, and this update makes "  # the compiler never plans this
                          f"{ctx.batching.updates_per_step if ctx.batching else '?'} optimizer steps per training "
                          f"step; its own forward gives them only for one. Add stages.old_logprob() to the pipeline")
        # the corrections that weigh tokens by old log-probs take them from the forward when the update has
        # none: truncated IS per micro-batch; decoupled PPO only when its one forward sees every row, since the
        # tokens it drops change the loss's normaliser, which the engine needs before the first micro-batch
        in_forward = old_log_probs is None and (tis_cap > 0 or decoupled_cap > 0)
        if proximal and old_log_probs is None and not _one_forward(ctx, len(cost), int(cost.sum()),
                                                                 max_tokens_per_micro_batch):
            old_log_probs = self._proximal(input_ids, attention_mask, ctx, max_tokens_per_micro_batch)
            in_forward = False
        if old_log_probs is not None:
            batch["old_log_probs"] = old_log_probs[:, :R]
        if in_forward:
            batch["rollout_log_probs"] = rollout_log_probs[:, :R].float()
        if use_kl_loss:
            batch["ref_log_prob"] = ref_log_prob[:, :R]
        if distill_coef:  # the teacher's top-k next tokens and their log-probs, [rows, R, k]
            # slots the student cannot score (no token, or past its vocabulary) carry no probability on either side
            ids, lps, ok = usable_ids(rows["teacher_topk_ids"][:, :R].long(),
                                      rows["teacher_topk_log_probs"][:, :R].float(), self.vocab_size)
            batch["teacher_topk_ids"], batch["teacher_topk_log_probs"], batch["teacher_topk_ok"] = ids, lps, ok
        if tis_cap > 0 and not in_forward:  # truncated importance sampling: trainer vs rollout engine, per token
            batch["is_weights"] = truncated_is_weights(old_log_probs[:, :R], rollout_log_probs[:, :R].float(), tis_cap)
        # decoupled PPO: ratio against the proximal policy, behaviour weights, cap drops
        if decoupled_cap > 0 and not in_forward:
            w, keep = decoupled_weights(old_log_probs[:, :R], rollout_log_probs[:, :R].float(), decoupled_cap)
            kept_before = mask.sum()
            batch["is_weights"] = w
            batch["response_mask"] = mask = mask * keep.to(mask.dtype)
            staleness["behaviour_dropped_frac"] = float(1 - mask.sum() / kept_before) if kept_before > 0 else 0.0
        P, device = packed.prompt_width, None

        def loss_fn(model, mb, global_tokens, global_seqs):
            micro = Packed(mb["input_ids"], mb["attention_mask"], mb["position_ids"], mb["real_mask"], P, R)
            s = self._scored(model, micro, bool(entropy_coeff), loss_mask=mb["response_mask"], device=device,
                             at_ids=mb.get("teacher_topk_ids"))
            logp, ent_mat = s.logp, s.entropy
            # one optimizer step per training step: the weights are still the old policy's, so this forward
            # is the old log-probs (rlgraph.graph.reuse left the separate pass out)
            old = mb["old_log_probs"] if "old_log_probs" in mb else logp.detach()
            m = mb["response_mask"]
            extra: dict[str, float] = {}
            if in_forward:
                mb = dict(mb)
                if not decoupled_cap:
                    mb["is_weights"] = truncated_is_weights(old, mb["rollout_log_probs"], tis_cap)
                else:  # the whole batch in this forward (`_one_forward`): drops, then the normalisers
                    if int(m.shape[0]) != len(cost):
                        raise InvariantError(f"{ctx.op}: decoupled PPO's proximal log-probs from the update's forward "
                                             f"need all {len(cost)} rows in one micro-batch, got {int(m.shape[0])}")
                    w, keep = decoupled_weights(old, mb["rollout_log_probs"], decoupled_cap)
                    before = m.sum()
                    mb["is_weights"], m = w, m * keep.to(m.dtype)
                    tokens, seqs = valid_counts(m)  # counted as the engine counts them, after the drops
                    global_tokens, global_seqs = max(int(tokens.sum()), 1), max(int(seqs.sum()), 1)
                    extra["behaviour_dropped_frac"] = float(1 - m.sum() / before) if before > 0 else 0.0
            if loss_mode == "gspo":  # sequence-level ratio, aggregated seq-mean-token-mean
                pg = gspo_policy_loss(logp, old, mb["advantages"], m, clip_ratio_low=clip_ratio_low,
                                      clip_ratio_high=clip_ratio_high, global_seqs=global_seqs,
                                      is_weights=mb.get("is_weights"))
            else:
                pg = policy_loss(logp, old, mb["advantages"], m, clip_ratio_low=clip_ratio_low,
                                 clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c, agg_mode=loss_agg_mode,
                                 global_tokens=global_tokens, global_seqs=global_seqs,
                                 is_weights=mb.get("is_weights"))
            loss = pg.loss
            # metrics as local means: the engine averages them over micro-batches (the loss itself is
            # normalised by the global token count, so it sums instead)
            pg_agg = "seq-mean-token-mean" if loss_mode == "gspo" else loss_agg_mode
            metrics = {"pg_loss": float(agg_loss(pg.pg_losses.detach(), m, pg_agg)),
                       "pg_clipfrac": float(pg.clipfrac), "ppo_kl": float(pg.approx_kl)}
            if "is_weights" in mb:  # truncated IS or decoupled PPO's behaviour weights
                key = "behaviour_weight_mean" if decoupled_cap > 0 else "tis_weight_mean"
                metrics[key] = float(masked_mean(mb["is_weights"], m))
            metrics.update(extra)
            if entropy_coeff:
                loss = loss - entropy_coeff * agg_loss(ent_mat, m, loss_agg_mode, global_tokens, global_seqs)
                metrics["entropy"] = float(agg_loss(ent_mat.detach(), m, loss_agg_mode))
            if use_kl_loss:
                kl = kl_loss(logp, mb["ref_log_prob"], m, kl_loss_type, loss_agg_mode,
                             global_tokens=global_tokens, global_seqs=global_seqs)
                loss = loss + kl_loss_coef * kl
                metrics["kl_loss"] = float(kl_loss(logp.detach(), mb["ref_log_prob"], m, kl_loss_type,
                                                   loss_agg_mode))
            if distill_coef and s.side_logp is not None:  # GKD: the divergence to the teacher's distribution
                student = drop_unusable(s.side_logp, mb["teacher_topk_ok"].to(s.side_logp.device))
                dl, per_token = top_k_distill_loss(student, mb["teacher_topk_log_probs"].to(s.side_logp.device),
                                                   m, distill_beta, loss_agg_mode, global_tokens, global_seqs)
                loss = loss + distill_coef * dl
                metrics["distill_loss"] = float(agg_loss(per_token.detach(), m, loss_agg_mode))
            return loss, metrics

        metrics = self.train(self.model, batch, loss_fn, ctx, lr=lr, weight_decay=weight_decay, grad_clip=grad_clip,
                             lr_warmup_steps=lr_warmup_steps, backend=backend, zero_stage=zero_stage,
                             max_tokens_per_micro_batch=max_tokens_per_micro_batch)
        metrics = {**metrics, **staleness, "forward_tokens": float(cost.sum()),
                   "padded_tokens": float(packed.input_ids.numel())}
        self.model.eval()
        self.policy_version += 1  # the engine (if any) is given these weights before it generates again
        # weights only where another worker takes them: this group's ranks hold the same ones already (a LoRA
        # policy's merged copy would be a whole model more in memory)
        return {"actor_metrics": metrics,
                "policy_weights": self._weights(ctx.step, with_state="policy_weights" in ctx.exported)}

    def _proximal(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, ctx: Any,
                  budget: int) -> torch.Tensor:
        """Decoupled PPO's proximal log-probs (this policy, before the update) in a pass of the update's
        own: what the old_logprob op the compiler left out would have computed, without its call. In
        forwards of at most `budget` tokens, else of the update's micro-batch of rows (no more memory
        than the update's own forwards)."""
        rows = ctx.batching.micro_batch_size if ctx.batching is not None else 0
        with torch.no_grad():
            logp, _ = self._log_probs(self.model, input_ids, attention_mask, ctx, with_entropy=False, budget=budget,
                                      rows_per_pass=rows)
        return logp

    def _staleness(self, policy_version: torch.Tensor | None, policy_version_end: torch.Tensor | None,
                   ctx: Any) -> dict[str, float]:
        """How many versions behind this policy the kept samples' generating policy is (mean, max; of
        their first token, and the mean of their last token: partial rollout); a first token more
        than trainer.max_staleness behind is refused."""
        if policy_version is None:
            return {}
        kept = kept_rows(ctx)[:, 0].bool()
        lag = (self.policy_version - policy_version.to(torch.int64))[kept]
        if lag.numel() == 0:
            return {}
        worst = int(lag.max())
        if worst > self.max_staleness or int(lag.min()) < 0:
            versions = sorted(set(policy_version[kept].tolist()))
            raise StalenessError(
                f"update_actor at step {ctx.step}: samples generated by policy versions {versions}, "
                f"this policy is version {self.policy_version}; trainer.max_staleness={self.max_staleness} allows "
                f"{max(self.policy_version - self.max_staleness, 0)}..{self.policy_version}. This is a runtime bug: "
                f"please report it with the plan file")
        out = {"staleness_mean": float(lag.float().mean()), "staleness_max": float(worst)}
        if policy_version_end is not None:
            end = policy_version_end.to(torch.int64)[kept]
            if bool((end < policy_version.to(torch.int64)[kept]).any()) or int(end.max()) > self.policy_version:
                raise StalenessError(f"update_actor at step {ctx.step}: a sample's policy_version_end is below its "
                                     f"policy_version or above this policy's version {self.policy_version}. This is "
                                     f"a runtime bug: please report it with the plan file")
            out["staleness_end_mean"] = float((self.policy_version - end).float().mean())
        return out

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        # LoRA: the adapters only (the frozen base is the model directory's)
        return {"model": model_state(self.model), "trainer": self.trainer_state(),
                "policy_version": self.policy_version}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        load_model_state(self.model, state["model"])
        self.load_trainer_state(state.get("trainer"))
        self.policy_version = int(state["policy_version"])
        self.engine_holds = None  # the engine may hold weights of a run since abandoned: give it these

    def close(self) -> None:
        if self.rollout_engine is not None:
            self.rollout_engine.close()

