"""Pure decisions of the env's main loop: when to evaluate, stop, pause, and how many workers.

``BaseEnv`` calls these with the latest ``/status-env`` reply (``status``), so the rules can be
read and tested without a server. ``status`` keys: ``current_step``, ``queue_size`` (this env's
view of the queue, in groups of its size), ``self_queue_size``, ``max_group_size``,
``unallocated_fraction`` and ``env_weight``.

**Rollouts in flight follow the acceptance rate.** Not every rollout ends as a group in the
queue: groups whose scores are all alike are dropped (no learning signal), others fail. The
worker cap counts groups the off-policy window still misses; dividing it by the measured
acceptance rate (:func:`acceptance_rate`: groups sent per finished rollout, over the latest
:data:`ACCEPTANCE_WINDOW` rollouts) keeps enough rollouts in flight to fill it in one round
instead of several (a recipe that drops 68% of its groups as flat needs three rounds at an
acceptance rate of 1). ``max_num_workers`` still bounds it, and the window's meaning is kept:
rollouts started beyond the plain cap are the surplus, cancelled when the queue is full
(their items are rolled out again later).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = [
    "ACCEPTANCE_WINDOW",
    "MIN_ACCEPTANCE",
    "acceptance_rate",
    "crossed_multiple",
    "derived_batch_size",
    "min_allocation_satisfied",
    "min_workers_for_allocation",
    "projected_step",
    "queue_is_full",
    "train_worker_cap",
]


#: Finished rollouts the acceptance rate is measured over (the latest ones: it follows the
#: policy as it learns).
ACCEPTANCE_WINDOW = 32
#: Lowest acceptance rate the cap divides by: with every group dropped, at most 10x the
#: missing groups are in flight (``max_num_workers`` bounds it anyway).
MIN_ACCEPTANCE = 0.1


def acceptance_rate(finished_rollouts: int, groups_sent: int) -> float:
    """Groups sent per finished rollout (``groups sent / groups generated`` when each rollout
    makes one group), from ``MIN_ACCEPTANCE`` up; 1.0 before any rollout finished."""
    if finished_rollouts <= 0:
        return 1.0
    return max(MIN_ACCEPTANCE, groups_sent / finished_rollouts)


def crossed_multiple(old_step: int, new_step: int, interval: int) -> bool:
    """Whether a multiple of ``interval`` lies in ``(old_step, new_step]``.

    Upstream compared ``old % interval > new % interval``, which misses a multiple whenever
    the step jumps by exactly ``interval`` (or more) between two polls. A non-positive
    ``interval`` disables the trigger; a step that goes backwards (API reset) never triggers.
    """
    if interval <= 0 or new_step <= old_step:
        return False
    return new_step // interval > old_step // interval


def derived_batch_size(
    batch_size: int, status: Mapping[str, Any] | None, min_batch_allocation: float | None
) -> int:
    """This env's share of a batch: ``batch_size * (unallocated + own minimum allocation)``.

    Before the first status (``status`` None), or with no batch size, it is ``batch_size``.
    """
    if status is None or batch_size == -1:
        return batch_size
    fraction = float(status.get("unallocated_fraction", 1.0))
    if min_batch_allocation is not None:
        fraction += min_batch_allocation
    return int(batch_size * fraction)


def projected_step(status: Mapping[str, Any], group_size: int, batch_size: int) -> int:
    """The trainer step once the queued data is consumed: ``step + queue * group // batch``."""
    queued_batches = status["queue_size"] * group_size // batch_size if batch_size > 0 else 0
    return status["current_step"] + queued_batches


def min_allocation_satisfied(
    status: Mapping[str, Any],
    group_size: int,
    batch_size: int,
    max_batches_offpolicy: int,
    min_batch_allocation: float | None,
) -> bool:
    """Whether this env's own queued groups already cover its minimum batch allocation over
    the off-policy window (always true without a minimum allocation)."""
    if min_batch_allocation is None:
        return True
    max_group = max(int(status.get("max_group_size", group_size)), 1)
    needed = math.ceil(min_batch_allocation * batch_size * max_batches_offpolicy / max_group) * (
        max_group // group_size
    )
    return needed - int(status.get("self_queue_size", 0)) <= 0


def queue_is_full(
    status: Mapping[str, Any],
    group_size: int,
    batch_size: int,
    max_batches_offpolicy: int,
    min_batch_allocation: float | None,
    derived_batch: int,
) -> bool:
    """Whether the env should stop starting new rollouts (in-flight ones still finish).

    The queue is full when it holds ``max_batches_offpolicy`` batches or more (and this env's
    minimum allocation, if any, is already covered). An unknown batch size (``derived_batch``
    of -1) also counts as full. ``max_batches_offpolicy <= 0`` means no limit.
    """
    if derived_batch == -1:
        return True
    if max_batches_offpolicy <= 0:
        return False
    if status["queue_size"] * group_size < max_batches_offpolicy * batch_size:
        return False
    return min_allocation_satisfied(
        status, group_size, batch_size, max_batches_offpolicy, min_batch_allocation
    )


def min_workers_for_allocation(
    status: Mapping[str, Any],
    group_size: int,
    batch_size: int,
    max_batches_offpolicy: int,
    min_batch_allocation: float,
) -> int:
    """Workers needed to fill this env's guaranteed share of the off-policy window, counted in
    units of the largest group size in the queue (upstream's formula)."""
    max_group = max(int(status.get("max_group_size", group_size)), 1)
    target_seqs = (
        math.ceil(min_batch_allocation * batch_size * max_batches_offpolicy / max_group)
        + max_group // group_size
    ) * max_group
    own_seqs = max_group * int(status.get("self_queue_size", 0)) // (max_group / group_size)
    return max(0, math.ceil((target_seqs - own_seqs) / group_size))


def train_worker_cap(
    max_num_workers: int,
    status: Mapping[str, Any],
    group_size: int,
    batch_size: int,
    max_batches_offpolicy: int,
    min_batch_allocation: float | None,
    derived_batch: int,
    acceptance: float = 1.0,
) -> int:
    """How many rollouts may run at once right now.

    At most ``max_num_workers``, and no more than the rollouts expected to fill the groups
    still missing from the off-policy window (``max_batches_offpolicy * derived_batch //
    group_size - queue_size``), given that a rollout yields ``acceptance`` groups on average
    (:func:`acceptance_rate`; 1.0: one rollout per missing group). An env with a minimum
    allocation may go above that to fill its own share.
    """
    cap = max_num_workers
    if max_batches_offpolicy > 0:
        window = max_batches_offpolicy * derived_batch // group_size - int(status["queue_size"])
        if window > 0:
            window = math.ceil(window / max(acceptance, MIN_ACCEPTANCE) - 1e-9)
        cap = min(cap, window)
    if min_batch_allocation is not None:
        cap = max(
            cap,
            min_workers_for_allocation(
                status, group_size, batch_size, max_batches_offpolicy, min_batch_allocation
            ),
        )
    return max(cap, 0)
