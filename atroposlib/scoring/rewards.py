"""Reward functions by name, and upstream's group-level length penalty.

A reward function takes the completion text and the item's gold answer and returns a float:
``fn(completion: str, answer: str | None, **item_fields) -> float``. Environments (the generic
:mod:`environments.dataset_environment`) pick them by name from :data:`REWARD_FUNCTIONS`, so a
YAML config can say ``reward_functions: [math_verify, {name: think_format, weight: 0.2}]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from atroposlib.scoring import answers
from atroposlib.scoring import math as math_scoring

__all__ = [
    "REWARD_FUNCTIONS",
    "RewardFn",
    "combined_reward",
    "length_penalty_scores",
    "resolve_reward_functions",
]

RewardFn = Callable[..., float]


def _math_verify(completion: str, answer: str | None, **_: Any) -> float:
    if answer is None:
        return 0.0
    gold = math_scoring.gsm8k_gold_answer(answer) if "####" in answer else answer
    return 1.0 if math_scoring.is_correct(completion, gold) else 0.0


def _exact_match(completion: str, answer: str | None, **_: Any) -> float:
    if answer is None:
        return 0.0
    predicted = math_scoring.extract_final_answer(completion) or math_scoring.strip_think(
        completion
    )
    return 1.0 if answers.exact_match(predicted, answer) else 0.0


def _contains(completion: str, answer: str | None, **_: Any) -> float:
    if not answer:
        return 0.0
    body = answers.normalize_text(math_scoring.strip_think(completion))
    return 1.0 if answers.normalize_text(answer) in body else 0.0


def _choice_letter(completion: str, answer: str | None, **fields: Any) -> float:
    if answer is None:
        return 0.0
    num_choices = int(fields.get("num_choices", 4))
    letter = answers.extract_choice_letter(completion, num_choices)
    return 1.0 if letter is not None and letter == str(answer).strip().upper() else 0.0


def _think_format(completion: str, answer: str | None = None, **_: Any) -> float:
    """1 for exactly one ``<think>...</think>`` block followed by a non-empty answer."""
    if completion.count("<think>") > 1 or completion.count("</think>") != 1:
        return 0.0
    return 1.0 if completion.split("</think>")[-1].strip() else 0.0


def _boxed_format(completion: str, answer: str | None = None, **_: Any) -> float:
    return 1.0 if math_scoring.extract_boxed(math_scoring.strip_think(completion)) else 0.0


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "math_verify": _math_verify,
    "exact_match": _exact_match,
    "contains": _contains,
    "choice_letter": _choice_letter,
    "think_format": _think_format,
    "boxed_format": _boxed_format,
}
# upstream registry names that mean the same thing
REWARD_FUNCTIONS["accuracy"] = _math_verify
REWARD_FUNCTIONS["format"] = _think_format


def resolve_reward_functions(
    spec: Sequence[str | dict[str, Any]] | None,
) -> list[tuple[RewardFn, float]]:
    """``["math_verify", {"name": "think_format", "weight": 0.2}]`` -> ``[(fn, 1.0), (fn, 0.2)]``.

    Raises ValueError naming the unknown function and the known ones.
    """
    resolved: list[tuple[RewardFn, float]] = []
    for entry in spec or []:
        if isinstance(entry, str):
            name, weight = entry, 1.0
        elif isinstance(entry, dict) and "name" in entry:
            name, weight = entry["name"], float(entry.get("weight", 1.0))
        else:
            raise ValueError(
                f"reward_functions entries must be a name or {{name, weight}}, got {entry!r}"
            )
        if name not in REWARD_FUNCTIONS:
            raise ValueError(
                f"reward_functions: unknown reward function {name!r}; "
                f"known: {', '.join(sorted(REWARD_FUNCTIONS))}"
            )
        resolved.append((REWARD_FUNCTIONS[name], weight))
    return resolved


def combined_reward(
    functions: Sequence[tuple[RewardFn, float]], completion: str, answer: str | None, **fields: Any
) -> float:
    """Weighted sum of the reward functions (0.0 when there are none)."""
    return float(sum(w * fn(completion, answer, **fields) for fn, w in functions))


def length_penalty_scores(
    token_lengths: Sequence[int], max_length: int, threshold: float = 0.5
) -> list[float]:
    """Upstream's penalty for an all-correct group: 1.0 up to ``threshold * max_length`` tokens,
    then falling linearly to 0.0 at ``max_length`` (and staying 0 beyond)."""
    if max_length <= 0:
        raise ValueError(f"max_length must be positive, got {max_length}")
    cut = max_length * threshold
    out = []
    for length in token_lengths:
        if length <= cut:
            out.append(1.0)
        else:
            out.append(1.0 - min((length - cut) / (max_length - cut), 1.0))
    return out
