"""Taxi (gymnasium ``Taxi-v4``) played through text, one model turn per move.

The model drives a taxi on a 5x5 grid: reach the passenger, ``pickup``, drive to the
destination, ``dropoff``. Each turn it sees the map (``T`` taxi, ``P`` waiting passenger,
``D`` destination, ``|`` walls) and its position, and ends its reply with
``Action: south|north|east|west|pickup|dropoff``.

Reward per trajectory: 1.0 for delivering the passenger (minus 0.02 per move beyond the
fewest possible, floored at 0.5), 0.0 for picking the passenger up without delivering,
-1.0 otherwise; minus ``invalid_action_penalty`` per unreadable action; clipped to [-1, 1].

    python environments/game_environments/gymnasium/gym_taxi.py serve --env.use_wandb false
    python environments/game_environments/gymnasium/gym_taxi.py process --env.total_steps 4
    python environments/game_environments/gymnasium/gym_taxi.py evaluate --env.num_eval_games 20
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym

from atroposlib.envs.text_game_env import TextGame, TextGameEnv, TextGameEnvConfig

LOCATIONS = ["R", "G", "Y", "B"]
ACTIONS = {"south": 0, "north": 1, "east": 2, "west": 3, "pickup": 4, "dropoff": 5}


class TaxiGame(TextGame):
    """One ``Taxi-v4`` episode with a text view."""

    actions = ACTIONS

    def __init__(self) -> None:
        self.env = gym.make("Taxi-v4")
        self.delivered = False
        self.picked_up = False
        self.moves = 0
        self.shortest = 0

    def _decode(self) -> tuple[int, int, int, int]:
        return tuple(self.env.unwrapped.decode(self.state))  # type: ignore[return-value]

    def _view(self) -> str:
        row, col, passenger, dest = self._decode()
        locs = self.env.unwrapped.locs
        desc = [[c.decode() for c in line] for line in self.env.unwrapped.desc]
        if passenger < 4:
            pr, pc = locs[passenger]
            desc[1 + pr][2 * pc + 1] = "P"
        dr, dc = locs[dest]
        desc[1 + dr][2 * dc + 1] = "D"
        desc[1 + row][2 * col + 1] = "T"
        board = "\n".join("".join(line) for line in desc)
        where = (
            "The passenger is in your taxi."
            if passenger == 4
            else f"The passenger waits at {LOCATIONS[passenger]} (row {locs[passenger][0]}, "
            f"column {locs[passenger][1]})."
        )
        return (
            f"{board}\nYour taxi T is at row {row}, column {col} (row 0 is the top). {where} "
            f"Destination D: {LOCATIONS[dest]} (row {dr}, column {dc})."
        )

    def _shortest(self) -> int:
        row, col, passenger, dest = self._decode()
        locs = self.env.unwrapped.locs
        # a lower bound that ignores walls: Manhattan legs plus pickup and dropoff
        pr, pc = locs[passenger]
        dr, dc = locs[dest]
        return abs(row - pr) + abs(col - pc) + abs(pr - dr) + abs(pc - dc) + 2

    def reset(self, seed: int) -> str:
        self.state, _ = self.env.reset(seed=seed)
        self.shortest = self._shortest()
        return "New ride.\n" + self._view()

    def step(self, action: Any) -> tuple[str, bool]:
        before = self._decode()
        self.state, reward, terminated, truncated, _ = self.env.step(action)
        self.moves += 1
        after = self._decode()
        if after[2] == 4 and before[2] != 4:
            self.picked_up = True
        note = ""
        if reward == -10:
            note = "Illegal pickup/dropoff (-10). "
        elif after[:2] == before[:2] and action < 4:
            note = "A wall blocked that move. "
        if terminated:
            self.delivered = True
            return note + "Passenger delivered! Ride complete.", True
        return note + self._view(), bool(truncated)

    def score(self) -> float:
        if self.delivered:
            return max(0.5, 1.0 - 0.02 * max(0, self.moves - self.shortest))
        return 0.0 if self.picked_up else -1.0

    @property
    def success(self) -> bool:
        return self.delivered


class TaxiEnvConfig(TextGameEnvConfig):
    """Taxi settings (defaults allow a full ride)."""

    max_turns: int = 20
    max_token_length: int = 4096


class GymTaxiEnv(TextGameEnv):
    """Taxi-v4 through text, one turn per move."""

    name = "gym_taxi"
    env_config_cls = TaxiEnvConfig
    system_prompt = (
        "You drive a taxi on a 5x5 grid. Go to the passenger P, pick them up, drive to the "
        "destination D and drop them off, in as few moves as possible. south increases the row, "
        "north decreases it, east increases the column, west decreases it; '|' is a wall."
    )

    def make_game(self) -> TaxiGame:
        return TaxiGame()


if __name__ == "__main__":
    GymTaxiEnv.cli()
