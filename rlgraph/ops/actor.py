"""The policy worker: generation, old log-probs, reference log-probs and the PPO update.

One `ActorWorker` per data-parallel rank of its group. When generate, old_logprob and
update_actor share a group (colocation, like verl's actor_rollout_ref), they share one model:
the update changes the weights generation uses, with no copy. When generation runs in a group
of its own, it loads the ``policy_weights`` state column each step (the runtime moves it
between groups through Ray).

Log-probs are computed at the rollout temperature (``rollout.temperature``), as the sampler saw
the distribution; the model path is ``actor.model_path`` (``rollout.model_path`` for a
generation-only group, ``ref.model_path`` for the reference, defaulting to the actor's).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from rlgraph.ops.algos import agg_loss, entropy_from_logits, kl_loss, logprobs_from_logits, policy_loss
from rlgraph.ops.models import load_causal_lm, load_tokenizer
from rlgraph.ops.rollout import generate_hf
from rlgraph.ops.sequences import pack, response_logits, split_rows
from rlgraph.ops.training import TrainerMixin, kept_rows, section

__all__ = ["ActorWorker"]


class ActorWorker(TrainerMixin):
    """Policy model on one rank; reference model loaded on first use."""

    def setup(self, ctx: Any) -> None:
        self.ctx = ctx
        actor, rollout = section(ctx, "actor"), section(ctx, "rollout")
        self.model_path = actor.get("model_path") or rollout.get("model_path")
        if not self.model_path:
            raise ValueError("no model: set actor.model_path (or rollout.model_path) to a local Hugging Face "
                             "model directory")
        self.temperature = float(rollout.get("temperature", 1.0)) or 1.0
        torch.manual_seed(int(section(ctx, "trainer").get("seed", 0)))
        self.tokenizer = load_tokenizer(self.model_path, padding_side="left")
        self.model = load_causal_lm(self.model_path)
        self.model.eval()
        self.ref_model = None
        # weights made by any rank of this group are ours: DDP keeps the replicas identical, so
        # only a generation-only group (another name) loads policy_weights
        self.id = ctx.group
        self.version = -1
        self.init_trainer(ctx)

    # ------------------------------------------------------------------ weights
    def _sync(self, policy_weights: Mapping[str, Any] | None) -> None:
        """Load weights produced by an update in another group (a no-op when they are ours)."""
        if not policy_weights or policy_weights.get("owner") == self.id:
            return
        if int(policy_weights["version"]) > self.version:
            self.model.load_state_dict(policy_weights["state"])
            self.version = int(policy_weights["version"])

    def _weights(self, step: int) -> dict[str, Any]:
        return {"version": step, "owner": self.id, "state": self.model.state_dict()}

    # ------------------------------------------------------------------ generate
    def generate(self, prompt_ids: torch.Tensor, policy_weights: Mapping[str, Any] | None = None, *,
                 n: int = 1, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 max_new_tokens: int = 16, calculate_log_probs: bool = False,
                 ctx: Any = None, **_: Any) -> dict[str, Any]:
        self._sync(policy_weights)
        prompts = [prompt_ids[i, :n_i] for i, n_i in enumerate(ctx.lengths["prompt_len"])]
        return generate_hf(self.model, self.tokenizer, prompts, ctx.is_padding, seed=ctx.seed,
                           temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                           calculate_log_probs=calculate_log_probs)

    # ------------------------------------------------------------------ forward passes
    @torch.no_grad()
    def _log_probs(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   ctx: Any, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        prompts, responses = split_rows(input_ids, attention_mask, ctx.lengths["response_len"])
        packed = pack(prompts, responses, self.tokenizer.pad_token_id)
        logits = response_logits(model, packed, self.temperature)
        logp = logprobs_from_logits(logits, packed.input_ids[:, packed.prompt_width:])
        ent = entropy_from_logits(logits) if with_entropy else None
        return logp * packed.response_mask, ent

    def compute_log_prob(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: Any = None,
                         responses: Any = None, response_mask: Any = None,
                         policy_weights: Mapping[str, Any] | None = None, *, ctx: Any = None,
                         **_: Any) -> dict[str, Any]:
        self._sync(policy_weights)
        logp, ent = self._log_probs(self.model, input_ids, attention_mask, ctx, with_entropy=True)
        return {"old_log_probs": logp, "entropy": ent}

    def compute_ref_log_prob(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: Any = None,
                             responses: Any = None, response_mask: Any = None, *, ctx: Any = None,
                             **_: Any) -> dict[str, Any]:
        if self.ref_model is None:
            path = section(ctx, "ref").get("model_path") or self.model_path
            self.ref_model = load_causal_lm(path)
            self.ref_model.eval()
            self.ref_model.requires_grad_(False)
        logp, _ = self._log_probs(self.ref_model, input_ids, attention_mask, ctx, with_entropy=False)
        return {"ref_log_prob": logp}

    # ------------------------------------------------------------------ update
    def update_actor(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: Any = None,
                     responses: Any = None, response_mask: torch.Tensor | None = None,
                     old_log_probs: torch.Tensor | None = None, advantages: torch.Tensor | None = None,
                     ref_log_prob: torch.Tensor | None = None, *, clip_ratio_low: float = 0.2,
                     clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0, entropy_coeff: float = 0.0,
                     use_kl_loss: bool = False, kl_loss_coef: float = 0.001, kl_loss_type: str = "low_var_kl",
                     loss_agg_mode: str = "token-mean", ctx: Any = None, **train: Any) -> dict[str, Any]:
        prompts, resp = split_rows(input_ids, attention_mask, ctx.lengths["response_len"])
        packed = pack(prompts, resp, self.tokenizer.pad_token_id)
        R = packed.response_width
        # padding rows have response_mask 0, and rows dropped this step (e.g. a failed reward) arrive
        # tagged as padding: no loss, no gradient, not in the token counts
        mask = packed.response_mask * response_mask[:, :R].to(packed.response_mask.dtype) * kept_rows(ctx, packed.response_mask.dtype)
        batch = {"input_ids": packed.input_ids, "attention_mask": packed.attention_mask,
                 "position_ids": packed.position_ids, "response_mask": mask,
                 "old_log_probs": old_log_probs[:, :R], "advantages": advantages[:, :R]}
        if use_kl_loss:
            batch["ref_log_prob"] = ref_log_prob[:, :R]
        P, temperature = packed.prompt_width, self.temperature

        def loss_fn(model, mb, global_tokens, global_seqs):
            out = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                        position_ids=mb["position_ids"], use_cache=False)
            logits = out.logits[:, P - 1:P - 1 + R, :].float() / temperature
            logp = logprobs_from_logits(logits, mb["input_ids"][:, P:])
            m = mb["response_mask"]
            pg = policy_loss(logp, mb["old_log_probs"], mb["advantages"], m, clip_ratio_low=clip_ratio_low,
                             clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c, agg_mode=loss_agg_mode,
                             global_tokens=global_tokens, global_seqs=global_seqs)
            loss = pg.loss
            # metrics as local means: the engine averages them over micro-batches (the loss itself is
            # normalised by the global token count, so it sums instead)
            metrics = {"pg_loss": float(agg_loss(pg.pg_losses.detach(), m, loss_agg_mode)),
                       "pg_clipfrac": float(pg.clipfrac), "ppo_kl": float(pg.approx_kl)}
            if entropy_coeff:
                ent_mat = entropy_from_logits(logits)
                loss = loss - entropy_coeff * agg_loss(ent_mat, m, loss_agg_mode, global_tokens, global_seqs)
                metrics["entropy"] = float(agg_loss(ent_mat.detach(), m, loss_agg_mode))
            if use_kl_loss:
                kl = kl_loss(logp, mb["ref_log_prob"], m, kl_loss_type, loss_agg_mode,
                             global_tokens=global_tokens, global_seqs=global_seqs)
                loss = loss + kl_loss_coef * kl
                metrics["kl_loss"] = float(kl_loss(logp.detach(), mb["ref_log_prob"], m, kl_loss_type,
                                                   loss_agg_mode))
            return loss, metrics

        metrics = self.train(self.model, batch, loss_fn, ctx, section(ctx, "rollout").get("n", 1), **train)
        self.model.eval()
        return {"actor_metrics": metrics, "policy_weights": self._weights(ctx.step)}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "trainer": self.trainer_state(), "version": self.version}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.load_trainer_state(state.get("trainer"))
        self.version = int(state.get("version", -1))

