"""The packer (property tests) and upstream's helpers in atroposlib.api.utils (pinned cases)."""

from __future__ import annotations

import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from atroposlib.api.packing import PackItem, exact_fill, merge_fill, pack_batch
from atroposlib.api.utils import (
    find_groups_summing_to_target,
    grab_batch_with_minimum_allocations,
    grab_exact_from_heterogeneous_queue,
)


def brute_force(sizes: list[int], target: int) -> list[int] | None:
    """Reference: the shortest prefix with an exact fill, then the lexicographically first set."""
    for end in range(1, len(sizes) + 1):
        found = []
        for r in range(1, end + 1):
            for combo in itertools.combinations(range(end), r):
                if end - 1 in combo and sum(sizes[i] for i in combo) == target:
                    found.append(list(combo))
        if found:
            return min(found)
    return None


sizes_st = st.lists(st.integers(min_value=1, max_value=9), min_size=0, max_size=12)


@settings(max_examples=300, deadline=None)
@given(sizes=sizes_st, target=st.integers(min_value=1, max_value=24))
def test_exact_fill_matches_reference(sizes: list[int], target: int) -> None:
    chosen = exact_fill(sizes, target)
    assert chosen == brute_force(sizes, target)
    if chosen is not None:
        assert sum(sizes[i] for i in chosen) == target
        assert chosen == sorted(set(chosen))


@settings(max_examples=300, deadline=None)
@given(sizes=sizes_st, target=st.integers(min_value=1, max_value=24))
def test_merge_fill_hits_the_target_when_any_subset_does(sizes: list[int], target: int) -> None:
    """The partial-group merge rule: indices summing exactly to the target, sorted, or [] only
    when no subset of the parts does; the greedy FIFO pick when that lands exactly."""
    chosen = merge_fill(sizes, target)
    assert chosen == sorted(set(chosen))
    if chosen:
        assert sum(sizes[i] for i in chosen) == target
    else:
        assert exact_fill(sizes, target) is None
    greedy, running = [], 0
    for i, size in enumerate(sizes):
        if running + size <= target:
            greedy.append(i)
            running += size
    if running == target:
        assert chosen == greedy


def test_merge_fill_prefers_the_newest_parts_when_greedy_misses() -> None:
    """Upstream's backtracking: when the FIFO scan does not land, the newest parts are taken
    (exact_fill, the batch packer, would take the oldest)."""
    sizes = [5, 2, 12, 2, 11]
    assert merge_fill(sizes, 13) == [3, 4]
    assert exact_fill(sizes, 13) == [1, 4]


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=16), min_size=1, max_size=60),
    batch=st.integers(min_value=1, max_value=64),
)
def test_draining_a_queue_never_loses_or_duplicates(sizes: list[int], batch: int) -> None:
    """Take batches until none fits: each has exactly `batch` sequences, groups keep queue
    order, nothing is served twice, and what is left admits no exact fill."""
    queue = list(enumerate(sizes))
    served: list[int] = []
    while True:
        picked = pack_batch([PackItem(s) for _, s in queue], batch)
        if picked is None:
            break
        assert sum(queue[i][1] for i in picked) == batch
        assert picked == sorted(picked)
        served.extend(queue[i][0] for i in picked)
        queue = [q for i, q in enumerate(queue) if i not in set(picked)]
    assert len(served) == len(set(served))
    assert sorted(served + [gid for gid, _ in queue]) == list(range(len(sizes)))
    assert exact_fill([s for _, s in queue], batch) is None


@settings(max_examples=100, deadline=None)
@given(
    group_size=st.sampled_from([1, 2, 4, 8]),
    multiple=st.integers(min_value=1, max_value=8),
    count=st.integers(min_value=0, max_value=40),
)
def test_uniform_groups_are_pure_fifo(group_size: int, multiple: int, count: int) -> None:
    batch = group_size * multiple
    picked = pack_batch([PackItem(group_size)] * count, batch)
    if count < multiple:
        assert picked is None
    else:
        assert picked == list(range(multiple))


def _meets(items: list[PackItem], chosen: list[int], needs: dict[int, int]) -> bool:
    got: dict[int | None, int] = {}
    for i in chosen:
        got[items[i].env_id] = got.get(items[i].env_id, 0) + items[i].size
    return all(got.get(env, 0) >= need for env, need in needs.items())


@settings(max_examples=400, deadline=None)
@given(
    queue=st.lists(
        st.tuples(st.integers(min_value=0, max_value=3), st.sampled_from([1, 2, 3, 4])),
        min_size=1,
        max_size=11,
    ),
    batch=st.sampled_from([4, 6, 8, 12]),
    fractions=st.dictionaries(
        st.integers(min_value=0, max_value=3), st.sampled_from([0.0, 0.25, 0.5]), max_size=2
    ),
)
def test_minimum_allocations_respected(
    queue: list[tuple[int, int]], batch: int, fractions: dict[int, float]
) -> None:
    """Whenever some exact batch gives every env with a minimum its share (or all it has),
    the packer returns such a batch; it never returns an inexact one."""
    items = [PackItem(size, env) for env, size in queue]
    picked = pack_batch(items, batch, fractions)
    wants = {env: int(batch * f) for env, f in fractions.items() if int(batch * f) > 0}
    if any(all(it.env_id != env for it in items) for env in wants):
        assert picked is None  # an env with a minimum and nothing queued holds batches back
        return
    needs = {
        env: min(want, sum(it.size for it in items if it.env_id == env))
        for env, want in wants.items()
    }
    exact = [
        list(c)
        for r in range(1, len(items) + 1)
        for c in itertools.combinations(range(len(items)), r)
        if sum(items[i].size for i in c) == batch
    ]
    if not exact:
        assert picked is None
        return
    assert picked is not None
    assert sum(items[i].size for i in picked) == batch
    assert picked == sorted(set(picked))
    if sum(wants.values()) <= batch and any(_meets(items, c, needs) for c in exact):
        assert _meets(items, picked, needs)


def test_minimum_env_without_data_holds_batches() -> None:
    items = [PackItem(2, 0)] * 8
    assert pack_batch(items, 4, {1: 0.5}) is None
    assert pack_batch(items, 4, {1: 0.0}) == [0, 1]


def test_mixed_sizes_starving_upstream_pack_here() -> None:
    sizes = [3, 4, 3, 4, 4, 3]
    assert grab_exact_from_heterogeneous_queue([{"tokens": [[0]] * s} for s in sizes], 7)[0] is None
    assert exact_fill(sizes, 7) == [0, 1]
    assert exact_fill([6, 6, 4], 10) == [0, 2]


# ---------------------------------------------------------------- upstream helpers, pinned


def _groups(sizes: list[int], env_ids: list[int] | None = None) -> list[dict]:
    out = []
    for i, size in enumerate(sizes):
        g = {"tokens": [[i]] * size, "id": i}
        if env_ids is not None:
            g["env_id"] = env_ids[i]
        out.append(g)
    return out


def test_find_groups_summing_to_target_pinned() -> None:
    cases = [
        ([1, 2, 1], 4, [0, 1, 2]),
        ([2, 2, 4], 4, [0, 1]),
        ([3, 1, 4], 5, [1, 2]),
        ([2, 4], 3, []),
        ([16, 8, 8], 32, [0, 1, 2]),
        ([1] * 16, 8, list(range(8))),
        ([2, 4, 2, 1], 6, [0, 1]),
        ([], 4, []),
    ]
    for sizes, target, expected in cases:
        assert find_groups_summing_to_target(_groups(sizes), target) == expected, sizes


def test_grab_exact_pinned() -> None:
    assert grab_exact_from_heterogeneous_queue([], 4) == (None, [])
    queue = _groups([2, 2, 4, 1, 1])
    batch, rest = grab_exact_from_heterogeneous_queue(queue, 8)
    assert [g["id"] for g in batch] == [0, 1, 2]
    assert [g["id"] for g in rest] == [3, 4]
    # batch 12 with groups of 8 never yields a batch (upstream's documented limit)
    assert grab_exact_from_heterogeneous_queue(_groups([8, 8, 8]), 12)[0] is None
    # size-3 groups never complete a pack next to size-4 groups
    batch, rest = grab_exact_from_heterogeneous_queue(_groups([3, 4, 3, 4]), 8)
    assert [g["id"] for g in batch] == [1, 3] and [g["id"] for g in rest] == [0, 2]
    # packs form in completion order: the two 1s complete a pack of 2 after the first 2
    batch, _ = grab_exact_from_heterogeneous_queue(_groups([1, 2, 1, 2]), 4)
    assert [g["id"] for g in batch] == [1, 0, 2]


def test_grab_exact_randomised_sizes_are_exact() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        queue = _groups([8] * rng.randint(0, 20))
        batch_size = 8 * rng.randint(1, 4)
        batch, rest = grab_exact_from_heterogeneous_queue(queue, batch_size)
        if batch is not None:
            assert sum(len(g["tokens"]) for g in batch) == batch_size
            assert len(batch) + len(rest) == len(queue)


def _env(env_id: int, fraction: float | None, connected: bool = True) -> dict:
    return {"registered_id": env_id, "min_batch_allocation": fraction, "connected": connected}


def test_grab_with_minimum_allocations_pinned() -> None:
    queue = _groups([2, 2, 2, 2, 2, 2], env_ids=[0, 0, 0, 0, 1, 1])
    batch, rest = grab_batch_with_minimum_allocations(queue, 4, [_env(0, None), _env(1, 0.5)])
    assert [g["id"] for g in batch] == [4, 0]
    assert [g["id"] for g in rest] == [1, 2, 3, 5]
    # no minimums: same as grab_exact
    batch, _ = grab_batch_with_minimum_allocations(queue, 4, [_env(0, None)])
    assert [g["id"] for g in batch] == [0, 1]
    # env with a minimum but no items
    assert grab_batch_with_minimum_allocations(queue, 4, [_env(2, 0.5)])[0] is None
    # disconnected envs are ignored
    batch, _ = grab_batch_with_minimum_allocations(queue, 4, [_env(2, 0.5, connected=False)])
    assert [g["id"] for g in batch] == [0, 1]
    # over-100% minimums are scaled down
    batch, _ = grab_batch_with_minimum_allocations(queue, 4, [_env(0, 0.8), _env(1, 0.8)])
    assert sorted(g["id"] for g in batch) == [0, 4]
    assert grab_batch_with_minimum_allocations([], 4, [_env(0, 0.5)]) == (None, [])
    # not enough data
    assert grab_batch_with_minimum_allocations(queue[:1], 4, [_env(0, 0.5)])[0] is None
