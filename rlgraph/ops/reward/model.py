"""The discriminative reward-model op: score each prompt+response with a sequence classifier.

A reward model (RM) is a Hugging Face ``AutoModelForSequenceClassification`` checkpoint with
one label: a transformer whose ``score`` head maps the hidden state of the last real token to
one number. `RewardModelWorker.compute_rm_score` feeds it the rows' ``input_ids`` as the policy
produced them (the RM must share the policy's tokenizer) and puts each row's score on its last
response token, zeros elsewhere, as the rule-based reward op does (verl's convention).

The last real token is found from ``attention_mask`` (its rightmost 1), never from
``pad_token_id``: transformers' own pooling takes the rightmost token that is not the pad
token, which is wrong when a model's pad token is also its EOS (common) and the response ends
with EOS. Rows arrive right-padded, so they are scored as they are, trimmed to the longest row
of each micro-batch.

Config section ``reward_model``: ``model_path`` (required), ``offload`` (default true: on a GPU
the model waits on the CPU between calls, "wakes, scores, sleeps", when it shares devices with
the policy) and ``dtype`` (default float32).

`prepare_tiny_reward_model` makes a tiny RM for tests and examples, offline: the tiny policy's
architecture and character tokenizer, trained for a few seconds on CPU to tell correct answers
of a built-in task (`rlgraph.ops.data.tasks`) from wrong ones.
"""

from __future__ import annotations

import logging
import math
import random
import shutil
import time
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import torch

from rlgraph.errors import ConfigError
from rlgraph.graph.settings import GroupSettings
from rlgraph.ops.models import (
    ModelLoadError,
    _check_dir,
    _check_missing,
    _DropLoadReport,
    build_tiny_model,
    encode_prompt,
    load_tokenizer,
    optimizer_step,
)
from rlgraph.ops.settings import ActorSettings, DataSettings, RewardModelSettings

