"""``TextGameEnv``: a ``BaseEnv`` for games played through text, one model turn per action.

A game implements ``TextGame`` (reset to a seed, describe the state, parse an action from the
model's reply, step, score). ``TextGameEnv`` does the rest:

* each item is a game seed; the ``group_size`` trajectories of a group all play that seed
  (same deal, same map), so their scores are comparable;
* each trajectory is one ``ChatSession`` (``atroposlib.envs.rollout``): observation -> model
  turn -> action -> next observation ..., up to ``max_turns`` actions or the context budget,
  with every assistant turn trained on;
* ``evaluate()`` plays ``num_eval_games`` fixed seeds at temperature 0 and reports
  ``eval/success_rate``, ``eval/mean_score``, ``eval/mean_turns`` and
  ``eval/invalid_action_rate``.

Actions are read from ``Action: <name>`` (the last one in the reply) or a reply that is just
an action name; anything else is an invalid action, which the game penalises.

The bundled games (``environments/game_environments``: Taxi, Blackjack, TextWorld) build on it.
"""

from __future__ import annotations

import asyncio
import random
import re
from abc import ABC, abstractmethod
from typing import Any

from pydantic import Field

from atroposlib.envs.base import BaseEnv, ScoredDataGroup
from atroposlib.envs.config import LocalEnvConfig
from atroposlib.envs.rollout import ChatSession, group_from_trajectories
from atroposlib.envs.server_handling.server_baseline import local_server_configs

__all__ = ["TextGame", "TextGameEnv", "TextGameEnvConfig", "parse_action"]

_ACTION = re.compile(
    r"action\s*[:=]\s*\**\s*[\"'`<\[]?\s*([a-z][a-z _-]*?)\s*[\"'`>\]]?\s*\**\s*(?:$|[.\n])", re.I
)


def parse_action(text: str | None, actions: dict[str, Any]) -> Any | None:
    """The action named in ``text``: the last ``Action: <name>`` whose name is a key of
    ``actions`` (case-insensitive), or the whole reply when it is just a name; else None."""
    if not text:
        return None
    names = {k.lower(): v for k, v in actions.items()}
    for match in reversed(list(_ACTION.finditer(text))):
        name = " ".join(match.group(1).lower().replace("-", " ").replace("_", " ").split())
        if name in names:
            return names[name]
    bare = text.strip().strip(".!*`\"'").lower()
    return names.get(bare)


class TextGame(ABC):
    """One game instance played through text."""

    #: Action names the model may use -> the game's action values.
    actions: dict[str, Any]

    @abstractmethod
    def reset(self, seed: int) -> str:
        """Start the game for ``seed``; the first observation."""

    @abstractmethod
    def step(self, action: Any) -> tuple[str, bool]:
        """Apply ``action``; ``(observation, done)``."""

    @abstractmethod
    def score(self) -> float:
        """The trajectory's reward in [-1, 1] once play stopped (done or out of turns)."""

    @property
    @abstractmethod
    def success(self) -> bool:
        """Whether the game was won / solved."""

    def invalid(self, reply: str) -> tuple[str, bool]:
        """What happens on an unreadable reply: ``(observation, done)``. Default: the turn
        is lost and the model is reminded of the format."""
        return (
            "That was not a valid action. End your reply with 'Action: <name>' where <name> is "
            f"one of: {', '.join(self.actions)}.",
            False,
        )

    def describe_actions(self) -> str:
        """The action list shown in the system prompt."""
        return ", ".join(self.actions)


class TextGameEnvConfig(LocalEnvConfig):
    """Settings shared by the text game environments."""

    # a whole group often plays alike early on; keep those groups (zero advantages)
    ensure_scores_are_not_same: bool = False

    max_turns: int = Field(default=10, ge=1, description="Most actions per episode")
    max_tokens_per_turn: int = Field(default=96, ge=1, description="Generation budget per turn")
    temperature: float = Field(default=1.0, ge=0.0, description="Sampling temperature")
    seed: int = Field(default=0, description="Seed of the game seeds")
    num_eval_games: int = Field(default=20, ge=1, description="Fixed games played by evaluate()")
    invalid_action_penalty: float = Field(
        default=0.1, ge=0.0, description="Subtracted from the score per invalid action"
    )


