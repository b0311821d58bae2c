"""Test environment: the arithmetic env, rewarded by how often the reply uses chosen tokens.

A tiny random model never answers arithmetic, but its replies already contain some tokens of
any large set, so a reward on their share has a signal from the first step: the fraction of
the reply's tokens whose id is a multiple of ``TARGET_MODULUS`` (1/8 of the vocabulary, ~1/8
of a random model's tokens). A working trainer raises it within a few steps; a sign error,
an advantage/label misalignment or a masking bug does not. Runs like any env:
``python token_env.py serve ...``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from environments.arithmetic_server import ArithmeticEnv  # noqa: E402

TARGET_MODULUS = 8


def target_share(tokens: list[int], masks: list[int]) -> float:
    """Share of the reply's tokens (mask != -100) whose id is a multiple of TARGET_MODULUS."""
    reply = [t for t, m in zip(tokens, masks, strict=True) if m != -100]
    if not reply:
        return 0.0
    return sum(1 for t in reply if t % TARGET_MODULUS == 0) / len(reply)


class TokenShareEnv(ArithmeticEnv):
    """Score = share of target tokens in the reply."""

    name = "token_share"

    async def collect_trajectories(self, item):
        group, backlog = await super().collect_trajectories(item)
        group["scores"] = [
            target_share(tokens, masks)
            for tokens, masks in zip(group["tokens"], group["masks"], strict=True)
        ]
        return group, backlog


if __name__ == "__main__":
    TokenShareEnv.cli()
