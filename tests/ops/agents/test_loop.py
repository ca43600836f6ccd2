"""The agent loop on hand-built trajectories: exact ids, masks, log-prob positions and turns; a
masked loss equals the loss over model tokens only; failing environments end only their own
trajectory; the transformers sampler stops at a tool format's stop string."""

import threading
import time

import pytest
import torch

from rlgraph.ops.agents import Environment, Inline, ToolBox, ToolEnvironment, tool
from rlgraph.ops.agents.loop import AgentLimits, HFSampler, Trajectory, observation_ids, run_trajectories, summary
from rlgraph.ops.algos import agg_loss, masked_mean, policy_loss
from rlgraph.ops.models import char_tokenizer


class Parens(Inline):
    open, close = "(", ")"  # delimiters the default character vocabulary has


@tool
def calc(expression: str) -> str:
    """Evaluate a+b or a*b."""
    a, op, b = expression.partition("+") if "+" in expression else expression.partition("*")
    return str(int(a) + int(b) if op == "+" else int(a) * int(b))


TOK = char_tokenizer()
EOS = TOK.eos_token_id


def enc(text):
    return TOK.encode(text, add_special_tokens=False)


class Scripted:
    """A sampler that answers each trajectory with a script of turns, and checks that every history
    it is given is exactly the prompt plus the response ids so far (never re-tokenised text)."""

    def __init__(self, scripts, expect_histories):
        self.scripts = scripts  # prompt text -> list of turn texts (an "<eos>" ends with EOS)
        self.expect = expect_histories  # prompt text -> list of expected histories per turn
        self.turn = {}
        self.calls = []

    def __call__(self, histories, max_new, stop, seeds):
        self.calls.append(len(histories))
        out = []
        for h in histories:
            key = next(p for p in self.scripts if list(h[:len(enc(p))]) == enc(p))
            k = self.turn.get(key, 0)
            self.turn[key] = k + 1
            assert list(h) == self.expect[key][k], (key, k, TOK.decode(h))
            text = self.scripts[key][k]
            ids = enc(text.replace("<eos>", "")) + ([EOS] if text.endswith("<eos>") else [])
            out.append((ids[:max_new], [-(j + 1) / 100 for j in range(len(ids[:max_new]))]))
        return out


def _tool_env():
    return ToolEnvironment(Parens(), ToolBox([calc]))


def test_a_tool_trajectory_is_the_sampled_ids_and_the_observation_ids_exactly():
    prompt = enc("12*3=")
    call, answer = "(calc 12*3)", "36<eos>"
    obs = enc("=36)")
    sampler = Scripted({"12*3=": [call, answer]},
                       {"12*3=": [prompt, prompt + enc(call) + obs]})
    t = Trajectory(0, prompt, _tool_env())
    done = list(run_trajectories([t], [[0]], sampler, TOK, AgentLimits(max_turns=4, max_turn_tokens=32), Parens().stop,
                                 seed=0))
    assert done == [[0]]
    model1, model2 = enc(call), enc("36") + [EOS]
    assert t.response == model1 + obs + model2
    assert t.mask == [1] * len(model1) + [0] * len(obs) + [1] * len(model2)
    assert t.turn_ids == [0] * (len(model1) + len(obs)) + [1] * len(model2)
    # the sampler's log-probs sit on the model tokens they belong to; observations carry 0
    assert t.log_probs == ([-(j + 1) / 100 for j in range(len(model1))] + [0.0] * len(obs)
                           + [-(j + 1) / 100 for j in range(len(model2))])
    assert t.turns == 2 and t.tool_calls == 1 and not t.truncated and t.done


def test_observations_are_tokenised_on_their_own():
    assert observation_ids(TOK, "=36)") == enc("=36)")
    assert observation_ids(TOK, "") == []


def test_a_masked_loss_equals_the_loss_over_model_tokens_only():
    """The PPO loss, the token-mean aggregation and the entropy/KL means over a trajectory whose
    observation tokens carry garbage equal the same over its model tokens alone."""
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 1, 1], [1, 0, 0, 1, 1, 1, 0, 0]])
    logp, old = torch.randn(2, 8), torch.randn(2, 8)
    adv = torch.randn(2, 8)
    garbage = (mask == 0)
    adv_g, old_g = adv.masked_fill(garbage, 1e6), old.masked_fill(garbage, -1e6)
    masked = policy_loss(logp, old_g, adv_g, mask, clip_ratio_c=3.0)
    keep = mask.bool()
    ones = torch.ones(1, int(keep.sum()))
    only = policy_loss(logp[keep][None], old[keep][None], adv[keep][None], ones, clip_ratio_c=3.0)
    assert torch.allclose(masked.loss, only.loss, atol=1e-6)
    assert torch.allclose(agg_loss(-logp * adv_g, mask, "token-mean"), agg_loss(-logp[keep][None] * adv[keep][None],
                                                                                ones, "token-mean"), atol=1e-6)
    ent = torch.rand(2, 8).masked_fill(garbage, 1e6)
    assert torch.allclose(masked_mean(ent, mask), ent[keep].mean(), atol=1e-6)


