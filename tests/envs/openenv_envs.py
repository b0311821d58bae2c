"""OpenEnv environments for the ``OpenEnvEnv`` tests, written as an OpenEnv author writes them
(``openenv.core.env_server``); ``app`` serves the word game (``uvicorn
tests.envs.openenv_envs:app``)."""

from __future__ import annotations

from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_app

FRUITS = ["apple", "pear", "fig"]


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    feedback: str = ""


class WordGuess(Environment[GuessAction, GuessObservation, State]):
    """Guess the fruit of the seed: +1 when right, -0.25 for each wrong guess; 3 guesses."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id="", step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kw: Any):
        self.secret = FRUITS[(seed or 0) % len(FRUITS)]
        self._state = State(episode_id=episode_id or "", step_count=0)
        return GuessObservation(feedback=f"Guess my fruit ({len(self.secret)} letters).")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kw: Any):
        self._state.step_count += 1
        right = action.guess.strip().lower() == self.secret
        done = right or self._state.step_count >= 3
        return GuessObservation(
            feedback="Right!" if right else "Not my fruit.",
            done=done,
            reward=1.0 if right else -0.25,
        )

    @property
    def state(self) -> State:
        return self._state


class WalkAction(Action):
    direction: str
    steps: int


class WalkObservation(Observation):
    position: int = 0
    message: str = ""


class Walk(Environment[WalkAction, WalkObservation, State]):
    """Reach the exit 3 steps north; the reward at the exit is 1 / the number of actions."""

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id="", step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kw: Any):
        self.position = 0
        self._state = State(episode_id=episode_id or "", step_count=0)
        return WalkObservation(position=0, message="Walk to the exit, 3 steps north.")

    def step(self, action: WalkAction, timeout_s: float | None = None, **kw: Any):
        if action.direction != "north":
            raise ValueError(f"no way {action.direction!r}")
        self._state.step_count += 1
        self.position += action.steps
        done = self.position >= 3
        reward = 1.0 / self._state.step_count if done else 0.0
        return WalkObservation(
            position=self.position, message="exit" if done else "corridor", done=done, reward=reward
        )

    @property
    def state(self) -> State:
        return self._state


app = create_app(
    WordGuess, GuessAction, GuessObservation, env_name="word_guess", max_concurrent_envs=16
)
