"""What the trainer's half of the contract says a trainer trains on, for one scored group.

Written from the contract's rules (``docs/check-trainer.md``, "The contract"), independently of
any trainer's code, so the check never agrees with a trainer because they share a bug:

- **Trained tokens.** Token ``j`` of sequence ``i`` is trained (its log-probability, predicted
  from the tokens before it, is in the loss) exactly when ``masks[i][j] != -100``, for
  ``j >= 1``. The first token has nothing before it and is never trained. Masked tokens inside
  a completion (a tool's or the user's reply in a multi-turn rollout) are not trained.
- **Advantages.** When the group carries ``advantages``, they are used as given: ``advantages[i]``
  has one value per token (token ``j``'s advantage is ``advantages[i][j]``) or a single value
  for every token of the sequence. Otherwise every token of sequence ``i`` gets
  ``(scores[i] - mean) / max(std, 1e-8)`` over the group's scores (``std`` the sample standard
  deviation, n - 1 in the denominator); a group of one sequence keeps its raw score.
  ``overrides[i]["set_advantage_to_zero"]`` makes sequence ``i``'s advantage 0 on every token,
  *after* the normalisation: its score still counts in the group's mean and std.

Torch-free (plain Python floats).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ExpectedRow", "expected_rows", "score_advantages"]

IGNORE_INDEX = -100
STD_FLOOR = 1e-8


@dataclass(frozen=True)
class ExpectedRow:
    """What the trainer should do with one sequence: per token, whether it is trained and
    the advantage that weighs it (0 where not trained)."""

    tokens: tuple[int, ...]
    trained: tuple[bool, ...]
    advantages: tuple[float, ...]

    @property
    def no_signal(self) -> bool:
        """Advantage 0 on every trained token: a trainer may leave this row out."""
        return all(a == 0.0 for a, t in zip(self.advantages, self.trained, strict=True) if t)


def score_advantages(scores: Sequence[float]) -> list[float]:
    """The contract's advantage of each sequence from the group's scores alone."""
    values = [float(s) for s in scores]
    if len(values) == 1:
        return values
    mean = statistics.fmean(values)
    std = statistics.stdev(values)
    return [(v - mean) / max(std, STD_FLOOR) for v in values]


def expected_rows(group: Mapping[str, Any]) -> list[ExpectedRow]:
    """One :class:`ExpectedRow` per sequence of ``group`` (a ``/batch`` group)."""
    tokens = group["tokens"]
    masks = group["masks"]
    explicit = group.get("advantages")
    per_sequence = score_advantages(group["scores"])
    overrides = group.get("overrides") or []
    rows = []
    for i, seq in enumerate(tokens):
        size = len(seq)
        if explicit is not None:
            given = [float(a) for a in explicit[i]]
            advs = given * size if len(given) == 1 else given
        else:
            advs = [per_sequence[i]] * size
        override = overrides[i] if i < len(overrides) else None
        if override and override.get("set_advantage_to_zero"):
            advs = [0.0] * size
        trained = tuple(j >= 1 and masks[i][j] != IGNORE_INDEX for j in range(size))
        rows.append(
            ExpectedRow(
                tokens=tuple(int(t) for t in seq),
                trained=trained,
                advantages=tuple(a if t else 0.0 for a, t in zip(advs, trained, strict=True)),
            )
        )
    return rows


def same_sign(expected: float, reported: float, zero_tolerance: float) -> bool:
    """``reported`` has ``expected``'s sign (within ``zero_tolerance`` of 0 when expected is 0)."""
    if expected == 0.0:
        return abs(reported) <= zero_tolerance
    if not math.isfinite(reported):
        return False
    return (reported > 0) == (expected > 0) and reported != 0.0
