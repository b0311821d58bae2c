"""Partial groups: which short groups are parts of one prompt's group, and merging them.

GRPO normalises scores within a group: every sequence of a group must answer the same prompt,
or the trainer subtracts one baseline from the scores of two questions. So a group shorter than
its env's registered ``group_size`` is, by default, a whole group that lost some replies (an env
that filters replies sends what is left) and is served as it is. Only parts of **one prompt's**
group are merged. The rule (see ``docs/compat.md``, "Partial groups"):

* **Explicit size.** ``group_overrides.group_size`` is the size of the group the sequences
  belong to. Equal to the number of sequences (what atroposlib's and upstream's envs send for
  a group that lost replies): a whole group, queued at once. Larger: a part of a group of that
  size. (Smaller is refused at ingest.) Without it the env's registered ``group_size`` is the
  size aimed at.
* **Same prompt.** A part is held only when all its sequences share one prompt, the tokens
  before the first trained position (the first ``masks`` entry that is not ``-100``); it is
  merged only with parts of the same env, the same prompt and the same target size, when their
  sizes add up to exactly that target. A short group whose sequences have different prompts is
  no part of one prompt's group and is queued at once.
* **Nothing waits for a trainer that waits.** When a trainer asks for a batch the queue cannot
  fill, every held part is released (:meth:`PartialGroups.release`): the parts of one prompt
  together as one (smaller) group, each prompt on its own. An env that disconnects has its
  parts released too.

This module knows nothing of HTTP or storage; the queue persists what it decides.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import orjson

from atroposlib.api.packing import merge_fill
from atroposlib.api.store import StoredGroup
from atroposlib.schema import GROUP_KEYS, PER_SEQUENCE_KEYS, merge_extensions

#: The ``masks`` value of a position that is not trained (part of the prompt).
UNTRAINED = -100

__all__ = [
    "HeldPart",
    "PartialGroups",
    "declared_group_size",
    "merge_payloads",
    "part_of",
    "prompt_key",
]


def declared_group_size(group: dict[str, Any]) -> int | None:
    """``group_overrides.group_size`` of a group (its payload, parsed), or None when not set."""
    overrides = group.get("group_overrides")
    if not isinstance(overrides, dict):
        return None
    size = overrides.get("group_size")
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def prompt_key(group: dict[str, Any]) -> bytes | None:
    """The prompt every sequence of ``group`` answers (the tokens before its first trained
    position), serialised; None when the sequences' prompts differ."""
    key: list[int] | None = None
    for tokens, mask in zip(group["tokens"], group["masks"], strict=True):
        first = next((i for i, m in enumerate(mask) if m != UNTRAINED), len(mask))
        prompt = tokens[:first]
        if key is None:
            key = prompt
        elif prompt != key:
            return None
    return orjson.dumps(key)


def merge_payloads(parts: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """One group from parts of one prompt's group: per-sequence lists concatenated, group-level
    fields from the first part that has them, ``images`` concatenated when every part sends a
    list, the oldest ``policy_version``. Returns the group and the per-sequence fields that had
    to be set to null because only some parts carried them."""
    merged: dict[str, Any] = {}
    lost: list[str] = []
    for key in GROUP_KEYS:
        values = [p.get(key) for p in parts]
        if key in PER_SEQUENCE_KEYS:
            if all(v is None for v in values):
                merged[key] = None
            elif all(isinstance(v, list) for v in values):
                merged[key] = [x for v in values for x in v]
            else:
                merged[key] = None
                lost.append(key)
        elif key == "images" and all(isinstance(v, list) for v in values):
            merged[key] = [x for v in values for x in v]
        else:
            merged[key] = next((v for v in values if v is not None), None)
    merged.update(merge_extensions(parts))
    return merged, lost


def part_of(group: StoredGroup, declared: int | None, registered: int) -> HeldPart | None:
    """``group`` as a part to hold (with its prompt and the size of the group it belongs to),
    or None when it is a whole group to queue as it is. ``declared`` is its
    ``group_overrides.group_size``, ``registered`` its env's ``group_size``."""
    target = registered if declared is None else declared
    if group.size >= target:
        return None
    prompt = prompt_key(orjson.loads(group.payload))
    return None if prompt is None else HeldPart(group, prompt, target)


@dataclass(slots=True)
class HeldPart:
    """A part waiting for the rest of its prompt's group."""

    group: StoredGroup
    prompt: bytes
    target: int


class PartialGroups:
    """The parts held, per env, in arrival order. Not thread-safe: the queue's lock guards it.

    :meth:`add` holds a part and returns the parts that complete a group, if any;
    :meth:`release` hands back everything held, batched by prompt. Counts per env feed the
    env's throttle (``/status-env``) and ``/metrics``.
    """

    def __init__(self) -> None:
        self._held: dict[int, list[HeldPart]] = {}
        self.sequences = 0
        self.bytes = 0
        self.sequences_by_env = Counter[int]()

    def __len__(self) -> int:
        return sum(len(parts) for parts in self._held.values())

    def __bool__(self) -> bool:
        return bool(self._held)

    def add(self, part: HeldPart) -> list[StoredGroup]:
        """Hold ``part``; return the held parts of its prompt whose sizes add up to its target
        (taken out, oldest first), or [] while they do not."""
        env_id = part.group.env_id
        assert env_id is not None
        parts = self._held.setdefault(env_id, [])
        parts.append(part)
        self._count(part.group, +1)
        same = [
            i for i, p in enumerate(parts) if (p.prompt, p.target) == (part.prompt, part.target)
        ]
        picked = merge_fill([parts[i].group.size for i in same], part.target)
        if not picked:
            return []
        return self._take(env_id, [same[i] for i in picked])

    def release(self, env_id: int | None = None) -> list[list[StoredGroup]]:
        """Take out every held part (of ``env_id`` only, when given): one list of parts per
        env and prompt, oldest first, each list to be queued as one group."""
        envs = list(self._held) if env_id is None else [env_id]
        released: list[list[StoredGroup]] = []
        for env in envs:
            by_prompt: dict[tuple[bytes, int], list[int]] = {}
            for i, part in enumerate(self._held.get(env, [])):
                by_prompt.setdefault((part.prompt, part.target), []).append(i)
            taken = {i: self._held[env][i].group for idx in by_prompt.values() for i in idx}
            for idx in by_prompt.values():
                released.append([taken[i] for i in idx])
            for group in taken.values():
                self._count(group, -1)
            self._held.pop(env, None)
        return released

    def held_sequences(self, env_id: int) -> int:
        """Sequences held for ``env_id`` (upstream's ``buffer_size`` in a ``buffered`` reply)."""
        return self.sequences_by_env.get(env_id, 0)

    def _take(self, env_id: int, indices: list[int]) -> list[StoredGroup]:
        parts = self._held[env_id]
        chosen = [parts[i].group for i in sorted(indices)]
        for i in sorted(indices, reverse=True):
            parts.pop(i)
        if not parts:
            del self._held[env_id]
        for group in chosen:
            self._count(group, -1)
        return chosen

    def _count(self, group: StoredGroup, sign: int) -> None:
        assert group.env_id is not None
        self.sequences += sign * group.size
        self.bytes += sign * len(group.payload)
        self.sequences_by_env[group.env_id] += sign * group.size
        if not self.sequences_by_env[group.env_id]:
            del self.sequences_by_env[group.env_id]