__all__ = [
    "RewardModelError",
    "RewardModelWorker",
    "load_reward_model",
    "score_sequences",
    "build_tiny_reward_model",
    "reward_examples",
    "RMTrainMetrics",
    "train_reward_model",
    "pairwise_accuracy",
    "prepare_tiny_reward_model",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_TINY_FIX = "build a tiny one with rlgraph.ops.reward.model.prepare_tiny_reward_model(path)"


class RewardModelError(ModelLoadError):
    """The reward model is missing, is not a one-label sequence classifier, or does not fit the policy."""


# ---------------------------------------------------------------------------------------------- loading
def load_reward_model(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """The one-label ``AutoModelForSequenceClassification`` saved in `path` (local files only),
    in `dtype`, in eval mode.

    A causal LM or any checkpoint without trained ``score`` weights is a `RewardModelError`
    (loading it as a classifier would give a randomly initialised head, so random rewards)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    try:
        p = _check_dir(path, "reward model", ("config.json",))
    except ModelLoadError as e:
        raise RewardModelError(f"reward_model.model_path: {e}; or {_TINY_FIX}") from e
    try:
        config = AutoConfig.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise RewardModelError(f"cannot read the reward model config in {str(p)!r}: {e}") from e
    archs = list(getattr(config, "architectures", None) or [])
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        raise RewardModelError(
            f"{str(p)!r} holds a {', '.join(archs)}, not a reward model: reward_model.model_path needs a checkpoint "
            f"saved from AutoModelForSequenceClassification with num_labels=1 (train one, or {_TINY_FIX})")
    if getattr(config, "num_labels", 1) != 1:
        raise RewardModelError(f"the reward model in {str(p)!r} has num_labels={config.num_labels}; a reward model "
                               f"outputs one score per sequence (num_labels=1)")
    quiet = logging.getLogger("transformers.modeling_utils")
    no_report = _DropLoadReport()
    quiet.addFilter(no_report)
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            p, dtype=dtype, local_files_only=True, output_loading_info=True)
    except (OSError, ValueError, KeyError) as e:
        raise RewardModelError(f"cannot load a sequence-classification reward model from {str(p)!r}: {e}") from e
    finally:
        quiet.removeFilter(no_report)
    try:
        _check_missing(p, "reward model", info.get("missing_keys", ()))
    except ModelLoadError as e:
        raise RewardModelError(str(e)) from e
    return model.eval()


# ---------------------------------------------------------------------------------------------- scoring
def score_sequences(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    pad_token_id: int | None = None) -> torch.Tensor:
    """One float32 score per row of `input_ids` [b, L], read at each row's last real token.

    The last real token is the rightmost 1 of `attention_mask` (right or left padding alike);
    positions count real tokens only. Decoder classifiers (a ``score`` head over the base
    model, as Llama/Qwen/Mistral/Gemma/GPT-2 reward models have) are run as base model + head
    at that token; other classifiers (encoders pooling their first token) through their own
    forward. Gradients flow (training uses this too); wrap calls in ``torch.no_grad()`` to score.
    """
    mask = attention_mask.long()
    if pad_token_id is not None:
        input_ids = input_ids.masked_fill(mask == 0, int(pad_token_id))
    head = getattr(model, "score", None)
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if isinstance(head, torch.nn.Module) and isinstance(base, torch.nn.Module) and base is not model:
        width = mask.shape[1]
        last = (torch.arange(width, device=mask.device) * mask).argmax(dim=-1)  # rightmost real token
        position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
        hidden = base(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                      use_cache=False).last_hidden_state
        picked = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        return head(picked)[:, 0].float()
    return model(input_ids=input_ids, attention_mask=mask).logits[:, 0].float()


def _policy_tokenizer_path(ctx: Any) -> str:
    return ActorSettings.value(ctx, "model_path") or DataSettings.value(ctx, "tokenizer")


def _check_same_vocab(rm_tokenizer: Any, policy_path: str, rm_path: Path) -> None:
    """The RM reads the policy's token ids as they are: every policy token must mean the same
    token to the RM. A policy tokenizer that cannot be loaded is left to the policy's own op."""
    try:
        policy = load_tokenizer(policy_path).get_vocab()
    except ModelLoadError:
        return
    rm = rm_tokenizer.get_vocab()
    differ = [t for t, i in policy.items() if rm.get(t) != i]
    if differ:
        raise RewardModelError(
            f"the reward model {str(rm_path)!r} uses another tokenizer than the policy {policy_path!r} "
            f"({len(differ)} of {len(policy)} policy tokens differ, e.g. {sorted(differ)[:3]}); the reward model "
            f"reads the policy's token ids directly, so use a reward model trained with the policy's tokenizer "
            f"(or set reward_model.check_tokenizer=false if the difference is known to be harmless)")


class RewardModelWorker:
    """A frozen reward model on one worker; `compute_rm_score` is the op body."""

    def setup(self, ctx: Any) -> None:
        cfg = RewardModelSettings.of(ctx)
        path = cfg.model_path
        if not path:
            raise ConfigError("reward_model.model_path is not set: give a local Hugging Face directory holding an "
                              f"AutoModelForSequenceClassification checkpoint (num_labels=1), or {_TINY_FIX}")
        self.model_path = Path(str(path)).expanduser()
        self.device = torch.device("cuda") if _gets_gpu(ctx) else torch.device("cpu")
        # "wakes, scores, sleeps": on a GPU shared with the policy, keep the weights on the CPU between calls
        self.offload = cfg.offload and self.device.type == "cuda"
        self.model = load_reward_model(self.model_path, _DTYPES[cfg.dtype])
        self.model.requires_grad_(False)
        try:
            self.tokenizer = load_tokenizer(self.model_path)
        except ModelLoadError as e:
            raise RewardModelError(f"reward_model.model_path: {e}") from e
        if cfg.check_tokenizer and _policy_tokenizer_path(ctx):
            _check_same_vocab(self.tokenizer, _policy_tokenizer_path(ctx), self.model_path)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else 0
        if not self.offload:
            self.model.to(self.device)
        self.calls = 0
        self.rows_scored = 0

    @torch.no_grad()
    def compute_rm_score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                         position_ids: Any = None, responses: Any = None, response_mask: torch.Tensor | None = None,
                         *, micro_batch_size: int = 32, ctx: Any = None) -> dict[str, Any]:
        """Score every real row; the score goes on its last response token (index length-1)."""
        rows = int(input_ids.shape[0])
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        lengths = _response_lengths(ctx, response_mask, rows)
        is_padding = tuple(getattr(ctx, "is_padding", ()) or ()) or (False,) * rows
        real = [i for i in range(rows) if not is_padding[i]]
        scores = torch.zeros(rows, dtype=torch.float32)
        if real:
            mb = max(1, int(micro_batch_size))
            if self.offload:
                self.model.to(self.device)
            try:
                for start in range(0, len(real), mb):
                    idx = torch.tensor(real[start:start + mb])
                    mask = attention_mask[idx].long()
                    width = int((torch.arange(mask.shape[1]) * mask).argmax(dim=-1).max()) + 1
                    s = score_sequences(self.model, input_ids[idx, :width].long().to(self.device),
                                        mask[:, :width].to(self.device), self.pad_token_id)
                    scores[idx] = s.cpu()
            finally:
                if self.offload:
                    self.model.to("cpu")
                    torch.cuda.empty_cache()
        out = torch.zeros((rows, max(lengths, default=1) or 1), dtype=torch.float32)
        for i in real:
            out[i, max(lengths[i], 1) - 1] = scores[i]  # verl's convention: on the last response token
        self.calls += 1
        self.rows_scored += len(real)
        name = (tuple(getattr(ctx, "outputs", ()) or ()) or ("rm_scores",))[0]
        return {name: out}


def _gets_gpu(ctx: Any) -> bool:
    """CUDA is there and this worker's group was given GPUs (when the config says)."""
    if not torch.cuda.is_available():
        return False
    group = GroupSettings.find(ctx, f"groups.{getattr(ctx, 'group', '')}")  # None: a bare context in a test
    return group is None or group.num_gpus > 0


def _response_lengths(ctx: Any, response_mask: torch.Tensor | None, rows: int) -> list[int]:
    lengths = (getattr(ctx, "lengths", None) or {}).get("response_len")
    if lengths is not None:
        return [int(n) for n in lengths]
    if response_mask is not None:  # no ctx: the mask's last 1 (padding rows have an all-zero mask)
        m = response_mask.long()
        return [int((torch.arange(m.shape[1]) * m[i]).argmax()) + 1 for i in range(rows)]
    raise ValueError("compute_rm_score needs each row's response length: ctx.lengths['response_len'] "
                     "(the runtime passes it) or a response_mask")


# ---------------------------------------------------------------------------------------------- tiny RM
def build_tiny_reward_model(path: str | Path, task: str = "add", seed: int = 0, hidden_size: int = 64,
                            num_layers: int = 2, num_heads: int = 4, backbone: str | Path | None = None) -> Path:
    """Save a one-label ``Qwen2ForSequenceClassification`` with the tiny policy's character
    tokenizer (`rlgraph.ops.models.char_tokenizer`) to `path`, offline.

    Without `backbone` the weights are random (the same arguments give the same weights). With
    `backbone`, a tiny causal LM directory (`rlgraph.ops.models.build_tiny_model`, perhaps warm
    started), the transformer is that model's and only the ``score`` head is new, as reward
    models are usually initialised from the SFT policy. `task` is recorded in the config
    (``rlgraph_task``). Returns the directory."""
    from transformers import AutoConfig, Qwen2ForSequenceClassification

    out = Path(path).expanduser()
    tmp = out.with_name(out.name + ".backbone")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        src = Path(backbone).expanduser() if backbone is not None else tmp
        if backbone is None:  # the tiny policy's config and tokenizer: the RM reads the policy's token ids
            build_tiny_model(tmp, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads, seed=seed)
        config = AutoConfig.from_pretrained(src, local_files_only=True)
        tokenizer = load_tokenizer(src)
        config.num_labels = 1
        config.architectures = ["Qwen2ForSequenceClassification"]
        config.rlgraph_task = task
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if backbone is None:
                model = Qwen2ForSequenceClassification(config)
            else:
                quiet = logging.getLogger("transformers.modeling_utils")
                no_report = _DropLoadReport()  # lm_head unused, score new: expected
                quiet.addFilter(no_report)
                try:
                    model = Qwen2ForSequenceClassification.from_pretrained(src, config=config, local_files_only=True)
                finally:
                    quiet.removeFilter(no_report)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def _wrong_answers(answer: str, rng: random.Random, k: int) -> list[str]:
    """`k` distinct wrong answers: nearby and far numbers, and some malformed strings."""
    out: list[str] = []
    tries = 0
    while len(out) < k and tries < 100 * k:
        tries += 1
        r = rng.random()
        if answer.isdigit() and r < 0.75:
            delta = rng.choice([-2, -1, 1, 2]) if r < 0.35 else rng.randint(-9, 9)
            cand = str(max(0, int(answer) + delta))
        elif r < 0.9:
            cand = "".join(rng.choice("0123456789+=") for _ in range(rng.randint(0, 3)))
        else:
            cand = answer + rng.choice("0123456789+=")
        if cand != answer and cand not in out:
            out.append(cand)
    return out


def reward_examples(tokenizer: Any, rows: Sequence[dict], negatives: int = 3,
                    seed: int = 0) -> list[tuple[list[int], list[list[int]]]]:
    """Per row of `rlgraph.ops.data.tasks.make_rows`: (correct sequence, wrong sequences), as token
    ids laid out as at RL time: the chat prompt with the generation prompt, the answer, <eos>."""
    rng = random.Random(seed)
    eos = tokenizer.eos_token_id
    out = []
    for r in rows:
        prompt = encode_prompt(tokenizer, r["prompt"])
        answer = str(r["reward_model"]["ground_truth"])

        def seq(text: str) -> list[int]:
            return prompt + list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [eos]

        out.append((seq(answer), [seq(w) for w in _wrong_answers(answer, rng, negatives)]))
    return out


def _batch(seqs: Sequence[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    mask = (torch.arange(width)[None, :] < torch.tensor([len(s) for s in seqs])[:, None]).long()
    return ids, mask


@torch.no_grad()
def pairwise_accuracy(model: Any, tokenizer: Any, examples: Sequence[tuple[list[int], list[list[int]]]]) -> float:
    """Fraction of (correct, wrong) pairs in which the correct sequence scores higher."""
    model.eval()
    right = total = 0
    for good, bads in examples:
        s = score_sequences(model, *_batch([good, *bads], tokenizer.pad_token_id))
        right += int((s[0] > s[1:]).sum())
        total += len(bads)
    return right / max(1, total)


class RMTrainMetrics(NamedTuple):
    """What `train_reward_model` did."""

    steps: int
    loss_first: float
    loss_last: float  # mean over the last 10 steps
    accuracy: float  # pairwise accuracy on held-out prompts (the task's test split)
    seconds: float
    out_dir: Path


def train_reward_model(path: str | Path, task: str = "add", steps: int = 300, seed: int = 0,
                       batch_size: int = 32, lr: float = 2e-3, train_rows: int = 512,
                       eval_rows: int = 64) -> RMTrainMetrics:
    """Train the RM in `path` in place. Each step takes `batch_size` prompts, each with its
    correct answer and two wrong ones (near or far numbers, malformed strings); the loss is
    binary cross-entropy on the logit (correct 1, wrong 0) plus the pairwise Bradley-Terry loss
    ``-log sigmoid(s_correct - s_wrong)``. AdamW, linear warm-up over 10% of steps, cosine decay. Reports pairwise
    accuracy on `eval_rows` prompts of the task's test split (prompts never trained on)."""
    from rlgraph.ops.data.tasks import make_rows

    p = Path(path).expanduser()
    tokenizer = load_tokenizer(p)
    model = load_reward_model(p).train()
    pad = tokenizer.pad_token_id
    train = reward_examples(tokenizer, make_rows(task, train_rows, seed=seed, split="train"), negatives=8, seed=seed)
    held_out = reward_examples(tokenizer, make_rows(task, eval_rows, seed=seed, split="test"), negatives=3,
                               seed=seed + 1)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, steps // 10)
    losses: list[float] = []
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for step in range(steps):
            seqs, labels = [], []
            for _ in range(batch_size):
                good, bads = train[rng.randrange(len(train))]
                seqs += [good, *rng.sample(bads, 2)]
                labels += [1.0, 0.0, 0.0]
            logits = score_sequences(model, *_batch(seqs, pad))
            # pointwise (correct > 0 > wrong, so scores compare across prompts) plus pairwise
            # (Bradley-Terry: correct above each wrong answer to the same prompt)
            bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.tensor(labels))
            s = logits.view(-1, 3)
            loss = bce - torch.nn.functional.logsigmoid(s[:, :1] - s[:, 1:]).mean()
            scale = (step + 1) / warmup if step < warmup else \
                0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
            losses.append(optimizer_step(model, opt, loss, lr * scale))
    seconds = time.perf_counter() - start
    accuracy = pairwise_accuracy(model, tokenizer, held_out)
    tmp = p.with_name(p.name + ".trained")
    shutil.rmtree(tmp, ignore_errors=True)
    model.eval().save_pretrained(tmp, safe_serialization=True)  # the loaded weights may be mmapped from p
    for f in tmp.iterdir():
        f.replace(p / f.name)
    tmp.rmdir()
    tail = losses[-10:]
    return RMTrainMetrics(steps, losses[0], sum(tail) / len(tail), accuracy, seconds, p)


def prepare_tiny_reward_model(path: str | Path, task: str = "add", steps: int = 300, seed: int = 0,
                              sft_steps: int = 150, **train: Any) -> Path:
    """Make `path` a tiny reward model trained on `task` (a no-op when a model is already there).

    As reward models usually are, it starts from a warm-started policy: a tiny causal LM gets
    `sft_steps` of `rlgraph.ops.models.sft_warmstart` on the task (so its transformer already
    computes answers), becomes a one-label classifier (`build_tiny_reward_model`), and is then
    trained for `steps` by `train_reward_model` (`train`: batch_size, lr, ...).

    Runs once per path: a file lock keeps parallel runs from racing, and the model is built in
    ``<path>.partial`` and renamed when done. Nothing is downloaded."""
    from rlgraph.ops.models import build_once, sft_warmstart
    from rlgraph.ops.data.tasks import make_rows, sft_examples

    def build(tmp: Path) -> None:
        policy = tmp.with_name(tmp.name + ".policy")
        shutil.rmtree(policy, ignore_errors=True)
        start = time.time()
        try:
            backbone = None
            if sft_steps > 0:
                build_tiny_model(policy, seed=seed)
                sft_warmstart(policy, sft_examples(make_rows(task, 2048, seed=seed, split="train")),
                              steps=sft_steps, lr=3e-3, seed=seed)
                backbone = policy
            build_tiny_reward_model(tmp, task=task, seed=seed, backbone=backbone)
        finally:
            shutil.rmtree(policy, ignore_errors=True)
        if steps > 0:
            m = train_reward_model(tmp, task=task, steps=steps, seed=seed, **train)
            print(f"rlgraph: tiny reward model for task {task!r}: {sft_steps} warm-start + {steps} RM steps, loss "
                  f"{m.loss_first:.2f} -> {m.loss_last:.2f}, held-out pairwise accuracy {m.accuracy:.0%}, "
                  f"{time.time() - start:.0f}s -> {path}", flush=True)

    return build_once(path, build)