class TextGameEnv(BaseEnv, ABC):
    """Base of the text game environments (see the module docstring)."""

    env_config_cls = TextGameEnvConfig
    default_server_configs = local_server_configs(num_requests_for_eval=8, timeout=300)
    system_prompt: str = ""

    @abstractmethod
    def make_game(self) -> TextGame:
        """A fresh game object."""

    async def setup(self) -> None:
        self.rng = random.Random(self.config.seed)
        self.eval_seeds = [
            1_000_000 + self.config.seed * 1000 + i for i in range(self.config.num_eval_games)
        ]

    async def get_next_item(self) -> dict[str, Any]:
        return {"seed": self.rng.randrange(2**31)}

    def _system(self, game: TextGame) -> str:
        return (
            self.system_prompt
            + f"\nValid actions: {game.describe_actions()}.\n"
            + "End every reply with 'Action: <name>'."
        )

    async def play(
        self, seed: int, temperature: float, split: str | None = None
    ) -> tuple[dict[str, Any] | None, dict[str, float]]:
        """One episode of the game ``seed``: ``(trajectory or None, stats)``."""
        game = self.make_game()
        first = game.reset(seed)
        messages = [
            {"role": "system", "content": self._system(game)},
            {"role": "user", "content": first},
        ]
        invalid = 0
        done = False
        extra = {"split": split} if split else {}
        async with ChatSession(
            self,
            messages,
            max_tokens_per_turn=self.config.max_tokens_per_turn,
            max_token_length=self.config.max_token_length,
            temperature=temperature,
        ) as session:
            while not done and session.turns < self.config.max_turns:
                choice = await session.generate(**extra)
                if choice is None:
                    break
                text = choice.message.content or ""
                action = parse_action(text, game.actions)
                if action is None:
                    invalid += 1
                    observation, done = game.invalid(text)
                else:
                    observation, done = game.step(action)
                session.add("user", observation)
            traj = session.trajectory()
        score = game.score() - self.config.invalid_action_penalty * invalid
        score = max(-1.0, min(1.0, score))
        stats = {
            "score": score,
            "success": float(game.success),
            "turns": float(session.turns),
            "invalid_rate": invalid / max(1, session.turns),
            "truncated": float(session.truncated or not done),
        }
        if traj is not None:
            traj["score"] = score
        return traj, stats

    async def collect_trajectories(
        self, item: dict[str, Any]
    ) -> tuple[ScoredDataGroup | None, list]:
        results = await asyncio.gather(
            *(
                self.play(item["seed"], self.config.temperature)
                for _ in range(self.config.group_size)
            )
        )
        for _, stats in results:
            for key in ("score", "success", "turns", "invalid_rate"):
                self.log_train_metric(f"train/{key}", stats[key])
        trajectories = [traj for traj, _ in results]
        group = group_from_trajectories(
            trajectories,
            [traj["score"] if traj is not None else None for traj in trajectories],
            group_size=self.config.group_size,
        )
        return group, []

    async def _eval_game(self, seed: int) -> dict[str, Any]:
        """One greedy evaluation game: its sample (``messages``, ``score``, ``correct``, stats)."""
        traj, stats = await self.play(seed, 0.0, split="eval")
        return {
            "seed": seed,
            "messages": traj["messages"] if traj else None,
            "score": stats["score"],
            "correct": bool(stats["success"]),
            "turns": stats["turns"],
            "invalid_rate": stats["invalid_rate"],
        }

    @staticmethod
    def summarize_eval(samples: list[dict[str, Any]]) -> dict[str, float]:
        """The evaluation metrics of the played games."""
        n = max(1, len(samples))
        return {
            "eval/success_rate": sum(s["correct"] for s in samples) / n,
            "eval/mean_score": sum(s["score"] for s in samples) / n,
            "eval/mean_turns": sum(s["turns"] for s in samples) / n,
            "eval/invalid_action_rate": sum(s["invalid_rate"] for s in samples) / n,
        }

    async def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        return await self.run_eval(
            [self._eval_game(seed) for seed in self.eval_seeds],
            self.summarize_eval,
            generation_parameters={
                "temperature": 0.0,
                "max_tokens": self.config.max_tokens_per_turn,
                "max_turns": self.config.max_turns,
            },
        )
