"""Multiple-choice extraction, reward registry and length penalty."""

from __future__ import annotations

import pytest

from atroposlib.scoring import answers, rewards


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is B.", "B"),
        ("Answer: (C)", "C"),
        ("<think>A looks wrong</think>\\boxed{D}", "D"),
        ("Reasoning...\nA", "A"),
        ("<answer>B</answer>", "B"),
        ("The answer is A or C", None),  # hedging earns nothing
        ("I think it is E", None),  # E is not an option with 4 choices
        ("", None),
        ("I don't know", None),
    ],
)
def test_extract_choice_letter(text: str, expected: str | None) -> None:
    assert answers.extract_choice_letter(text, 4) == expected


def test_choice_letters_bounds_and_format() -> None:
    assert answers.format_choices(["x", "y"]) == "A. x\nB. y"
    with pytest.raises(ValueError, match="num_choices"):
        answers.choice_letters(1)


def test_exact_match_and_tags() -> None:
    assert answers.exact_match("The Eiffel Tower!", "eiffel tower")
    assert not answers.exact_match(None, "x")
    assert answers.extract_tag("a <answer> 5 </answer> b <answer>6</answer>") == "6"


def test_reward_registry_scores() -> None:
    fns = rewards.resolve_reward_functions(["math_verify", {"name": "think_format", "weight": 0.5}])
    good = "<think>9*2</think> \\boxed{18}"
    assert rewards.combined_reward(fns, good, "x\n#### 18") == 1.5
    assert rewards.combined_reward(fns, "\\boxed{17}", "18") == 0.0
    assert rewards.REWARD_FUNCTIONS["choice_letter"]("Answer: b", "B") == 0.0  # lower-case b
    assert rewards.REWARD_FUNCTIONS["choice_letter"]("Answer: B", "B") == 1.0
    assert rewards.REWARD_FUNCTIONS["exact_match"]("#### Paris", "paris") == 1.0
    assert rewards.REWARD_FUNCTIONS["contains"]("It is in Paris.", "paris") == 1.0


def test_unknown_reward_function_names_the_field() -> None:
    with pytest.raises(ValueError, match="reward_functions: unknown reward function 'nope'"):
        rewards.resolve_reward_functions(["nope"])
    with pytest.raises(ValueError, match="reward_functions entries"):
        rewards.resolve_reward_functions([3])  # type: ignore[list-item]


def test_length_penalty_matches_upstream() -> None:
    assert rewards.length_penalty_scores([100, 1024, 1536, 2048, 4000], 2048) == [
        1.0,
        1.0,
        0.5,
        0.0,
        0.0,
    ]
    with pytest.raises(ValueError, match="max_length"):
        rewards.length_penalty_scores([1], 0)
