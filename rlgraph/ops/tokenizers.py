"""Whether two model directories tokenize the same way, read from their tokenizer files (torch-free).

Distillation scores the student's sampled token ids under a teacher: with another tokenizer the
same ids are other text, and the teacher's log-probs mean nothing. `tokenizer_mismatch` compares
what decides the ids: the vocabulary (token -> id) and the added (special) tokens of
``tokenizer.json``, or ``vocab.json`` / ``merges.txt`` for a directory without one. It reads JSON
only, so compiling a pipeline (which calls it) stays free of torch and transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["tokenizer_mismatch", "tokenizer_fingerprint"]


def tokenizer_fingerprint(path: str | Path) -> dict[str, Any] | None:
    """The parts of a directory's tokenizer that decide token ids, or None when it has no tokenizer
    files rlgraph can read (not built yet, or a format other than these)."""
    p = Path(path).expanduser()
    tj = p / "tokenizer.json"
    if tj.is_file():
        data = json.loads(tj.read_text())
        model = data.get("model") or {}
        vocab = model.get("vocab")
        if isinstance(vocab, list):  # unigram: [token, score] pairs, the id is the position
            vocab = {str(tok[0]): i for i, tok in enumerate(vocab)}
        added = {str(t["content"]): int(t["id"]) for t in data.get("added_tokens", [])}
        return {"vocab": vocab or {}, "merges": model.get("merges"), "added": added}
    vj = p / "vocab.json"
    if vj.is_file():
        merges = (p / "merges.txt").read_text() if (p / "merges.txt").is_file() else None
        return {"vocab": json.loads(vj.read_text()), "merges": merges, "added": {}}
    return None


def tokenizer_mismatch(a: str | Path, b: str | Path) -> str | None:
    """Why `a` and `b` give other token ids for the same text (a short reason), or None when they agree
    or either cannot be read yet (the worker checks again when it starts)."""
    fa, fb = tokenizer_fingerprint(a), tokenizer_fingerprint(b)
    if fa is None or fb is None:
        return None
    if fa["vocab"] != fb["vocab"]:
        only = sorted(set(fa["vocab"]) ^ set(fb["vocab"]))
        moved = [t for t in set(fa["vocab"]) & set(fb["vocab"]) if fa["vocab"][t] != fb["vocab"][t]]
        return (f"vocabularies of {len(fa['vocab'])} and {len(fb['vocab'])} tokens"
                + (f", {len(only)} in one only (e.g. {only[:3]})" if only else "")
                + (f", {len(moved)} with other ids" if moved else ""))
    if fa["merges"] != fb["merges"]:
        return "the same vocabulary with other merges"
    if fa["added"] != fb["added"]:
        diff = sorted(set(fa["added"].items()) ^ set(fb["added"].items()))
        return f"other special tokens ({diff[:3]})"
    return None
