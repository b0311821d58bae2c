"""Selective rollouts: ask less often for items whose groups keep scoring alike.

A group whose replies all score the same has no learning signal under a group baseline (every
advantage is zero), and with ``ensure_scores_are_not_same`` it is dropped after the whole group
was generated. When items recur (a small problem space, several epochs over a dataset), an item
that came back flat last time may well come back flat again: problems the policy always solves
or never does. GRESO (Zheng et al., 2025, "Act Only When It Pays: Efficient
Reinforcement Learning for LLM Reasoning via Selective Rollouts") skips such prompts before
generating, with a probability that grows with how many times in a row they were flat, and
keeps exploring them with the rest.

:class:`FlatItemFilter` does that for an env: ``flat_item_retry_prob = p`` asks an item again
with probability ``p ** k`` after its last ``k`` groups in a row were flat (a group with a signal
resets ``k``), so nothing is excluded for good and an item the policy has grown into comes back.
Off (``None``) by default, as upstream: every item drawn is rolled out. Whether it pays depends
on how lasting an item's flatness is: on the arithmetic-learn recipe it did not (an item that
came back flat was about as likely to be flat again as any other; example_trainer/README.md).

Items are recognised by their content (:func:`item_key`): the same problem drawn twice is the
same item, whatever object holds it. Only the history of flat items is kept (an entry per item
currently on a flat streak).
"""

from __future__ import annotations

import json
import random
from typing import Any

#: Draws in a row an env may skip before it rolls out what it drew anyway (a policy for which
#: nearly every item is flat must still produce groups, and get_next_item must not spin).
MAX_SKIPS_IN_A_ROW = 64


def item_key(item: Any) -> str | None:
    """A stable key for ``item`` (its JSON, keys sorted; ``repr`` for what JSON cannot hold), or
    None when it cannot be keyed (then the item is never skipped)."""
    try:
        return json.dumps(item, sort_keys=True, default=repr)
    except (TypeError, ValueError):
        try:
            return repr(item)
        except Exception:  # noqa: BLE001 - an item that cannot be described is never skipped
            return None


class FlatItemFilter:
    """Which drawn items to roll out, given how often each came back flat in a row.

    Args:
        retry_prob: Probability of rolling out an item again after one flat group; ``p ** k``
            after ``k`` flat groups in a row. In (0, 1].
        seed: Seed of the skip decisions (runs are reproducible).
    """

    def __init__(self, retry_prob: float, seed: int = 0) -> None:
        if not 0.0 < retry_prob <= 1.0:
            raise ValueError(f"flat_item_retry_prob must be in (0, 1], got {retry_prob}")
        self.retry_prob = retry_prob
        self._rng = random.Random(seed)
        #: item key -> flat groups in a row (only items on a streak)
        self.streaks: dict[str, int] = {}
        #: items drawn and not rolled out (the cost avoided), over the run
        self.skipped = 0
        self._skips_in_a_row = 0

    def skip(self, item: Any) -> bool:
        """Whether to skip ``item`` (just drawn) instead of rolling it out."""
        key = item_key(item)
        streak = self.streaks.get(key, 0) if key is not None else 0
        if streak == 0 or self._skips_in_a_row >= MAX_SKIPS_IN_A_ROW:
            self._skips_in_a_row = 0
            return False
        if self._rng.random() < self.retry_prob**streak:
            self._skips_in_a_row = 0
            return False
        self.skipped += 1
        self._skips_in_a_row += 1
        return True

    def record(self, item: Any, flat: bool) -> None:
        """Record that ``item``'s rollout came back flat (every group scored alike) or not."""
        key = item_key(item)
        if key is None:
            return
        if flat:
            self.streaks[key] = self.streaks.get(key, 0) + 1
        else:
            self.streaks.pop(key, None)


async def next_rollout_item(env: Any) -> Any:
    """``env.get_next_item()``, passing over the items its selective rollouts skip
    (``env.flat_items``, on with ``flat_item_retry_prob``); None as ``get_next_item``."""
    selective: FlatItemFilter | None = getattr(env, "flat_items", None)
    while True:
        item = await env.get_next_item()
        if item is None or selective is None or not selective.skip(item):
            return item
