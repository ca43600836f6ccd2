"""The value model: per-token values and the clipped value-loss update.

The critic is a token-classification head (one output) over a causal LM backbone, as in verl;
``critic.model_path`` defaults to ``actor.model_path`` (the head starts fresh). The value of
response token t is read at the position just before it: the state in which token t was
chosen.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from rlgraph.graph.settings import TrainerSettings
from rlgraph.ops.algos import agg_loss, value_loss
from rlgraph.ops.models import load_critic, load_tokenizer, worker_device
from rlgraph.ops.settings import ActorSettings, CriticSettings
from rlgraph.ops.train.engine.balance import token_micro_batches
from rlgraph.ops.train.sequences import repack
from rlgraph.ops.train.update import TrainerMixin, kept_rows

__all__ = ["CriticWorker"]


def _values(model: torch.nn.Module, input_ids, attention_mask, position_ids, P: int, R: int) -> torch.Tensor:
    dev = next(model.parameters()).device
    out = model(input_ids=input_ids.to(dev), attention_mask=attention_mask.to(dev), position_ids=position_ids.to(dev))
    return out.logits[:, P - 1:P - 1 + R, 0].float()  # [b, R]


class CriticWorker(TrainerMixin):
    def setup(self, ctx: Any) -> None:
        critic = CriticSettings.of(ctx)
        path = critic.model_path or ActorSettings.value(ctx, "model_path")
        if not path:
            raise ValueError("no critic model: set critic.model_path (or actor.model_path) to a local Hugging Face "
                             "model directory")
        torch.manual_seed(TrainerSettings.of(ctx).seed + 1)
        self.tokenizer = load_tokenizer(path)
        self.model = load_critic(path).to(worker_device())
        if critic.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.eval()
        self.init_trainer(ctx, critic)

    @torch.no_grad()
    def compute_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                       responses: torch.Tensor, response_mask: torch.Tensor, critic_weights: Any = None, *,
                       max_tokens_per_micro_batch: int = 0, ctx: Any) -> dict[str, Any]:
        resp = list(ctx.lengths["response_len"])
        whole = repack(input_ids, attention_mask, resp, self.tokenizer.pad_token_id)
        parts = (token_micro_batches(attention_mask.sum(dim=1).tolist(), max_tokens_per_micro_batch)
                 if max_tokens_per_micro_batch else [list(range(input_ids.shape[0]))])
        out = torch.zeros((input_ids.shape[0], whole.response_width))
        for part in parts:  # forward passes of at most the token budget
            rows = torch.tensor(part, dtype=torch.long)
            p = repack(input_ids[rows], attention_mask[rows], [resp[i] for i in part], self.tokenizer.pad_token_id)
            v = _values(self.model, p.input_ids, p.attention_mask, p.position_ids, p.prompt_width, p.response_width)
            out[rows, :p.response_width] = v.float().cpu() * p.response_mask
        return {"values": out}

    def update_critic(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                      responses: torch.Tensor, response_mask: torch.Tensor, values: torch.Tensor,
                      returns: torch.Tensor, *, lr: float, weight_decay: float, grad_clip: float,
                      lr_warmup_steps: int, backend: str, zero_stage: int, loss_agg_mode: str,
                      cliprange_value: float, max_tokens_per_micro_batch: int = 0, ctx: Any) -> dict[str, Any]:
        p = repack(input_ids, attention_mask, ctx.lengths["response_len"], self.tokenizer.pad_token_id)
        P, R = p.prompt_width, p.response_width
        mask = p.response_mask * response_mask[:, :R].to(p.response_mask.dtype) * kept_rows(ctx, p.response_mask.dtype)
        batch = {"input_ids": p.input_ids, "attention_mask": p.attention_mask, "position_ids": p.position_ids,
                 "response_mask": mask, "values": values[:, :R], "returns": returns[:, :R],
                 "seq_tokens": p.attention_mask.sum(dim=1)}

        def loss_fn(model, mb, global_tokens, global_seqs):
            v = _values(model, mb["input_ids"], mb["attention_mask"], mb["position_ids"], P, R)
            res = value_loss(v, mb["values"], mb["returns"], mb["response_mask"], cliprange_value=cliprange_value,
                             agg_mode=loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs)
            local = agg_loss(res.vf_losses.detach(), mb["response_mask"], loss_agg_mode)  # a local mean (see actor)
            return res.loss, {"vf_loss": float(local), "vf_clipfrac": float(res.vf_clipfrac)}

        metrics = self.train(self.model, batch, loss_fn, ctx, lr=lr, weight_decay=weight_decay, grad_clip=grad_clip,
                             lr_warmup_steps=lr_warmup_steps, backend=backend, zero_stage=zero_stage,
                             max_tokens_per_micro_batch=max_tokens_per_micro_batch)
        self.model.eval()
        return {"critic_metrics": metrics, "critic_weights": {"version": ctx.step}}

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "trainer": self.trainer_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.load_trainer_state(state.get("trainer"))
