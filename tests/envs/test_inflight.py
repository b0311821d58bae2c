"""Rollouts in flight follow the measured acceptance rate (issue 28): enough to fill the
off-policy window when most groups are dropped, bounded by ``max_num_workers``, and the
surplus cancelled (items kept) once the queue is full. The throttle's rules and the serve
loop's worker handling, without servers."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from atroposlib.envs import throttle
from atroposlib.envs.config import EvalHandlingEnum
from atroposlib.envs.runtime import ServeLoop

# the arithmetic-learn recipe's shapes: batches of 64 sequences, groups of 16, one batch of
# off-policy window: 4 groups missing from an empty queue
GROUP, BATCH, WINDOW_BATCHES = 16, 64, 1


def cap(queue_size: int, acceptance: float, max_workers: int = 8) -> int:
    return throttle.train_worker_cap(
        max_workers,
        {"queue_size": queue_size, "current_step": 0},
        GROUP,
        BATCH,
        WINDOW_BATCHES,
        None,
        BATCH,
        acceptance,
    )


def test_acceptance_rate() -> None:
    assert throttle.acceptance_rate(0, 0) == 1.0  # nothing measured yet
    assert throttle.acceptance_rate(100, 32) == pytest.approx(0.32)
    assert throttle.acceptance_rate(10, 0) == throttle.MIN_ACCEPTANCE
    assert throttle.acceptance_rate(4, 8) == 2.0  # rollouts that make two groups each


def test_cap_divides_the_missing_groups_by_the_acceptance_rate() -> None:
    assert cap(0, 1.0) == 4  # as before: one rollout per missing group
    assert cap(0, 0.5) == 8
    assert cap(0, 0.32, max_workers=32) == 13  # ceil(4 / 0.32)
    assert cap(0, 0.32) == 8  # max_num_workers bounds it
    assert cap(0, 0.0, max_workers=100) == 40  # MIN_ACCEPTANCE: at most 10x
    assert cap(3, 0.25) == 4  # one group missing
    assert cap(4, 0.25) == 0  # the window is full: nothing more
    assert cap(6, 0.25) == 0
    assert cap(0, 2.0) == 2  # two groups per rollout
    # no window (max_batches_offpolicy <= 0): max_num_workers, as before
    status = {"queue_size": 0, "current_step": 0}
    assert throttle.train_worker_cap(8, status, GROUP, BATCH, 0, None, BATCH, 0.2) == 8


def fake_env(max_workers: int = 8) -> Any:
    items = iter(range(1000))

    async def get_next_item() -> int:
        return next(items)

    # the serve loop owns its rollouts (workers, running_items, backlog); the env only reads
    env = SimpleNamespace(
        max_num_workers=max_workers,
        config=SimpleNamespace(
            batch_size=BATCH,
            group_size=GROUP,
            max_batches_offpolicy=WINDOW_BATCHES,
            min_batch_allocation=None,
            eval_handling=EvalHandlingEnum.NONE,
            worker_timeout=0,
        ),
        status_dict={"current_step": 0, "queue_size": 0},
        curr_step=0,
        _sent_since_status=0,
        derived_batch_size=BATCH,
        groups_sent=0,
        get_next_item=get_next_item,
    )
    return env


async def started_loop(env: Any, finished: int, sent: int) -> ServeLoop:
    """A serve loop whose rollouts run until cancelled, after ``finished`` rollouts that
    sent ``sent`` groups."""
    loop = ServeLoop(env)
    release = asyncio.Event()

    async def handle_env(item_uuid: str) -> None:
        await release.wait()

    env.handle_env = handle_env
    for i in range(finished):
        env.groups_sent = sent * (i + 1) // finished
        loop._rollout_finished()
    return loop


async def test_rollouts_in_flight_follow_the_acceptance_rate() -> None:
    env = fake_env(max_workers=8)
    loop = await started_loop(env, finished=25, sent=8)  # 32% accepted
    assert loop.acceptance == pytest.approx(0.32)
    await loop.add_train_workers()
    assert len(loop.workers) == 8  # ceil(4 / 0.32) = 13, bounded by max_num_workers
    surplus = [e for e in loop.running_items.values() if e["surplus"]]
    assert len(surplus) == 4  # beyond the plain cap of 4 missing groups
    await asyncio.sleep(0)
    # the queue fills (4 groups queued): the surplus not yet sending is cancelled, and its
    # items are rolled out first when rollouts start again
    next(iter(surplus))["sending"] = True
    env.status_dict = {"current_step": 0, "queue_size": 4}
    loop._cancel_surplus()
    assert len(loop.workers) == 5
    assert loop.cancelled_surplus == 3
    assert sorted(item for item, _ in loop.retry_queue) == sorted(
        e["item"] for e in surplus if not e["sending"]
    )
    for entry in list(loop.running_items.values()):
        entry["worker"].cancel()
    await asyncio.sleep(0)


async def test_without_drops_nothing_changes() -> None:
    env = fake_env(max_workers=8)
    loop = await started_loop(env, finished=10, sent=10)
    await loop.add_train_workers()
    assert len(loop.workers) == 4  # one rollout per missing group, as before
    assert not any(e["surplus"] for e in loop.running_items.values())
    env.status_dict = {"current_step": 0, "queue_size": 4}
    loop._cancel_surplus()
    assert len(loop.workers) == 4 and loop.cancelled_surplus == 0  # in-flight ones finish
    for entry in list(loop.running_items.values()):
        entry["worker"].cancel()
    await asyncio.sleep(0)


async def test_cancelled_surplus_does_not_count_as_a_finished_rollout() -> None:
    env = fake_env(max_workers=8)
    loop = await started_loop(env, finished=10, sent=5)
    await loop.add_train_workers()
    before = loop.acceptance
    env.status_dict = {"current_step": 0, "queue_size": 4}
    loop._cancel_surplus()
    await asyncio.sleep(0)  # the cancelled tasks' done callbacks run
    assert loop.acceptance == before
    for entry in list(loop.running_items.values()):
        entry["worker"].cancel()
    await asyncio.sleep(0)
