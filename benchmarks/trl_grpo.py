"""TRL's GRPOTrainer on rlgraph's GRPO example task: the peer that `benchmarks/trl_peer.py` times.

Run as its own process (one per measured run, as `rlgraph run` is), so start-up is counted the
same way for both. Writes one JSON line per step to OUT: when the step began and ended (seconds
since the epoch), the batch's mean reward, and the seconds the step spent in each phase
(``phase_s``): sampling (``generate``), of it the decoding of the completions to text (``decode``,
its tokenizer's ``batch_decode`` inside ``_generate``), the reference model's log-probs (``ref``), the
reward function (``reward``), the whole rollout phase (``rollout``: sampling, rewards, advantages,
reference log-probs) and the rest of the step (``update``: the loss's forward and backward and
the optimizer), timed by wrapping the trainer's own methods.

    python -m benchmarks.trl_grpo --model DIR --batch 16 --steps 45 --out FILE [--seed 0]

Needs the benchmark extra: pip install 'rlgraph[bench]' (trl).
"""

from __future__ import annotations

import argparse
import json
import os
import time

T0 = time.time()  # as early as this process can tell


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="the warm-started tiny policy of examples/grpo.py")
    p.add_argument("--batch", type=int, required=True, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--t0", type=float, default=None, help="when the parent started this process")
    a = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlgraph.ops.data.tasks import make_rows
    from rlgraph.ops.models import load_causal_lm, load_tokenizer
    from rlgraph.ops.reward.functions import compute_score

    rows = make_rows("add", 1024, seed=a.seed, split="train")  # what data.task=add generates
    data = Dataset.from_list([{"prompt": list(r["prompt"]), "ground_truth": str(r["reward_model"]["ground_truth"]),
                               "data_source": r["data_source"]} for r in rows])

    def reward(completions, ground_truth, data_source, **_):
        return [float(compute_score(ds, c[0]["content"] if isinstance(c, list) else c, gt))
                for c, gt, ds in zip(completions, ground_truth, data_source)]

    steps: list[dict] = []
    phases: dict[str, float] = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            phases.clear()
            steps.append({"step": state.global_step, "t_begin": time.time()})

        def on_step_end(self, args, state, control, **kw):
            steps[-1]["t_end"] = time.time()
            step_s = steps[-1]["t_end"] - steps[-1]["t_begin"]
            steps[-1]["phase_s"] = {**phases, "update": step_s - phases.get("rollout", 0.0)}

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs and steps:
                steps[-1]["reward"] = float(logs["reward"])

    config = GRPOConfig(
        output_dir=os.path.dirname(os.path.abspath(a.out)) or ".", seed=a.seed, use_cpu=True, bf16=False,
        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, max_steps=a.steps,
        per_device_train_batch_size=a.batch * a.n, gradient_accumulation_steps=1, num_generations=a.n,
        max_completion_length=4, temperature=1.0, top_p=1.0, top_k=0,  # rollout.* of the example
        learning_rate=3e-4, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        beta=0.001, loss_type="dapo",  # actor.kl_loss_coef (k3), token-mean over the batch
        num_iterations=1, epsilon=0.2, scale_rewards="group", dataloader_num_workers=0,
    )
    tok = load_tokenizer(a.model, padding_side="left")
    trainer = GRPOTrainer(model=load_causal_lm(a.model), reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=tok, callbacks=[Clock()])
    _time_phases(trainer, phases)
    trainer.train()
    with open(a.out, "w") as f:
        f.write(json.dumps({"t0": a.t0 or T0}) + "\n")
        for s in steps:
            f.write(json.dumps(s) + "\n")


def _time_phases(trainer, phases: dict[str, float]) -> None:
    """Wrap the trainer's rollout methods so that each step's time in them adds up in `phases`."""
    def timed(name, fn, only=None):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if only is None or only(args, kwargs):
                    phases[name] = phases.get(name, 0.0) + time.perf_counter() - t
        return wrapper

    def on_ref(args, kwargs):
        return (args[0] if args else kwargs.get("model")) is trainer.ref_model

    generating = [False]

    def in_generate(fn):
        def wrapper(*args, **kwargs):
            generating[0] = True
            try:
                return fn(*args, **kwargs)
            finally:
                generating[0] = False
        return wrapper

    # the completions' decode, which TRL does in _generate and rlgraph in its reward op: counted apart,
    # so that each phase can be compared with the same work on both sides
    tok = trainer.processing_class
    tok.batch_decode = timed("decode", tok.batch_decode, lambda args, kwargs: generating[0])
    trainer._generate = timed("generate", in_generate(trainer._generate))
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = timed("ref", trainer._get_per_token_logps_and_entropies, on_ref)
    trainer._generate_and_score_completions = timed("rollout", trainer._generate_and_score_completions)


if __name__ == "__main__":
    main()
