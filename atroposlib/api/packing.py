"""Batch packing: choose whole groups whose sequence counts sum exactly to a batch size.

The trajectory API hands a trainer batches of exactly ``batch_size`` sequences, made of whole
groups (a group is never split: GRPO normalises scores within it). This module decides *which*
groups, and knows nothing of HTTP, JSON or storage: it works on group sizes and env ids.

Rules, in order of priority:

1. **Exact fill.** A batch holds exactly ``batch_size`` sequences. Any mix of group sizes works
   (3s and 4s, 6s with a batch of 10, ...) whenever *some* subset of the queued groups sums to
   the target; it is found with a bitset subset-sum over the queue.
2. **FIFO.** Among all exact fills, take the one that reaches least far into the queue (the
   newest group it uses is as old as possible), and within that prefix the lexicographically
   earliest set of groups. With uniform group sizes that divide the batch size this is simply
   "the oldest groups first".
3. **Minimum allocations** (upstream's ``min_batch_allocation``): an env that asked for a fraction
   ``f`` of every batch first gets ``int(batch_size * f)`` sequences of its own oldest groups
   (or all it has queued, if less), then the rest of the batch is filled by rule 1-2 from
   everything else. A connected env with a minimum but nothing queued holds batches back, as
   upstream does, until it sends data or disconnects.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PackItem:
    """One queued group as the packer sees it: its sequence count and the env that sent it."""

    size: int
    env_id: int | None = None


def _reach_bits(sizes: Sequence[int], mask: int) -> int:
    """Bitset of the sums reachable with any subset of ``sizes`` (bit k set: sum k reachable)."""
    reach = 1
    for s in sizes:
        reach |= (reach << s) & mask
    return reach


def exact_fill(sizes: Iterable[int], target: int) -> list[int] | None:
    """Pick indices of ``sizes`` summing exactly to ``target``, as FIFO as possible.

    Returns the indices in increasing order, or ``None`` when no subset sums to ``target``.
    The chosen subset uses the shortest possible prefix of ``sizes`` and, within it, the
    lexicographically smallest index set. ``sizes`` is consumed lazily and only as far as that
    prefix, so a long queue costs nothing beyond the groups actually considered. Runs in
    O(prefix length * target / word size).
    """
    if target <= 0:
        return None
    mask = (1 << (target + 1)) - 1
    goal = 1 << target

    prefix: list[int] = []
    running = 0  # prefix sum while every group so far fits: the common, all-oldest case
    reach = 1
    for i, s in enumerate(sizes):
        prefix.append(s)
        if running >= 0:
            running += s
            if running == target:
                return list(range(i + 1))
            if running > target:
                running = -1
        if 0 < s <= target:
            reach |= (reach << s) & mask
            if reach & goal:
                break
    else:
        return None

    # Suffix reachability inside the prefix, then take each group greedily when the remainder
    # can still be completed from the groups after it (lexicographically earliest set).
    suffix = [0] * (len(prefix) + 1)
    suffix[len(prefix)] = 1
    for i in range(len(prefix) - 1, -1, -1):
        s = prefix[i]
        below = suffix[i + 1]
        suffix[i] = below | ((below << s) & mask) if 0 < s <= target else below
    chosen: list[int] = []
    remaining = target
    for i, s in enumerate(prefix):
        if remaining == 0:
            break
        if 0 < s <= remaining and (suffix[i + 1] >> (remaining - s)) & 1:
            chosen.append(i)
            remaining -= s
    return chosen if remaining == 0 else None


def pack_batch(
    items: Sequence[PackItem],
    batch_size: int,
    min_allocations: Mapping[int, float] | None = None,
) -> list[int] | None:
    """Choose queue indices for one batch of exactly ``batch_size`` sequences.

    ``items`` is the queue in arrival order. ``min_allocations`` maps env ids of *connected*
    envs to their guaranteed batch fraction (0..1). Returns indices in queue order, or ``None``
    when no batch can be formed yet.
    """
    if batch_size <= 0 or not items:
        return None
    if sum(item.size for item in items) < batch_size:
        return None

    minimums = {
        env: int(batch_size * frac)
        for env, frac in (min_allocations or {}).items()
        if frac is not None and int(batch_size * frac) > 0
    }
    if not minimums:
        return exact_fill([item.size for item in items], batch_size)

    by_env: dict[int, list[int]] = {}
    for idx, item in enumerate(items):
        if item.env_id in minimums and item.size <= batch_size:
            by_env.setdefault(item.env_id, []).append(idx)
    if any(env not in by_env for env in minimums):
        return None  # an env with a guaranteed share has nothing queued: wait for it

    total_min = sum(minimums.values())
    if total_min > batch_size:
        # Scale down proportionally, keeping room for at least one group of each env.
        scale = batch_size / total_min
        minimums = {
            env: max(min(items[i].size for i in by_env[env]), int(want * scale))
            for env, want in minimums.items()
        }

    taken: list[int] = []
    used = 0
    for env, want in minimums.items():
        got = 0
        for idx in by_env[env]:
            if got >= want:
                break
            size = items[idx].size
            if used + size > batch_size:
                continue
            taken.append(idx)
            got += size
            used += size

    taken_set = set(taken)
    rest = [i for i in range(len(items)) if i not in taken_set]
    if used < batch_size:
        fill = exact_fill([items[i].size for i in rest], batch_size - used)
        if fill is None:
            return _fallback_with_minimums(items, batch_size, minimums, by_env)
        taken.extend(rest[j] for j in fill)
    return sorted(taken)


def _fallback_with_minimums(
    items: Sequence[PackItem],
    batch_size: int,
    minimums: Mapping[int, int],
    by_env: Mapping[int, list[int]],
) -> list[int] | None:
    """Second chance when the greedy minimum pass blocked an exact fill.

    Tries the plain FIFO exact fill and keeps it if it still honours every minimum (each env
    gets ``min(minimum, what it has queued)`` sequences).
    """
    chosen = exact_fill([item.size for item in items], batch_size)
    if chosen is None:
        return None
    for env, want in minimums.items():
        have = sum(items[i].size for i in by_env[env])
        got = sum(items[i].size for i in chosen if items[i].env_id == env)
        if got < min(want, have):
            return None
    return chosen
