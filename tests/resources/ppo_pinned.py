"""examples/ppo.py with the fixed config of tests/resources/pinned.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pinned import PPO_CONFIG, pinned  # noqa: E402

pipeline = pinned("ppo", PPO_CONFIG)
