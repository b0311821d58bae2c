"""Text games (Taxi, Blackjack, TextWorld): action parsing, game scoring, and ``process``
runs end to end against atropos-serve with masks on every assistant turn."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from atroposlib.envs.text_game_env import parse_action
from tests.conftest import REPO
from tests.environments.test_gsm8k import assert_valid_groups, run_process

sys.path.insert(0, str(REPO / "environments"))

from game_environments.gymnasium.blackjack.blackjack_env import (  # noqa: E402
    BlackjackGame,
)
from game_environments.gymnasium.gym_taxi import ACTIONS, TaxiGame  # noqa: E402
from game_environments.textworld_env.textworld_env import TextWorldGame  # noqa: E402


@pytest.mark.parametrize(
    ("reply", "action"),
    [
        ("The passenger is north of me. Action: north", 1),
        ("Action: **PICKUP**.", 4),
        ("Action: west\nHmm, actually...\nAction: east", 2),
        ("dropoff", 5),
        ("south.", 0),
        ("I will go north-east. Action: fly", None),  # unknown action
        ("Let me go north", None),  # no Action: line
        ("", None),
        (None, None),
    ],
)
def test_parse_action(reply: str | None, action: int | None) -> None:
    assert parse_action(reply, ACTIONS) == action


def _drive(game: TaxiGame, seed: int) -> list[str]:
    """Solve a Taxi game with the env's own BFS (the ground truth for scoring tests)."""
    import gymnasium as gym

    game.reset(seed)
    env = game.env.unwrapped
    start = game.state
    goal_states = set()
    frontier, seen = [(start, [])], {start}
    while frontier:
        state, path = frontier.pop(0)
        for action in range(6):
            (_, nxt, reward, done), *_ = env.P[state][action]
            if done:
                goal_states.add(nxt)
                return [*path, action]
            if nxt not in seen:
                seen.add(nxt)
                frontier.append((nxt, [*path, action]))
    raise AssertionError(gym.__version__)


def test_taxi_scores_delivery_pickup_and_nothing() -> None:
    game = TaxiGame()
    plan = _drive(game, 7)
    game.reset(7)
    for action in plan:
        observation, done = game.step(action)
    assert done and "delivered" in observation
    assert game.success and game.score() == 1.0  # optimal route: no detour penalty
    game = TaxiGame()
    game.reset(7)
    pickup = plan.index(4)
    for action in plan[: pickup + 1]:
        game.step(action)
    assert not game.success and game.score() == 0.0  # picked up, not delivered
    game = TaxiGame()
    first = game.reset(7)
    assert "T" in first and "D" in first and "row" in first
    observation, done = game.step(5)  # illegal dropoff
    assert "Illegal" in observation and not done
    assert game.score() == -1.0


def test_blackjack_outcomes_and_forfeit() -> None:
    outcomes = set()
    for seed in range(40):
        game = BlackjackGame()
        game.reset(seed)
        _, done = game.step(0)  # stick
        assert done
        assert game.score() in (-1.0, 0.0, 1.0)
        assert game.success == (game.score() > 0)
        outcomes.add(game.score())
    assert outcomes == {-1.0, 0.0, 1.0}
    game = BlackjackGame()
    game.reset(0)
    _, done = game.invalid("I like turtles")
    assert done and game.score() == -1.0
    game = BlackjackGame()
    game.reset(0)
    assert game.score() == -1.0  # never finished


def test_textworld_walkthrough_wins_and_progress_scores(tmp_path: Path) -> None:
    game = TextWorldGame(tmp_path, num_games=1)
    first = game.reset(123)
    assert "Objective:" in first and "Commands you can use:" in first
    assert game.score() == -1.0  # no progress yet
    plan = list(game.state["policy_commands"])
    assert parse_action(f"Action: {plan[0]}", game.actions) == plan[0]
    done = False
    steps = 0
    for command in plan:
        observation, done = game.step(command)
        steps += 1
        if done:
            break
        assert -1.0 <= game.score() < 1.0
    assert done and game.success and game.score() == 1.0 and "won" in observation
    assert steps == len(plan)
    assert (tmp_path / "tw_r2_o3_q2_s0.z8").is_file()  # cached for the next reset


@pytest.mark.nightly  # out of per-commit CI (time budget): .ci/nightly runs it
@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "turns"),
    [
        ("game_environments/gymnasium/gym_taxi.py", "3"),
        ("game_environments/gymnasium/blackjack/blackjack_env.py", "3"),
        ("game_environments/textworld_env/textworld_env.py", "2"),
    ],
)
def test_process_end_to_end(
    tiny_serve, tiny_model_dir: Path, tmp_path: Path, script, turns
) -> None:
    extra = []
    if "textworld" in script:
        extra = ["--env.games_dir", str(tmp_path / "games"), "--env.num_games", "1"]
    groups = run_process(
        script,
        tmp_path,
        tiny_serve,
        tiny_model_dir,
        *extra,
        "--env.total_steps",
        "2",
        "--env.group_size",
        "2",
        "--env.max_turns",
        turns,
        "--env.max_tokens_per_turn",
        "12",
        "--env.max_token_length",
        "1024",
    )
    assert len(groups) == 2
    assert_valid_groups(groups, 2)
    for group in groups:
        assert all(-1.0 <= s <= 1.0 for s in group["scores"])
        assert group["inference_logprobs"]
        for masks, messages in zip(group["masks"], group["messages"], strict=True):
            n_turns = sum(m["role"] == "assistant" for m in messages)
            # every assistant turn is trained on: one unmasked span per turn
            spans = sum(
                1 for i, m in enumerate(masks) if m != -100 and (i == 0 or masks[i - 1] == -100)
            )
            assert spans == n_turns, (spans, n_turns)
            assert messages[0]["role"] == "system" and messages[1]["role"] == "user"
