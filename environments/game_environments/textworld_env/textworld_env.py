"""TextWorld text adventures, generated offline, played one command per turn.

Games come from ``textworld==1.7.0``'s generator (no download): ``num_games`` seeded games of
``nb_rooms`` rooms, ``nb_objects`` objects and a quest of ``quest_length`` steps, compiled once
into ``games_dir`` (about 3 s each, cached across runs). Item seeds map onto that pool, so
every trajectory of a group plays the same game.

Each turn the model sees the room description (or the last feedback), the objective and the
admissible commands, and ends with ``Action: <command>``. Reward: 1.0 when the quest is won,
else ``2 * score / max_score - 1`` (progress through the quest), -1.0 when lost; minus
``invalid_action_penalty`` per unreadable or inadmissible command; clipped to [-1, 1].

    python environments/game_environments/textworld_env/textworld_env.py process --env.total_steps 4
    python environments/game_environments/textworld_env/textworld_env.py evaluate --env.num_eval_games 10
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import textworld
from pydantic import Field

from atroposlib.envs.text_game_env import TextGame, TextGameEnv, TextGameEnvConfig

DEFAULT_GAMES_DIR = Path.home() / ".cache" / "atroposlib" / "textworld"
_INFOS = textworld.EnvInfos(
    admissible_commands=True, max_score=True, score=True, won=True, lost=True,
    description=True, objective=True, policy_commands=True,
)  # fmt: skip


def make_game_file(
    seed: int, games_dir: Path, nb_rooms: int = 2, nb_objects: int = 3, quest_length: int = 2
) -> Path:
    """The compiled game for these settings (generated on first use, then cached)."""
    path = games_dir / f"tw_r{nb_rooms}_o{nb_objects}_q{quest_length}_s{seed}.z8"
    if path.is_file():
        return path
    games_dir.mkdir(parents=True, exist_ok=True)
    options = textworld.GameOptions()
    options.seeds = seed
    options.nb_rooms = nb_rooms
    options.nb_objects = nb_objects
    options.quest_length = quest_length
    options.path = str(path)
    options.file_ext = ".z8"
    options.force_recompile = True
    game = textworld.generator.make_game(options)
    return Path(textworld.generator.compile_game(game, options))


class TextWorldGame(TextGame):
    """One TextWorld episode."""

    def __init__(self, games_dir: Path, num_games: int, **gen: int) -> None:
        self.games_dir = games_dir
        self.num_games = num_games
        self.gen = gen
        self.actions: dict[str, str] = {}
        self.state: Any = None
        self.env: Any = None

    def _observe(self, feedback: str) -> str:
        self.actions = {c: c for c in self.state["admissible_commands"]}
        return (
            f"{feedback.strip()}\n\nObjective: {self.state['objective'].strip()}\n"
            f"Score: {self.state['score']}/{self.state['max_score']}\n"
            f"Commands you can use: {', '.join(self.actions)}"
        )

    def reset(self, seed: int) -> str:
        path = make_game_file(seed % self.num_games, self.games_dir, **self.gen)
        self.env = textworld.start(str(path), request_infos=_INFOS)
        self.state = self.env.reset()
        return self._observe(self.state["description"])

    def step(self, action: Any) -> tuple[str, bool]:
        self.state, _, done = self.env.step(action)
        if done or self.state["won"] or self.state["lost"]:
            self.env.close()
            outcome = "You won!" if self.state["won"] else "The game is over."
            return f"{self.state.feedback.strip()}\n{outcome}", True
        return self._observe(self.state.feedback), False

    def describe_actions(self) -> str:
        return "one of the commands listed with each observation"

    def score(self) -> float:
        if self.state is None or self.state["lost"]:
            return -1.0
        if self.state["won"]:
            return 1.0
        return 2.0 * self.state["score"] / max(1, self.state["max_score"]) - 1.0

    @property
    def success(self) -> bool:
        return bool(self.state is not None and self.state["won"])


class TextWorldEnvConfig(TextGameEnvConfig):
    """TextWorld settings."""

    max_turns: int = 12
    max_token_length: int = 4096

    games_dir: str = Field(default=str(DEFAULT_GAMES_DIR), description="Cache of compiled games")
    num_games: int = Field(default=20, ge=1, description="Size of the seeded game pool")
    nb_rooms: int = Field(default=2, ge=1, description="Rooms per generated game")
    nb_objects: int = Field(default=3, ge=1, description="Objects per generated game")
    quest_length: int = Field(default=2, ge=1, description="Steps of the quest")


class TextWorldEnv(TextGameEnv):
    """TextWorld text adventures through text, one command per turn."""

    name = "textworld"
    env_config_cls = TextWorldEnvConfig
    system_prompt = (
        "You are playing a text adventure. Complete the objective by choosing commands from "
        "the list you are given. Think briefly, then give one command."
    )

    def make_game(self) -> TextWorldGame:
        c = self.config
        return TextWorldGame(
            Path(c.games_dir), c.num_games,
            nb_rooms=c.nb_rooms, nb_objects=c.nb_objects, quest_length=c.quest_length,
        )  # fmt: skip


if __name__ == "__main__":
    TextWorldEnv.cli()
