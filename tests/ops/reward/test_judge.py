"""The generative judge (stages.reward_model(kind="generative")): templates, parsing, time-outs, retries and
unparsable answers counted and handled by on_error; a real HTTP endpoint, and the tiny model as a vLLM judge."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import rlgraph
from rlgraph import Cluster, Pipeline, PipelineError, WorkerGroup
from rlgraph.ops import stages
from rlgraph.ops.models import char_tokenizer
from rlgraph.ops.reward.judge import JudgeError, JudgeWorker, ask_openai, parse_score
from rlgraph.runtime.invoke import OpContext


class _Endpoint(BaseHTTPRequestHandler):
    """An OpenAI-compatible /chat/completions whose answer depends on the question: 'slow' sleeps past the
    client's deadline, 'flaky' fails with 503 twice per question, 'junk' answers without a score."""

    calls: dict[str, int] = {}

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        q = body["messages"][0]["content"]
        _Endpoint.calls[q] = _Endpoint.calls.get(q, 0) + 1
        if "slow" in q:
            time.sleep(1.0)
        if "flaky" in q and _Endpoint.calls[q] <= 2:
            self.send_response(503)
            self.end_headers()
            return
        if "bad-request" in q:
            self.send_response(400)
            self.end_headers()
            return
        answer = "I cannot tell." if "junk" in q else f"Score: {len(q) % 10}"
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": answer}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address):  # a client that gave up on 'slow' closed its socket: expected
        pass


@pytest.fixture(scope="module")
def endpoint():
    server = _Server(("127.0.0.1", 0), _Endpoint)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_parse_score():
    assert parse_score("ok. Score: 7", r"Score:\s*(-?\d+(?:\.\d+)?)", 10) == 0.7
    assert parse_score("Score: 7.5 then Score: 2", r"Score:\s*(-?\d+(?:\.\d+)?)", 10) == 0.75  # the first match
    assert parse_score("no number", r"Score:\s*(\d+)", 10) is None


def test_retries_time_outs_and_bad_requests(endpoint):
    ok = ask_openai(endpoint, "m", "flaky question", max_tokens=8, temperature=0, timeout_s=5, retries=2)
    assert ok.problem == "" and ok.retries == 2 and ok.answer.startswith("Score: ")
    gave_up = ask_openai(endpoint, "m", "flaky again", max_tokens=8, temperature=0, timeout_s=5, retries=1)
    assert gave_up.problem == "error: HTTP 503 from " + endpoint + "/chat/completions" and gave_up.retries == 1
    slow = ask_openai(endpoint, "m", "slow question", max_tokens=8, temperature=0, timeout_s=0.2, retries=1)
    assert slow.problem == "timeout" and slow.retries == 1
    bad = ask_openai(endpoint, "m", "bad-request", max_tokens=8, temperature=0, timeout_s=5, retries=3)
    assert bad.problem.startswith("error: HTTP 400") and bad.retries == 0  # not retried: it would fail again


def _texts(*responses):
    tok = char_tokenizer()
    prompts = [tok.encode(f"{k}+{k}=") for k in range(len(responses))]
    resp = [tok.encode(r) for r in responses]
    P, R = max(map(len, prompts)), max(map(len, resp))
    p = torch.zeros(len(prompts), P, dtype=torch.long)
    r = torch.zeros(len(resp), R, dtype=torch.long)
    for i, (a, b) in enumerate(zip(prompts, resp)):
        p[i, :len(a)] = torch.tensor(a)
        r[i, :len(b)] = torch.tensor(b)
    return p, r, [len(a) for a in prompts], [len(b) for b in resp]


def _judge(config, prompt_len, response_len, padding=None):
    w = JudgeWorker()
    ctx = OpContext(op="judge", group="j", rank=0, dp=1, step=0, chunk=0, seed=0, rows=tuple(range(len(response_len))),
                    is_padding=tuple(padding or [False] * len(response_len)),
                    config={"judge": config, "data": {"tokenizer": "char"}},
                    lengths={"prompt_len": tuple(prompt_len), "response_len": tuple(response_len)},
                    outputs=("rm_scores", "reward_model_metrics"), can_drop=True)
    w.setup(ctx)
    return w, ctx


def test_an_endpoint_judges_and_every_problem_is_counted(endpoint):
    prompts, responses, pl, rl = _texts("4", "junk", "slow", "flaky", "6")
    cfg = {"backend": "openai", "url": endpoint, "model": "judge", "timeout_s": 0.3, "retries": 0,
           "template": "Q: {prompt} A: {response} (truth {ground_truth})", "on_error": "zero"}
    w, ctx = _judge(cfg, pl, rl, padding=[False, False, False, False, True])
    out = w.compute_judge_score(prompts, responses, (responses != 0).long(), ["0", "2", "4", "6", "8"], ctx=ctx)
    m = out["reward_model_metrics"]
    # 4 real samples: '4' graded, 'junk' unparsable, 'slow' timed out, 'flaky' failed (503, no retries left)
    assert m == {"judged_count": 4.0, "unparsable_count": 1.0, "timeout_count": 1.0, "error_count": 1.0,
                 "retries": 0.0}
    q0 = "Q: 0+0= A: 4 (truth 0)"
    assert out["rm_scores"][0, 0] == pytest.approx((len(q0) % 10) / 10)  # the parse of the endpoint's answer
    assert out["rm_scores"][1:].abs().sum() == 0  # on_error=zero; the padding row is never asked


