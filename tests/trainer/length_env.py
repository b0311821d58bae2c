"""Test environment: the arithmetic env, rewarded by reply length instead of correctness.

A tiny random model never answers arithmetic, so every group would score alike and give zero
advantages; rewarding length gives distinct scores (non-zero advantages) with any model, which
lets end-to-end tests see parameters move. Runs like any env: ``python length_env.py serve ...``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from environments.arithmetic_server import ArithmeticEnv  # noqa: E402


class LengthRewardEnv(ArithmeticEnv):
    """Score = characters in the reply / 64."""

    name = "length"

    async def collect_trajectories(self, item):
        group, backlog = await super().collect_trajectories(item)
        group["scores"] = [len(chat[-1]["content"] or "") / 64 for chat in group["messages"]]
        return group, backlog


if __name__ == "__main__":
    LengthRewardEnv.cli()