def test_the_budget_cuts_an_observation_and_marks_the_trajectory_truncated():
    prompt = enc("2+2=")
    call = "(calc 2+2)"
    sampler = Scripted({"2+2=": [call]}, {"2+2=": [prompt]})
    t = Trajectory(0, prompt, _tool_env())
    limits = AgentLimits(max_turns=4, max_turn_tokens=32, max_response_tokens=len(enc(call)) + 2)
    list(run_trajectories([t], [[0]], sampler, TOK, limits, (")",), seed=0))
    assert t.truncated and t.done and len(t.response) == limits.max_response_tokens
    assert t.mask[-2:] == [0, 0]  # two of the observation's tokens fit


class Exploding(Environment):
    def step(self, action):
        raise RuntimeError("boom")


class Hanging(Environment):
    def step(self, action):
        time.sleep(5)
        return "late", 0.0, False, {}


class Echo(Environment):
    """Feedback each turn; reward 1 once the model says 'yes'."""

    def reset(self, row):
        return ""

    def step(self, action):
        return ("ok", 1.0, True, {}) if "yes" in action else ("again", 0.0, False, {})


def test_a_failing_or_hanging_environment_ends_only_its_own_trajectory_and_holds_no_one():
    prompts = {"a=": ["no", "yes<eos>"], "b=": ["no"], "c=": ["no"]}
    hist = {"a=": [enc("a="), enc("a=") + enc("no") + enc("again")], "b=": [enc("b=")], "c=": [enc("c=")]}
    sampler = Scripted(prompts, hist)
    trajs = [Trajectory(0, enc("a="), Echo()), Trajectory(1, enc("b="), Exploding()), Trajectory(2, enc("c="), Hanging())]
    t0 = time.monotonic()
    done = list(run_trajectories(trajs, [[0], [1], [2]], sampler, TOK,
                                 AgentLimits(max_turns=3, max_turn_tokens=8, env_timeout_s=0.5), (), seed=0))
    assert time.monotonic() - t0 < 4  # the hanging step was not waited for
    # the failing one ends at once; the echo plays its second turn while the hanging one is waited
    # for, and ends before that one is given up on
    assert done == [[1], [0], [2]]
    assert "boom" in trajs[1].env_error and "env_timeout_s" in trajs[2].env_error
    assert trajs[0].reward == 1.0 and trajs[0].turns == 2 and not trajs[0].env_error
    m = summary(trajs, [True, True, True])
    assert m["env_errors"] == 2.0 and m["turns_mean"] == pytest.approx(4 / 3)


def test_turns_of_all_open_trajectories_are_one_batch():
    prompts = {f"{c}=": ["no", "yes<eos>"] for c in "abcd"}
    hist = {p: [enc(p), enc(p) + enc("no") + enc("again")] for p in prompts}
    sampler = Scripted(prompts, hist)
    trajs = [Trajectory(i, enc(p), Echo()) for i, p in enumerate(prompts)]
    list(run_trajectories(trajs, [[0, 1], [2, 3]], sampler, TOK, AgentLimits(max_turns=3, max_turn_tokens=8), (),
                          seed=0))
    assert sampler.calls == [4, 4]  # two turns, each one call for the four trajectories


def test_the_transformers_sampler_stops_each_row_at_the_stop_string(tmp_path):
    from rlgraph.ops.models import build_tiny_model, load_causal_lm

    path = build_tiny_model(tmp_path / "m", seed=0)
    model = load_causal_lm(str(path))
    sampler = HFSampler(model, TOK, temperature=1.0, top_p=1.0, top_k=0)
    hist = [enc("1+2="), enc("33*4=")]
    outs = sampler(hist, 24, (")",), seeds=[3, 4])
    for ids, lps in outs:
        assert len(ids) == len(lps) <= 24
        text = TOK.decode(ids)
        if ")" in text:  # cut right after the stop string, nothing sampled past it kept
            assert text.endswith(")") and text.count(")") == 1
        assert all(lp <= 0 for lp in lps)
    again = sampler(hist, 24, (")",), seeds=[3, 4])
    assert [o[0] for o in outs] == [o[0] for o in again]  # seeded
    # a row draws the same whatever shares its batch: alone, or after a longer history
    assert sampler(hist[1:], 24, (")",), seeds=[4])[0][0] == outs[1][0]
    assert sampler([enc("5*5=1111"), hist[0]], 24, (")",), seeds=[9, 3])[1][0] == outs[0][0]


def test_tools_run_concurrently_up_to_the_limit():
    running, peak, lock = [0], [0], threading.Lock()

    @tool
    def slow(x: str) -> str:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.2)
        with lock:
            running[0] -= 1
        return x

    box = ToolBox([slow], concurrency=2)
    from rlgraph.ops.agents import ToolCall

    threads = [threading.Thread(target=box.run, args=(ToolCall("slow", {"x": "1"}),)) for _ in range(5)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert peak[0] == 2 and box.counts.calls == 5
