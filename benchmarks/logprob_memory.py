"""Item 14: peak memory of the log-prob op against the response length, chunked vs full logits.

A random-initialised model of Qwen2.5-0.5B's shape (24 layers, hidden 896, a 151,936-token
vocabulary; `common.qwen25_05b()`, no download) scores one sequence of a 64-token prompt and R
response tokens, R = 256 .. 8,192, with entropy, as `old_logprob` does:

- full logits: the path rlgraph had (and most trainers have): the model's ``[1, P + R, vocab]``
  float32 logits, then log-softmax and entropy over blocks of them;
- chunked: `rlgraph.ops.train.logprobs`, the decoder's hidden states and 1,024 positions of logits
  at a time (``actor.logprob_chunk_size``).

Each (path, R) runs in a fresh process; the peak is that process's peak resident memory during the
op (VmHWM reset after the model is built) minus its size before it. Both paths give the same
log-probs (checked at the shortest length).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from benchmarks import common

LENGTHS = [256, 512, 1024, 2048, 4096, 8192]
PROMPT = 64
CHUNK = 1024


def child(path: str, length: int, layers: int) -> dict[str, Any]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlgraph.ops.algos import entropy_from_logits, logprobs_from_logits
    from rlgraph.ops.train.logprobs import enable_token_logprobs, padded_layout, response_logprobs
    from rlgraph.ops.train.sequences import pack, response_logits

    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    config = Qwen2Config(**{**common.qwen25_05b(), "num_hidden_layers": layers})
    model = Qwen2ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(1)
    packed = pack([torch.randint(0, config.vocab_size, (PROMPT,), generator=g)],
                  [torch.randint(0, config.vocab_size, (length,), generator=g)], pad_id=0)
    enable_token_logprobs(model)
    before = common.reset_peak_rss()
    t0 = time.time()
    with torch.no_grad():
        if path == "full":
            logits = response_logits(model, packed, 1.0)
            logp = logprobs_from_logits(logits, packed.input_ids[:, PROMPT:])
            ent = entropy_from_logits(logits)
        else:
            logp, ent = response_logprobs(model, padded_layout(packed), 1.0, CHUNK, with_entropy=True)
    seconds = time.time() - t0
    peak = common.peak_rss() - before
    return {"path": path, "length": length, "peak_bytes": peak, "seconds": seconds,
            "logp_head": logp[0, :8].tolist(), "entropy_mean": float(ent.mean())}


def run(quick: bool = False, argv: list[str] | None = None, **_: Any) -> common.Section:
    lengths = [64, 256] if quick else LENGTHS
    layers = 2 if quick else common.qwen25_05b()["num_hidden_layers"]
    t = common.Table(["response tokens", "full logits peak MiB", "chunked peak MiB", "full / chunked",
                      "full s", "chunked s"])
    per = {}
    for n in lengths:
        full = common.run_child("benchmarks.logprob_memory", ["full", str(n), str(layers)])
        chunked = common.run_child("benchmarks.logprob_memory", ["chunked", str(n), str(layers)])
        if n == lengths[0]:  # the same numbers either way
            diff = max(abs(a - b) for a, b in zip(full["logp_head"], chunked["logp_head"]))
            assert diff < 1e-3, f"chunked log-probs differ from the full logits' by {diff}"
        per[n] = (full["peak_bytes"], chunked["peak_bytes"])
        t.add(n, full["peak_bytes"] / 2**20, chunked["peak_bytes"] / 2**20,
              full["peak_bytes"] / max(chunked["peak_bytes"], 1), full["seconds"], chunked["seconds"])
        print(f"  R={n}: full {full['peak_bytes'] / 2**20:.0f} MiB, chunked {chunked['peak_bytes'] / 2**20:.0f} MiB",
              flush=True)
    a, b = lengths[-2], lengths[-1]
    slope = {k: (per[b][i] - per[a][i]) / (b - a) for i, k in enumerate(("full", "chunked"))}
    vocab = common.qwen25_05b()["vocab_size"]
    intro = (f"Peak memory of one `old_logprob` call (log-probs and entropy, no gradient) on a random-initialised "
             f"model of Qwen2.5-0.5B's shape ({layers} layers, vocabulary {vocab:,}), one sequence of a {PROMPT}-token "
             f"prompt and R response tokens. *full logits*: the model's float32 `[1, P + R, vocab]` logits "
             f"(what rlgraph did before `actor.logprob_chunk_size`, and what most trainers do); *chunked*: "
             f"hidden states, then {CHUNK} positions of logits at a time. Each cell is a fresh process; the peak is "
             f"its peak resident memory during the call minus its size before (weights excluded).")
    notes = (f"Growth between R={a} and R={b}: full logits {slope['full'] / 1024:.0f} KiB per token (the vocabulary's "
             f"float32 logits and their temporaries: {vocab * 4 / 1024:.0f} KiB each), chunked "
             f"{slope['chunked'] / 1024:.0f} KiB per token (hidden states and activations), so both grow linearly "
             f"and the chunked path's slope is the model's, not the vocabulary's. In training "
             f"(`update_actor`) each chunk is checkpointed, so the backward pass holds one chunk's logits too.")
    return common.Section("logprob_memory", "14. Log-prob memory: chunked vs full logits", intro, [t], notes,
                          command=common.command_line(argv))


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        path, length, layers = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        print(json.dumps(child(path, length, layers)))
        return
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    print(run(quick=args.quick, argv=["logprob_memory"] + (["--quick"] if args.quick else [])).markdown())


if __name__ == "__main__":
    main()
