"""The scripted environment's groups: each built so that one rule of the contract shows.

A trainer that breaks a rule trains with a different advantage sign, or on different tokens,
than one that follows it; the groups are chosen so that the difference is never hidden:

- ``scores``: distinct scores, none at the group's mean, so every sequence has a clear sign.
- ``multi_turn``: completions with masked env/tool/user tokens *between* trained assistant
  turns (and after the last one), so a trainer that trains "everything after the prompt"
  trains tokens it must not.
- ``explicit_per_token`` / ``explicit_per_sequence``: ``advantages`` whose signs are the
  opposite of what the scores give (one sequence has a positive first turn and a negative
  second turn), so a trainer that ignores them, or keeps one value per sequence, is caught.
- ``set_advantage_to_zero``: the flagged sequence has by far the highest score. Zeroing its
  advantage keeps every other member negative; zeroing its *score* instead (or dropping it
  before normalising) makes some of them positive.
- ``equal_scores``: advantage 0 for everyone (a trainer may skip these rows).
- ``single``: a group of one sequence keeps its raw (negative) score as advantage.

Mixed group sizes (1 to 5) come in batches of 8; with a fixed group size ``G`` (trainers that
need every group to have exactly ``G`` sequences) batches hold two groups of ``G``. Groups carry
``policy_version`` values (some none, as from an upstream env). Every batch is a run of
consecutive groups that sums to the batch size, so run-api's FIFO exact-fill packer hands
them out in the designed order whatever the timing. Token ids are random (seeded) with the
first completion token unique per sequence, so each sequence can be told apart in a report.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from atroposlib.testing.expected import score_advantages

__all__ = ["FEATURES", "Scenario", "ScriptedGroup", "build_scenario"]

IGNORE_INDEX = -100
PROMPT_LEN = 10

#: What each kind of group shows (for the check's output).
FEATURES: dict[str, str] = {
    "scores": "advantages from the group's scores",
    "multi_turn": "masked env/tool tokens between trained turns",
    "explicit_per_token": "explicit per-token advantages",
    "explicit_per_sequence": "explicit per-sequence advantages",
    "set_advantage_to_zero": "overrides[i].set_advantage_to_zero",
    "equal_scores": "equal scores (advantage 0)",
    "single": "a group of one (raw score)",
}


@dataclass(frozen=True)
class ScriptedGroup:
    """One group the scripted env sends: ``index`` in sending order, the ``feature`` it
    shows, the ``batch`` (1-based) it is designed to land in and its wire ``payload``."""

    index: int
    feature: str
    batch: int
    payload: dict[str, Any]

    @property
    def size(self) -> int:
        return len(self.payload["tokens"])


@dataclass(frozen=True)
class Scenario:
    """The groups of one check run and the trainer settings they are designed for."""

    groups: list[ScriptedGroup]
    batch_size: int
    steps: int
    #: every group has this many sequences (None: mixed sizes)
    group_size: int | None
    #: the ``group_size`` the env registers (no group is ever smaller: none is buffered)
    env_group_size: int
    max_token_len: int
    notes: list[str] = field(default_factory=list)


class _Tokens:
    """Random token ids in ``[low, high)``; :meth:`unique` never repeats one."""

    def __init__(self, rng: random.Random, low: int, high: int) -> None:
        self.rng, self.low, self.high = rng, low, high
        self.used: set[int] = set()

    def some(self, n: int) -> list[int]:
        return [self.rng.randrange(self.low, self.high) for _ in range(n)]

    def unique(self) -> int:
        while True:
            token = self.rng.randrange(self.low, self.high)
            if token not in self.used:
                self.used.add(token)
                return token


def _sequence(
    ids: _Tokens, prompt: list[int], segments: list[tuple[int, bool]]
) -> tuple[list[int], list[int]]:
    """Tokens and masks of ``prompt`` followed by ``segments`` of ``(length, trained)``; the
    first completion token is unique (it identifies the sequence)."""
    tokens, masks = list(prompt), [IGNORE_INDEX] * len(prompt)
    for k, (length, trained) in enumerate(segments):
        part = [ids.unique()] + ids.some(length - 1) if k == 0 else ids.some(length)
        tokens += part
        masks += part if trained else [IGNORE_INDEX] * length
    return tokens, masks


def _spread(n: int) -> list[float]:
    """``n`` distinct scores, none at their mean (every normalised advantage clearly != 0)."""
    if n == 1:
        return [0.5]
    values = [(k / (n - 1)) ** 2 for k in range(n)]
    return values[1:] + values[:1]


def _signs(scores: list[float]) -> list[float]:
    return [1.0 if a > 0 else -1.0 for a in score_advantages(scores)]


def _group(
    ids: _Tokens, segments: list[list[tuple[int, bool]]], scores: list[float]
) -> dict[str, Any]:
    prompt = [ids.unique()] + ids.some(PROMPT_LEN - 1)
    tokens, masks = [], []
    for segs in segments:
        t, m = _sequence(ids, prompt, segs)
        tokens.append(t)
        masks.append(m)
    return {"tokens": tokens, "masks": masks, "scores": scores}


def _scores(ids: _Tokens, n: int) -> dict[str, Any]:
    lengths = [3 + (k * 2) % 5 for k in range(n)]
    return _group(ids, [[(length, True)] for length in lengths], _spread(n))


def _multi_turn(ids: _Tokens, n: int) -> dict[str, Any]:
    shapes = [
        [(4, True), (3, False), (4, True)],  # assistant, tool reply, assistant
        [(3, True), (4, False), (3, True), (2, False)],  # ... and a final user turn
    ]
    return _group(ids, [shapes[k % 2] for k in range(n)], list(reversed(_spread(n))))


def _explicit_per_token(ids: _Tokens, n: int) -> dict[str, Any]:
    scores = _spread(n)
    signs = _signs(scores)
    shapes = [[(5, True)] for _ in range(n - 1)] + [[(3, True), (2, False), (3, True)]]
    group = _group(ids, shapes, scores)
    advantages = []
    for k, masks in enumerate(group["masks"]):
        row, turn, seen = [], 0, False
        for m in masks:
            if m == IGNORE_INDEX:
                row.append(0.0)
                turn += seen
                seen = False
                continue
            seen = True
            if k == n - 1:  # two turns: a good first one, a bad second one
                row.append(0.8 if turn == 0 else -0.6)
            else:  # the opposite of what the scores say, varying along the sequence
                row.append(-signs[k] * (0.5 + 0.1 * len(row) / len(masks)))
        advantages.append(row)
    group["advantages"] = advantages
    return group


def _explicit_per_sequence(ids: _Tokens, n: int) -> dict[str, Any]:
    group = _scores(ids, n)
    signs = _signs(group["scores"])
    group["advantages"] = [[-s * (0.7 + 0.1 * k)] for k, s in enumerate(signs)]
    return group


def _set_advantage_to_zero(ids: _Tokens, n: int) -> dict[str, Any]:
    # the flagged sequence scores far above the rest: with its score counted, every other
    # member is below the mean; with its score zeroed (or left out), the best of them is not
    rest = _spread(n - 1) if n > 2 else [0.0]
    group = _scores(ids, n)
    group["scores"] = [10.0 * n] + rest
    group["overrides"] = [{"set_advantage_to_zero": True}] + [{} for _ in rest]
    return group


def _equal_scores(ids: _Tokens, n: int) -> dict[str, Any]:
    group = _scores(ids, n)
    group["scores"] = [0.5] * n
    return group


def _single(ids: _Tokens) -> dict[str, Any]:
    group = _scores(ids, 1)
    group["scores"] = [-0.5]
    return group


def _explicit_with_zero(ids: _Tokens) -> dict[str, Any]:
    """Explicit per-sequence advantages (against the scores) with one sequence zeroed."""
    group = _scores(ids, 3)
    group["scores"] = [0.0, 1.0, 0.2]
    group["advantages"] = [[1.0], [-1.0], [0.5]]
    group["overrides"] = [{"set_advantage_to_zero": True}, {}, {"temperature": 1.0}]
    return group


def build_scenario(
    *, group_size: int | None = None, vocab_size: int = 49152, seed: int = 0
) -> Scenario:
    """The groups of a check run: mixed sizes, or every group of ``group_size`` (>= 2).

    Token ids are drawn from ``[100, vocab_size)`` (at most 49152).
    """
    if group_size is not None and group_size < 2:
        raise ValueError(f"group_size must be at least 2 (got {group_size})")
    high = min(int(vocab_size), 49152)
    if high - 100 < 1000:
        raise ValueError(f"vocab_size {vocab_size} is too small for the scripted groups")
    ids = _Tokens(random.Random(seed), 100, high)
    layout: list[tuple[int, str, dict[str, Any], int | None]]  # batch, feature, payload, version
    notes: list[str] = []
    if group_size is None:
        batch_size, steps, env_group_size = 8, 4, 1
        layout = [
            (1, "scores", _scores(ids, 4), 0),
            (1, "multi_turn", _multi_turn(ids, 4), 0),
            (2, "explicit_per_token", _explicit_per_token(ids, 3), 1),
            (2, "explicit_per_sequence", _explicit_per_sequence(ids, 2), 1),
            (2, "equal_scores", _equal_scores(ids, 2), 0),
            (2, "single", _single(ids), None),
            (3, "set_advantage_to_zero", _set_advantage_to_zero(ids, 4), 2),
            (3, "multi_turn", _multi_turn(ids, 4), 1),
            (4, "scores", _scores(ids, 5), None),
            (4, "explicit_per_sequence", _explicit_with_zero(ids), 3),
        ]
    else:
        n = group_size
        batch_size, steps, env_group_size = 2 * n, 3, n
        layout = [
            (1, "scores", _scores(ids, n), 0),
            (1, "multi_turn", _multi_turn(ids, n), 0),
            (2, "explicit_per_token", _explicit_per_token(ids, n), 1),
            (2, "explicit_per_sequence", _explicit_per_sequence(ids, n), None),
            (3, "set_advantage_to_zero", _set_advantage_to_zero(ids, n), 2),
            (3, "equal_scores", _equal_scores(ids, n), 1),
        ]
        notes.append(
            f"every group has {n} sequences (--group-size): mixed group sizes and groups of one "
            "were not checked"
        )
    groups = []
    for index, (batch, feature, payload, version) in enumerate(layout):
        if version is not None:
            payload["policy_version"] = version
        groups.append(ScriptedGroup(index, feature, batch, payload))
    for b in range(1, steps + 1):
        assert sum(g.size for g in groups if g.batch == b) == batch_size, b
    longest = max(len(t) for g in groups for t in g.payload["tokens"])
    return Scenario(groups, batch_size, steps, group_size, env_group_size, longest, notes)
