"""Reward functions with verl's signature that misbehave on purpose (for the reward-serving tests).

"Odd" samples are those whose ground truth (an integer, from the ``add`` task) is odd.
"""

import asyncio
import time

from rlgraph.ops.reward.functions import compute_score


def raise_on_odd(data_source, solution_str, ground_truth, extra_info=None):
    if int(ground_truth) % 2:
        raise ValueError(f"odd ground truth {ground_truth}")
    return compute_score(data_source, solution_str, ground_truth, extra_info)


def stall_on_odd(data_source, solution_str, ground_truth, extra_info=None):
    if int(ground_truth) % 2:
        time.sleep(30)
    return compute_score(data_source, solution_str, ground_truth, extra_info)


def slow(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.05)
    return {"score": compute_score(data_source, solution_str, ground_truth, extra_info), "slow": 1.0}


async def async_stall_on_odd(data_source, solution_str, ground_truth, extra_info=None):
    if int(ground_truth) % 2:
        await asyncio.sleep(30)
    await asyncio.sleep(0.01)
    return compute_score(data_source, solution_str, ground_truth, extra_info)


def not_a_number(data_source, solution_str, ground_truth, extra_info=None):
    return "high"


def slow_in_process(data_source, solution_str, ground_truth, extra_info=None):
    """Half a second per sample (time for a test to kill the scoring process from outside)."""
    time.sleep(0.5)
    return compute_score(data_source, solution_str, ground_truth, extra_info)


def crash_on_odd(data_source, solution_str, ground_truth, extra_info=None):
    """Kills its own process on odd samples, as a segfault or the OOM killer would."""
    import os
    import signal

    if int(ground_truth) % 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return compute_score(data_source, solution_str, ground_truth, extra_info)


CALLS: dict[str, int] = {}  # ground truth -> calls of `counted` (the scorer tests read it)


def counted(data_source, solution_str, ground_truth, extra_info=None):
    """Counts its calls by ground truth; sleeps 2 ms, and 0.5 s where the ground truth is 3 modulo 7."""
    CALLS[ground_truth] = CALLS.get(ground_truth, 0) + 1
    time.sleep(0.5 if int(ground_truth) % 7 == 3 else 0.002)
    return compute_score(data_source, solution_str, ground_truth, extra_info)


SCORED_ON: list = []  # (thread name, ground truth) of each sample `where_scored` scored
DELAY_S = [0.0]  # `where_scored`'s time per sample (a test slows it down mid-way)


def where_scored(data_source, solution_str, ground_truth, extra_info=None):
    import threading

    SCORED_ON.append((threading.current_thread().name, ground_truth))
    if DELAY_S[0]:
        time.sleep(DELAY_S[0])
    if ground_truth == "boom":
        raise ValueError("boom")
    return compute_score(data_source, solution_str, ground_truth, extra_info)


MIXED = {"half": 0.5, "one": 1, "dict": {"score": 0.25, "k": 1.0}, "nan": float("nan"), "str": "high",
         "big": 1e308, "true": True}


def mixed(data_source, solution_str, ground_truth, extra_info=None):
    """What `MIXED` gives for the ground truth (every kind of value a function may return); raises on "raise"."""
    if ground_truth == "raise":
        raise ValueError("asked to")
    return MIXED[ground_truth]
