"""Shared fixtures for the compiler-pass tests: the example pipelines with the fixed configs of
tests/resources/pinned.py (the examples' own defaults are tuned for learning and may change)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlgraph.graph.dsl import Pipeline
from rlgraph.graph.loader import load_pipeline

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def ppo() -> Pipeline:
    """examples/ppo.py: GAE with a critic; groups actor, critic, reward, advantage (dp=1 each)."""
    return load_pipeline(str(REPO / "tests" / "resources" / "ppo_pinned.py"))[0]


@pytest.fixture(scope="session")
def grpo() -> Pipeline:
    """examples/grpo.py: no critic, group-wise advantage, KL loss against the reference."""
    return load_pipeline(str(REPO / "tests" / "resources" / "grpo_pinned.py"))[0]
