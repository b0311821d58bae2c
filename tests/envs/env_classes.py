"""TRL-style environment classes (``GRPOTrainer(environment_factory=...)``) for the tests of
``EnvironmentClassEnv``: written exactly as a TRL user writes them, with no atroposlib import.

Run as a script, the counter is an atroposlib env (``EnvironmentClassEnv.wrap``)::

    python tests/envs/env_classes.py process --env.total_steps 1 ...
"""

from __future__ import annotations

from typing import Any


class Counter:
    """Count up to a target; the reward is 1 when the count ends exactly on it."""

    def reset(self, **row: Any) -> str:
        self.count = 0
        self.target = int(row.get("target", 2))
        return f" Reach {self.target}."

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.

        Returns:
            The new count.
        """
        self.count += step
        return self.count

    def get_reward(self) -> float:
        return 1.0 if self.count == self.target else 0.0


class TinyTextGame:
    """Two rooms north of the hallway hold the treasure; no dataset (reset makes the task)."""

    def reset(self, **row: Any) -> str:
        self.position = 0
        self.moves = 0
        return "You are in a hallway. Find the treasure."

    def move(self, direction: str) -> str:
        """Walk to the next room.

        Args:
            direction: One of north, south, east, west.
        """
        if direction not in ("north", "south", "east", "west"):
            raise ValueError(f"no such direction {direction!r}")
        self.moves += 1
        self.position += 1 if direction == "north" else 0
        return {1: "You see a door.", 2: "You found the treasure!"}.get(self.position, "A wall.")

    async def look(self) -> str:
        """Describe the room you are in."""
        return "A hallway." if self.position == 0 else "A room."

    def get_reward(self) -> float:
        return 1.0 if self.position >= 2 else 0.0

    def _secret(self) -> None:  # private: not a tool
        pass


class NoReward:
    """Scored only by a TRL-style reward function (no ``get_reward``)."""

    def reset(self, **row: Any) -> None:
        self.count = 0

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.count += step
        return self.count


class Undescribed:
    def reset(self, **row: Any) -> None:
        pass

    def poke(self, x: int) -> int:
        """Poke without saying what x is."""
        return x

    def get_reward(self) -> float:
        return 0.0


class NoReset:
    def get_reward(self) -> float:
        return 0.0


COUNTER_ROWS = [
    {"prompt": [{"role": "user", "content": "Use the counter."}], "target": 2},
    {"prompt": "Use the counter.", "target": 2},
]

if __name__ == "__main__":
    from atroposlib.envs import EnvironmentClassEnv

    EnvironmentClassEnv.wrap(Counter, rows=COUNTER_ROWS).cli()
