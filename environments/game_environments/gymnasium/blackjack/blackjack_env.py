"""Blackjack (gymnasium ``Blackjack-v1``) played through text, one model turn per decision.

Each turn the model sees its hand total (and whether it holds a usable ace) and the dealer's
showing card, and ends its reply with ``Action: hit`` or ``Action: stick``. All trajectories
of a group play the same seed, so the same cards come for the same decisions.

Reward per trajectory: the game's outcome, +1 win, 0 draw, -1 loss (+1.5 for a natural with
``--env.natural true``); an unreadable reply forfeits the hand (-1), and
``invalid_action_penalty`` applies as in every text game; clipped to [-1, 1].

    python environments/game_environments/gymnasium/blackjack/blackjack_env.py serve
    python environments/game_environments/gymnasium/blackjack/blackjack_env.py process --env.total_steps 4
    python environments/game_environments/gymnasium/blackjack/blackjack_env.py evaluate
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
from pydantic import Field

from atroposlib.envs.text_game_env import TextGame, TextGameEnv, TextGameEnvConfig

ACTIONS = {"stick": 0, "stand": 0, "hit": 1}


def describe(obs: tuple[int, int, int]) -> str:
    """The state as a sentence: ``(player_sum, dealer_card, usable_ace)``."""
    total, dealer, ace = obs
    card = "an ace" if dealer == 1 else f"a {dealer}"
    soft = " (soft: you hold an ace counted as 11)" if ace else ""
    return f"Your hand totals {total}{soft}. The dealer shows {card}."


class BlackjackGame(TextGame):
    """One ``Blackjack-v1`` hand with a text view."""

    actions = ACTIONS

    def __init__(self, natural: bool = False, sab: bool = False) -> None:
        self.env = gym.make("Blackjack-v1", natural=natural, sab=sab)
        self.reward = 0.0
        self.done = False
        self.forfeit = False

    def reset(self, seed: int) -> str:
        obs, _ = self.env.reset(seed=seed)
        return "New hand. " + describe(obs) + " Hit or stick?"

    def step(self, action: Any) -> tuple[str, bool]:
        obs, reward, terminated, truncated, _ = self.env.step(action)
        self.done = bool(terminated or truncated)
        if not self.done:
            return describe(obs) + " Hit or stick?", False
        self.reward = float(reward)
        outcome = "You win" if reward > 0 else "Draw" if reward == 0 else "You lose"
        return f"{describe(obs)} Hand over: {outcome} ({reward:+g}).", True

    def invalid(self, reply: str) -> tuple[str, bool]:
        self.forfeit = True
        self.done = True
        self.reward = -1.0
        return "No valid action (end with 'Action: hit' or 'Action: stick'): hand forfeited.", True

    def describe_actions(self) -> str:
        return "hit, stick"

    def score(self) -> float:
        return self.reward if self.done else -1.0

    @property
    def success(self) -> bool:
        return self.done and self.reward > 0


class BlackjackEnvConfig(TextGameEnvConfig):
    """Blackjack settings."""

    natural: bool = Field(default=False, description="Pay 1.5 for a natural blackjack")
    sab: bool = Field(default=False, description="Sutton & Barto rules")


class BlackjackEnv(TextGameEnv):
    """Blackjack-v1 through text, one turn per decision."""

    name = "blackjack"
    env_config_cls = BlackjackEnvConfig
    system_prompt = (
        "You are playing blackjack against a dealer. Get a hand total closer to 21 than the "
        "dealer without going over. 'hit' takes a card, 'stick' ends your turn. Think briefly."
    )

    def make_game(self) -> BlackjackGame:
        return BlackjackGame(natural=self.config.natural, sab=self.config.sab)


if __name__ == "__main__":
    BlackjackEnv.cli()
