"""TrajectoryQueue through its library API, with the memory and the SQLite store alike."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from atroposlib.api.models import RegisterEnv, Registration, ScoredData
from atroposlib.api.queue import PreparedGroup, QueueFull, QueueLimits, Refused, TrajectoryQueue
from atroposlib.api.store import MemoryStore, SqliteStore
from tests.api.helpers import env_registration, group, registration


def prepared(
    size: int = 2,
    tag: int = 0,
    env_id: int | None = None,
    length: int = 4,
    prompt: int | None = None,
):
    """A group tagged ``tag``; ``prompt``: the token its sequences start with (the prompt
    shared by parts of one prompt's group), else ``tag``."""
    body = group(size, length=length, env_id=env_id, tag=tag)
    if prompt is not None:
        body["tokens"] = [[prompt] + seq[1:] for seq in body["tokens"]]
    data = ScoredData.model_validate(body)
    return PreparedGroup(env_id, size, length, data.model_dump_json().encode())


def batch_tags(result: list[bytes] | dict) -> list[int]:
    assert isinstance(result, list), result
    return [orjson.loads(payload)["tokens"][0][0] for payload in result]


@pytest.fixture(params=["memory", "sqlite"])
def make_queue(request: pytest.FixtureRequest, tmp_path: Path):
    """Build queues on one store location; a second call reopens the same store."""
    opened: list[TrajectoryQueue] = []

    def make(limits: QueueLimits | None = None) -> TrajectoryQueue:
        if request.param == "memory":
            store = MemoryStore()
        else:
            store = SqliteStore(tmp_path / "queue.sqlite3")
        queue = TrajectoryQueue(store, limits)
        opened.append(queue)
        return queue

    yield make
    for queue in opened:
        queue.store.close()


def running(queue: TrajectoryQueue, batch_size: int = 4) -> None:
    queue.register_trainer(Registration(**registration(batch_size)))
    assert queue.take_batch() == {"batch": None}


def test_fifo_batches_and_step(make_queue) -> None:
    queue = make_queue()
    running(queue, batch_size=4)
    queue.add_groups([prepared(2, tag=t) for t in range(5)])
    assert batch_tags(queue.take_batch()) == [0, 1]
    assert batch_tags(queue.take_batch()) == [2, 3]
    assert queue.take_batch() == {"batch": None}
    assert queue.status() == {"current_step": 2, "queue_size": 1}


def test_all_or_nothing_list(make_queue) -> None:
    queue = make_queue()
    running(queue, batch_size=4)
    with pytest.raises(Refused) as err:
        queue.add_groups([prepared(2), prepared(2, env_id=3)])
    assert err.value.reason == "unknown_env" and err.value.loc == (1, "env_id")
    assert queue.status()["queue_size"] == 0
    assert queue.refused["unknown_env"] == 2


def test_limits_raise_queue_full(make_queue) -> None:
    queue = make_queue(QueueLimits(max_sequences=4, max_bytes=1 << 20, retry_after_s=3))
    running(queue, batch_size=4)
    queue.add_groups([prepared(2), prepared(2)])
    with pytest.raises(QueueFull) as err:
        queue.add_groups([prepared(2)])
    assert err.value.retry_after == 3 and err.value.reason == "queue_full"
    queue.take_batch()
    queue.add_groups([prepared(2)])  # room again once a batch went out


def test_state_survives_reopen(make_queue) -> None:
    queue = make_queue()
    running(queue, batch_size=4)
    env = queue.register_env(RegisterEnv(**env_registration(group_size=4)))["env_id"]
    queue.add_groups([prepared(4, tag=1, env_id=env), prepared(4, tag=2, env_id=env)])
    queue.add_groups([prepared(2, tag=3, env_id=env, prompt=9)])  # part of prompt 9's group
    assert batch_tags(queue.take_batch()) == [1]
    queue.store.close()

    again = make_queue()
    if isinstance(again.store, MemoryStore):
        assert again.status() == {"current_step": 0, "queue_size": 0}
        return
    assert again.status() == {"current_step": 1, "queue_size": 1}
    assert again.info()["batch_size"] == 4 and again.started
    assert again.envs[env]["real_name"] == "env_0"
    # the buffered half completes after the restart
    assert again.add_groups([prepared(2, tag=4, env_id=env, prompt=9)]) == [
        {"status": "buffered", "buffer_size": 0}
    ]
    assert batch_tags(again.take_batch()) == [2]
    merged = orjson.loads(again.take_batch()[0])
    assert [t[1] for t in merged["tokens"]] == [3, 3, 4, 4]


def test_reset_clears_store(make_queue) -> None:
    queue = make_queue()
    running(queue)
    queue.add_groups([prepared(2)])
    queue.reset()
    queue.store.close()
    again = make_queue()
    assert not again.registered and again.status() == {"current_step": 0, "queue_size": 0}


def test_groups_queued_before_register_that_cannot_fit_are_dropped_and_counted(
    make_queue,
) -> None:
    queue = make_queue()
    queue.add_groups([prepared(8, tag=1), prepared(2, tag=2, length=100), prepared(2, tag=3)])
    queue.register_trainer(Registration(**registration(batch_size=4, max_token_len=50)))
    assert queue.dropped == {"larger_than_batch": 1, "too_long": 1}
    queue.add_groups([prepared(2, tag=4)])
    assert batch_tags(queue.take_batch()) == [3, 4]
