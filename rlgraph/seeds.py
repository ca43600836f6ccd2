"""Seeds that are the same in every process: ops are seeded per (step, op, chunk), not by call order."""

from __future__ import annotations

from typing import Any

# CPython's own SHA-256, the digest OpenSSL's gives, without OpenSSL's lookup of the algorithm on each
# call: every op call takes a seed, 13 -> 7 us a call with the caches cold (as after a model's forward)
try:
    from _sha256 import sha256
except ImportError:  # Python 3.12 on
    try:
        from _sha2 import sha256
    except ImportError:  # a build without them
        from hashlib import sha256

__all__ = ["stable_seed"]


def stable_seed(*parts: Any) -> int:
    """A 31-bit seed from `parts` that is the same in every process (unlike `hash`)."""
    digest = sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF
