"""Small tasks in verl's data layout, for a tiny character-level model learning on CPU.

Each row is what verl's dataset files hold::

    {"prompt": [{"role": "user", "content": "3+4="}],
     "data_source": "add",
     "reward_model": {"style": "rule", "ground_truth": "7"},
     "extra_info": {"split": "train", "index": 0, "a": 3, "b": 4}}

Answers are one or two characters, so a 2-layer, 64-wide model can learn them in minutes:

- ``add``: ``"3+4="`` -> ``"7"``; single-digit operands, sums 0-18; 100 distinct prompts
  (76 train, 24 test). The task for RL demos: measured on 2 CPU cores with the default tiny
  model, 100 warm-start steps (`rlgraph.ops.models.sft_warmstart`, ~1.5 s) leave it right
  ~30% of the time at temperature 1 (~65% greedy), and 300 GRPO steps of 16 prompts x 8
  samples at lr 3e-4 (~17 s of plain PyTorch) raise that to ~65%, held-out prompts included.
- ``count``: ``"count a in abcab"`` -> ``"2"``; letters from ``abc``, 3-8 letters long. Harder:
  300 warm-start steps reach ~30% (sampled) and RL gains little in minutes; use it to see a
  pipeline run, not to see learning.
- ``mul``: ``"47*8="`` -> ``"376"``: beyond the tiny model unaided; the agent example's model
  learns to ask a calculator tool (examples/agent_tools.py).
- ``guess``: ``"guess 1234:"``, a hidden digit 1-9 (the ground truth) found by guessing, an
  environment answering higher or lower (examples/agent_guess.py).

Train and test prompts are disjoint: a prompt belongs to the test split when a stable hash of
its text is 0 mod 5 (about a fifth of the prompt space), so held-out accuracy measures
generalisation, not recall. Generation is deterministic for a (task, split, seed).

The rule-based scorers live in `rlgraph.ops.reward.functions` (exact match of the parsed answer).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Literal, Mapping, Sequence

__all__ = ["Task", "TASKS", "TASK_CHARS", "make_rows", "write_task", "sft_examples"]

Split = Literal["train", "test"]


@dataclass(frozen=True)
class Task:
    """A task: its name (the rows' ``data_source``), the characters its prompts and answers use,
    and a generator of one ``(content, answer, info)`` example from a seeded `random.Random`."""

    name: str
    doc: str
    chars: str
    example: Callable[[random.Random], tuple[str, str, dict[str, Any]]]


def _add(rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    a, b = rng.randrange(10), rng.randrange(10)
    return f"{a}+{b}=", str(a + b), {"a": a, "b": b}


def _count(rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    letter = rng.choice("abc")
    word = "".join(rng.choice("abc") for _ in range(rng.randint(3, 8)))
    return f"count {letter} in {word}", str(word.count(letter)), {"letter": letter, "word": word}


def _mul(rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    a, b = rng.randrange(10, 100), rng.randrange(2, 10)
    return f"{a}*{b}=", str(a * b), {"a": a, "b": b}


def _guess(rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    game, target = rng.randrange(10000), rng.randint(1, 9)
    return f"guess {game}:", str(target), {"game": game}


TASKS: Mapping[str, Task] = MappingProxyType({
    "add": Task("add", "sum of two digits: '3+4=' -> '7' (answers 0-18)", "0123456789+=", _add),
    "count": Task("count", "occurrences of a letter: 'count a in abcab' -> '2'", "0123456789abcotuni ", _count),
    "mul": Task("mul", "a two-digit times a one-digit number: '47*8=' -> '376' (for a calculator tool)",
                "0123456789*=", _mul),
    "guess": Task("guess", "a hidden digit 1-9 to find by guessing, told higher or lower (an environment task)",
                  "0123456789guess :", _guess),
})

# every character a built-in task's prompt or answer uses (all within models.DEFAULT_CHARS)
TASK_CHARS = "".join(sorted(set("".join(t.chars for t in TASKS.values()))))


def _in_test_split(content: str) -> bool:
    return hashlib.sha256(content.encode()).digest()[0] % 5 == 0


def _task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; the built-in tasks are {', '.join(sorted(TASKS))}")
    return TASKS[name]


def make_rows(name: str, num_rows: int, seed: int = 0, split: Split = "train") -> list[dict[str, Any]]:
    """`num_rows` rows of task `name` in verl's layout, drawn (with repeats) from the prompts of
    `split`; the same arguments give the same rows."""
    task = _task(name)
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r}; use 'train' or 'test'")
    rng = random.Random(f"{name}/{split}/{seed}")
    rows: list[dict[str, Any]] = []
    while len(rows) < num_rows:
        content, answer, info = task.example(rng)
        if _in_test_split(content) != (split == "test"):
            continue
        rows.append({
            "prompt": [{"role": "user", "content": content}],
            "data_source": name,
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": len(rows), **info},
        })
    return rows


def write_task(name: str, out_path: str | Path, num_rows: int, seed: int = 0, split: Split = "train") -> Path:
    """Write `make_rows(...)` to a ``.parquet`` or ``.jsonl`` file (chosen by the extension)."""
    rows = make_rows(name, num_rows, seed, split)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        # nested fields (prompt messages, reward_model, extra_info) become structs, as in verl's files
        pq.write_table(pa.Table.from_pylist(rows), out)
    elif out.suffix in (".jsonl", ".json"):
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        raise ValueError(f"cannot write {str(out)!r}: use a .parquet or .jsonl file name")
    return out


def sft_examples(rows: Sequence[Mapping[str, Any]]) -> list[tuple[list[dict], str]]:
    """``(prompt_messages, answer)`` pairs for `rlgraph.ops.models.sft_warmstart`."""
    return [(list(r["prompt"]), str(r["reward_model"]["ground_truth"])) for r in rows]
