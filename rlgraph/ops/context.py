"""Helpers over the `OpContext` an op body receives, shared by every family of ops.

Torch-free, so a reward or data body can use them without pulling in the training code.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["section"]


def section(ctx: Any, name: str) -> Mapping[str, Any]:
    """The ``name.*`` part of the resolved config (empty if the pipeline has none); for setup."""
    return (ctx.config or {}).get(name, {}) if ctx is not None else {}