def test_on_error_fail_names_the_answer_and_drop_group_drops(endpoint):
    prompts, responses, pl, rl = _texts("junk", "5")
    base = {"backend": "openai", "url": endpoint, "model": "judge", "template": "{response}"}
    w, ctx = _judge({**base, "on_error": "fail"}, pl, rl)
    with pytest.raises(JudgeError, match=r"could not grade 1 of 2 samples: row 0: unparsable \(answer 'I cannot tell.'\)"):
        w.compute_judge_score(prompts, responses, (responses != 0).long(), ["", ""], ctx=ctx)
    w, ctx = _judge({**base, "on_error": "drop_group"}, pl, rl)
    w.compute_judge_score(prompts, responses, (responses != 0).long(), ["", ""], ctx=ctx)
    assert ctx.dropped == {0: ("judge_unparsable", True)}


def test_a_judge_declaration_is_checked(endpoint):
    def pipeline(**judge):
        return Pipeline(name="j", source=stages.prompt_source(),
                        ops=[stages.generate(), stages.reward_model(kind="generative", score_column="token_level_scores",
                                                                    group="judge"),
                             stages.old_logprob(), stages.advantage("grpo", group="adv"), stages.update_actor()],
                        groups=[WorkerGroup("actor"), WorkerGroup("judge"), WorkerGroup("adv")],
                        cluster=Cluster(num_nodes=1, cpus_per_node=8), config={"judge": judge, "data": {"tokenizer":
                                                                                                          "char"}})
    with pytest.raises(PipelineError, match=r"judge.backend=openai needs judge.url and judge.model"):
        rlgraph.compile(pipeline(backend="openai"))
    with pytest.raises(PipelineError, match=r"judge.template names \['answer'\]"):
        rlgraph.compile(pipeline(backend="openai", url=endpoint, model="m", template="{answer}"))
    with pytest.raises(PipelineError, match=r"judge.score_pattern='Score: \\\\d' has no group"):
        rlgraph.compile(pipeline(backend="openai", url=endpoint, model="m", score_pattern=r"Score: \d"))
    plan = rlgraph.compile(pipeline(backend="openai", url=endpoint, model="m"))
    assert "reward_model" in [o.name for o in plan.ops]
    with pytest.raises(rlgraph.DeclarationError, match="kind='generativ'"):
        stages.reward_model(kind="generativ")


@pytest.mark.vllm
def test_the_tiny_model_as_a_vllm_judge(tmp_path):
    """The addition model judges through a template it can answer ('{ground_truth}+0='): the score parsed from
    each answer is the number the same model writes when transformers decodes it greedily."""
    pytest.importorskip("vllm", reason="vLLM is not installed: bash scripts/setup.sh --vllm=cpu")
    from rlgraph.ops.models import encode_prompt, load_causal_lm, load_tokenizer
    from rlgraph.ops.tiny import prepare_tiny_policy

    judge = str(prepare_tiny_policy(str(tmp_path / "judge"), "add", sft_steps=100))
    truths = ["3", "7", "12", "5"]
    prompts, responses, pl, rl = _texts("a", "b", "c", "d")
    w, ctx = _judge({"backend": "vllm", "model_path": judge, "template": "{ground_truth}+0=",
                     "score_pattern": r"(\d+)", "score_scale": 1.0, "max_new_tokens": 4, "on_error": "zero"}, pl, rl)
    try:
        out = w.compute_judge_score(prompts, responses, (responses != 0).long(), truths, ctx=ctx)
    finally:
        w.close()
    model, tok = load_causal_lm(judge), load_tokenizer(judge)
    expected = []
    for t in truths:
        ids = torch.tensor([encode_prompt(tok, [{"role": "user", "content": f"{t}+0="}])])
        new = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1]:]
        expected.append(parse_score(tok.decode(new, skip_special_tokens=True), r"(\d+)", 1.0))
    got = [float(out["rm_scores"][i, rl[i] - 1]) for i in range(4)]
    m = out["reward_model_metrics"]
    assert m["judged_count"] == 4 and m["unparsable_count"] == sum(e is None for e in expected)
    assert got == [e if e is not None else 0.0 for e in expected]
    assert sum(e is not None for e in expected) >= 3  # the warm-started model answers these
