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


def merge_fill(sizes: Sequence[int], target: int) -> list[int]:
    """Pick indices of ``sizes`` summing exactly to ``target``: which buffered partial groups
    of an env are merged into one group of ``target`` sequences.

    Upstream's rule (``atroposlib.api.utils.find_groups_summing_to_target`` is this function
    on ``len(group["tokens"])``): a greedy FIFO scan first (take each part that still fits);
    if it does not land exactly, a subset-sum over all parts backtracked from the newest.
    Returns sorted indices, or ``[]`` when no subset hits the target. Unlike
    :func:`exact_fill` (used for batches) the fallback prefers the newest parts.
    """
    if not sizes:
        return []
    picked: list[int] = []
    running = 0
    for idx, size in enumerate(sizes):
        if running + size <= target:
            picked.append(idx)
            running += size
            if running == target:
                return picked

    # reachable[i]: set of sums reachable with the first i parts (as a bitset).
    mask = (1 << (target + 1)) - 1
    reachable = [1]
    for size in sizes:
        prev = reachable[-1]
        reachable.append(prev | ((prev << size) & mask) if size >= 0 else prev)
    if not (reachable[-1] >> target) & 1:
        return []

    chosen: list[int] = []
    remaining = target
    for i in range(len(sizes), 0, -1):
        size = sizes[i - 1]
        if remaining >= size and (reachable[i - 1] >> (remaining - size)) & 1:
            chosen.append(i - 1)
            remaining -= size
    return sorted(chosen)


def pack_batch(
    items: Sequence[PackItem],
    batch_size: int,
    min_allocations: Mapping[int, float] | None = None,
) -> list[int] | None:
    """Choose queue indices for one batch of exactly ``batch_size`` sequences.

    ``items`` is the queue in arrival order. ``min_allocations`` maps env ids of *connected*
    envs to their guaranteed batch fraction (0..1). Returns indices in queue order, or ``None``
    when no batch can be formed yet.

    With minimums, each such env ``e`` must get ``min(int(batch_size * f_e), queued_e)``
    sequences (scaled down when the minimums add up to more than a batch). If some exact batch
    meets every minimum, the returned one does; if none can (e.g. the sizes make it
    impossible), the plain FIFO exact fill is returned so the trainer never stalls forever.
    """
    if batch_size <= 0 or not items:
        return None
    if sum(item.size for item in items) < batch_size:
        return None

    wants = {
        env: int(batch_size * frac)
        for env, frac in (min_allocations or {}).items()
        if frac is not None and int(batch_size * frac) > 0
    }
    if not wants:
        return exact_fill([item.size for item in items], batch_size)

    by_env: dict[int, list[int]] = {}
    for idx, item in enumerate(items):
        if item.env_id in wants and item.size <= batch_size:
            by_env.setdefault(item.env_id, []).append(idx)
    if any(env not in by_env for env in wants):
        return None  # an env with a guaranteed share has nothing queued: wait for it

    total_want = sum(wants.values())
    if total_want > batch_size:
        # Scale down proportionally, keeping room for at least one group of each env.
        scale = batch_size / total_want
        wants = {
            env: max(min(items[i].size for i in by_env[env]), int(want * scale))
            for env, want in wants.items()
        }
    needs = {env: min(want, sum(items[i].size for i in by_env[env])) for env, want in wants.items()}

    def meets(chosen: list[int]) -> bool:
        got: dict[int | None, int] = {}
        for i in chosen:
            got[items[i].env_id] = got.get(items[i].env_id, 0) + items[i].size
        return all(got.get(env, 0) >= need for env, need in needs.items())

    greedy = _greedy_with_minimums(items, batch_size, needs, by_env)
    if greedy is not None and meets(greedy):
        return greedy
    solved = _solve_with_minimums(items, batch_size, needs, by_env)
    if solved is not None:
        return solved
    return exact_fill([item.size for item in items], batch_size)


def _greedy_with_minimums(
    items: Sequence[PackItem],
    batch_size: int,
    needs: Mapping[int, int],
    by_env: Mapping[int, list[int]],
) -> list[int] | None:
    """Upstream's order: each env's oldest groups until its minimum is met, then the oldest
    remaining groups (exact fill). Fast and FIFO; may miss a fill that exists."""
    taken: list[int] = []
    used = 0
    for env, need in needs.items():
        got = 0
        for idx in by_env[env]:
            if got >= need:
                break
            size = items[idx].size
            if used + size <= batch_size:
                taken.append(idx)
                got += size
                used += size
    if used < batch_size:
        taken_set = set(taken)
        rest = [i for i in range(len(items)) if i not in taken_set]
        fill = exact_fill([items[i].size for i in rest], batch_size - used)
        if fill is None:
            return None
        taken.extend(rest[j] for j in fill)
    return sorted(taken)


def _sumset(a: int, b: int, mask: int) -> int:
    """Bitset of {x + y : x in a, y in b}, truncated to ``mask``."""
    out = 0
    while a:
        low = a & -a
        out |= (b << (low.bit_length() - 1)) & mask
        a ^= low
    return out


def _solve_with_minimums(
    items: Sequence[PackItem],
    batch_size: int,
    needs: Mapping[int, int],
    by_env: Mapping[int, list[int]],
) -> list[int] | None:
    """Exact search: pick how many sequences each env with a minimum contributes (at least its
    need, from the sums its groups can make) so that, with the other groups, the batch is exact.
    Each env's share and the rest are then filled FIFO-first."""
    mask = (1 << (batch_size + 1)) - 1
    envs = list(needs)
    own = {i for env in envs for i in by_env[env]}
    rest = [i for i in range(len(items)) if i not in own]

    feasible = {
        env: _reach_bits([items[i].size for i in by_env[env]], mask) & ~((1 << needs[env]) - 1)
        for env in envs
    }
    totals = [_reach_bits([items[i].size for i in rest], mask)]
    for env in envs:
        totals.append(_sumset(feasible[env], totals[-1], mask))
    if not (totals[-1] >> batch_size) & 1:
        return None

    shares: dict[int, int] = {}
    remaining = batch_size
    for k in range(len(envs) - 1, -1, -1):
        env = envs[k]
        options = feasible[env]
        while options:  # smallest contribution first: minimums met, the rest stays FIFO
            low = options & -options
            share = low.bit_length() - 1
            if share <= remaining and (totals[k] >> (remaining - share)) & 1:
                break
            options ^= low
        shares[env] = share
        remaining -= share

    chosen: list[int] = []
    for env in envs:
        picked = exact_fill([items[i].size for i in by_env[env]], shares[env])
        assert picked is not None
        chosen.extend(by_env[env][j] for j in picked)
    if remaining:
        picked = exact_fill([items[i].size for i in rest], remaining)
        assert picked is not None
        chosen.extend(rest[j] for j in picked)
    return sorted(chosen)
