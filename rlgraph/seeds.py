"""Seeds that are the same in every process: ops are seeded per (step, op, chunk), not by call order."""

from __future__ import annotations

import hashlib
from typing import Any

__all__ = ["stable_seed"]


def stable_seed(*parts: Any) -> int:
    """A 31-bit seed from `parts` that is the same in every process (unlike `hash`)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF
