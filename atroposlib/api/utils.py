"""Upstream's batch-packing helpers, kept with their names, signatures and results.

Users import these three functions from ``atroposlib.api.utils``; they behave exactly as in
upstream Atropos 0.4 (including its limits: ``grab_exact_from_heterogeneous_queue`` only packs
group sizes that divide the largest group size present). The trajectory API server itself packs
batches with the general exact-fill packer in :mod:`atroposlib.api.packing`, which has none of
those limits.
"""

from __future__ import annotations

from typing import Any

from atroposlib.api.packing import merge_fill


def find_groups_summing_to_target(buffer: list[dict], target_size: int) -> list[int]:
    """Indices of groups in ``buffer`` whose sequence counts sum exactly to ``target_size``.

    First a greedy FIFO scan (take each group that still fits); if that does not land exactly,
    a subset-sum over all groups, backtracked from the newest group. Returns sorted indices, or
    ``[]`` when no subset hits the target. The rule is :func:`atroposlib.api.packing.merge_fill`
    on the groups' sizes, which the API server uses to merge partial groups.
    """
    return merge_fill([len(group["tokens"]) for group in buffer], target_size)


def _complete_packs(entries: list[tuple[int, int]], max_group_size: int) -> list[tuple[int, int]]:
    """Upstream's "packs": walk (index, size) pairs in order, bucket them by size, and release a
    bucket once its members add up to ``max_group_size``. Returns released pairs in order."""
    buckets: dict[int, list[tuple[int, int]]] = {}
    released: list[tuple[int, int]] = []
    for idx, size in entries:
        bucket = buckets.setdefault(size, [])
        bucket.append((idx, size))
        if len(bucket) * size == max_group_size:
            released.extend(bucket)
            bucket.clear()
    return released


def grab_exact_from_heterogeneous_queue(
    queue: list[dict[str, list]], batch_size: int
) -> tuple[list | None, list]:
    """Take exactly ``batch_size`` sequences of whole groups from ``queue``.

    Groups are first gathered into packs whose sizes sum to the largest group size present;
    packs are taken in the order they complete. Returns ``(batch, new_queue)``, or
    ``(None, queue)`` when no exact batch can be formed this way.
    """
    if not queue:
        return None, queue
    sizes = [len(item["tokens"]) for item in queue]
    if sum(sizes) < batch_size:
        return None, queue
    max_group_size = max(sizes)

    candidates = _complete_packs(list(enumerate(sizes)), max_group_size)
    if sum(size for _, size in candidates) < batch_size:
        return None, queue

    taken: list[int] = []
    running = 0
    for idx, size in candidates:
        taken.append(idx)
        running += size
        if running >= batch_size:
            break
    if running != batch_size:
        return None, queue

    taken_set = set(taken)
    batch = [queue[i] for i in taken]
    return batch, [item for i, item in enumerate(queue) if i not in taken_set]


def grab_batch_with_minimum_allocations(
    queue: list[dict[str, Any]], batch_size: int, env_configs: list[dict[str, Any]]
) -> tuple[list | None, list]:
    """Like :func:`grab_exact_from_heterogeneous_queue`, honouring per-env minimum shares.

    ``env_configs`` are the API's env records (``registered_id``, ``connected``,
    ``min_batch_allocation``). Connected envs with a minimum first get their packable groups
    (FIFO) up to ``int(batch_size * min_batch_allocation)`` sequences; the rest of the batch is
    filled from any env's packable groups in queue order. Returns ``(None, queue)`` when an env
    with a minimum has nothing packable, or when the batch cannot be filled exactly.
    """
    if not queue:
        return None, queue

    minimum_fraction = {
        env["registered_id"]: env["min_batch_allocation"]
        for env in env_configs
        if env.get("connected", False) and env.get("min_batch_allocation") is not None
    }
    if not minimum_fraction:
        return grab_exact_from_heterogeneous_queue(queue, batch_size)

    max_group_size = max(len(item.get("tokens", [])) for item in queue)
    entries_by_env: dict[Any, list[tuple[int, int]]] = {}
    for idx, item in enumerate(queue):
        env_id = item.get("env_id")
        if env_id is not None:
            entries_by_env.setdefault(env_id, []).append((idx, len(item.get("tokens", []))))
    packable = {
        env_id: _complete_packs(entries, max_group_size)
        for env_id, entries in entries_by_env.items()
    }

    wanted: dict[Any, int] = {}
    for env_id, fraction in minimum_fraction.items():
        need = int(batch_size * fraction)
        if need <= 0:
            continue
        if not packable.get(env_id):
            return None, queue
        wanted[env_id] = need

    if sum(wanted.values()) > batch_size:
        scale = batch_size / sum(wanted.values())
        for env_id in wanted:
            smallest = min(size for _, size in packable[env_id])
            wanted[env_id] = max(smallest, int(wanted[env_id] * scale))

    batch_indices: list[int] = []
    total = 0
    for env_id, need in wanted.items():
        got = 0
        for idx, size in packable[env_id]:
            if got >= need:
                break
            if total + size <= batch_size:
                batch_indices.append(idx)
                got += size
                total += size

    if total < batch_size:
        taken = set(batch_indices)
        packable_index = {idx: size for pairs in packable.values() for idx, size in pairs}
        for idx in range(len(queue)):
            if idx in taken or idx not in packable_index:
                continue
            size = packable_index[idx]
            if total + size <= batch_size:
                batch_indices.append(idx)
                total += size
            if total == batch_size:
                break

    if total != batch_size:
        return None, queue
    taken = set(batch_indices)
    batch = [queue[i] for i in batch_indices]
    return batch, [item for i, item in enumerate(queue) if i not in taken]
