"""Pick the best alternative of a group by a primary score, ties broken by a secondary one."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["select_best_index"]


def select_best_index(
    primary_scores: Sequence[float | int],
    secondary_scores: Sequence[float | int],
    primary_higher_is_better: bool = True,
    secondary_lower_is_better: bool = True,
) -> int:
    """Index of the best item: best primary score, ties broken by the secondary score.

    Among items equal on both scores the first wins.

    Args:
        primary_scores: The main criterion (e.g. rewards).
        secondary_scores: The tie-breaker (e.g. token counts).
        primary_higher_is_better: Higher primary scores are better (else lower).
        secondary_lower_is_better: Lower secondary scores win ties (else higher).

    Raises:
        ValueError: A list is empty, or the lists differ in length.
    """
    if len(primary_scores) == 0 or len(secondary_scores) == 0:
        raise ValueError("Input score lists cannot be empty.")
    if len(primary_scores) != len(secondary_scores):
        raise ValueError("Primary and secondary score lists must have the same length.")

    def better(a: float, b: float, higher: bool) -> bool:
        return a > b if higher else a < b

    best = 0
    for i in range(1, len(primary_scores)):
        p_i, p_best = primary_scores[i], primary_scores[best]
        if better(p_i, p_best, primary_higher_is_better):
            best = i
        elif p_i == p_best and better(
            secondary_scores[i], secondary_scores[best], not secondary_lower_is_better
        ):
            best = i
    return best
