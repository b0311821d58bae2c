"""``run-api --store``: after ``kill -9`` and a restart, every acknowledged group is either still
queued or was handed out before the crash; none is lost and none is served twice."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from tests.api.helpers import add_env, group, start_run, tags


def test_kill_9_loses_and_duplicates_nothing(start_api, tmp_path: Path) -> None:
    store = tmp_path / "run.sqlite3"
    server = start_api("--store", str(store))
    with httpx.Client(base_url=server.url, timeout=10) as client:
        start_run(client, batch_size=8)
        env = add_env(client, group_size=2)

    acknowledged: set[int] = set()
    lock = threading.Lock()
    stop = threading.Event()

    def produce(first_tag: int) -> None:
        tag = first_tag
        with httpx.Client(base_url=server.url, timeout=5) as client:
            while not stop.is_set():
                try:
                    reply = client.post(
                        "/scored_data", json=group(2, length=64, env_id=env, tag=tag)
                    )
                except httpx.TransportError:
                    return  # the server died mid-request: this group was never acknowledged
                if reply.status_code == 200:
                    with lock:
                        acknowledged.add(tag)
                tag += 1

    producers = [threading.Thread(target=produce, args=(k * 1_000_000,)) for k in range(3)]
    for thread in producers:
        thread.start()

    served_before: list[int] = []
    with httpx.Client(base_url=server.url, timeout=10) as trainer:
        while len(served_before) < 40:
            batch = trainer.get("/batch").json()["batch"]
            if batch:
                served_before.extend(tags(batch))
            else:
                time.sleep(0.01)
        batches_before = trainer.get("/status").json()["current_step"]
    time.sleep(0.2)
    server.kill9()  # producers are still posting
    stop.set()
    for thread in producers:
        thread.join(10)

    again = start_api("--store", str(store), port=server.port)
    served_after: list[int] = []
    with httpx.Client(base_url=again.url, timeout=10) as trainer:
        status = trainer.get("/status").json()
        assert status["current_step"] == batches_before
        assert trainer.get("/info").json()["batch_size"] == 8
        while True:
            batch = trainer.get("/batch").json()["batch"]
            if not batch:
                break
            served_after.extend(tags(batch))
        leftover = trainer.get("/metrics", params={"format": "json"}).json()["queue_sequences"]
        assert leftover < 8
        # top the queue up with filler groups to flush what is left in one last batch
        filler = 999_999_999
        for _ in range((8 - leftover) // 2):
            trainer.post("/scored_data", json=group(2, env_id=env, tag=filler))
        last = tags(trainer.get("/batch").json()["batch"])
        served_after.extend(t for t in last if t != filler)

    everything = served_before + served_after
    assert len(everything) == len(set(everything)), "a group was served twice"
    assert acknowledged <= set(everything), "an acknowledged group was lost"
    assert len(acknowledged) > 40


# --- at-least-once delivery: GET /batch?ack=N --------------------------------------------------


def _fill(client: httpx.Client, env: int, first_tag: int, groups: int) -> None:
    for k in range(groups):
        reply = client.post("/scored_data", json=group(2, env_id=env, tag=first_tag + k))
        assert reply.status_code == 200, reply.text


def test_unacknowledged_batch_is_served_again_after_kill_9_mid_response(
    start_api, tmp_path: Path
) -> None:
    """The trainer gets the response headers of step 2, then the server dies before it reads the
    body: after a restart on the same store, ``ack=1`` hands out the same batch (same groups,
    same step) again; acknowledging it moves on; nothing is lost or served twice."""
    store = tmp_path / "run.sqlite3"
    server = start_api("--store", str(store))
    with httpx.Client(base_url=server.url, timeout=10) as client:
        start_run(client, batch_size=4)
        env = add_env(client, group_size=2)
        _fill(client, env, 100, 6)  # three batches of two groups
        first = client.get("/batch", params={"ack": 0})
        assert first.headers["X-Atropos-Step"] == "1"
        assert tags(first.json()["batch"]) == [100, 101]
        # the trainer asks for step 2 and dies with the server before reading the body
        with client.stream("GET", "/batch", params={"ack": 1}) as lost:
            assert lost.status_code == 200
            assert lost.headers["X-Atropos-Step"] == "2"
            server.kill9()

    again = start_api("--store", str(store), port=server.port)
    with httpx.Client(base_url=again.url, timeout=10) as trainer:
        resent = trainer.get("/batch", params={"ack": 1})
        assert resent.headers["X-Atropos-Step"] == "2"
        assert resent.headers["X-Atropos-Redelivered"] == "1"
        assert tags(resent.json()["batch"]) == [102, 103]
        # asking again without having received it (the same ack) repeats it once more
        assert tags(trainer.get("/batch", params={"ack": 1}).json()["batch"]) == [102, 103]
        nxt = trainer.get("/batch", params={"ack": 2})
        assert nxt.headers["X-Atropos-Step"] == "3"
        assert "X-Atropos-Redelivered" not in nxt.headers
        assert tags(nxt.json()["batch"]) == [104, 105]
        assert trainer.get("/batch", params={"ack": 3}).json() == {"batch": None}
        metrics = trainer.get("/metrics", params={"format": "json"}).json()
        assert metrics["unacknowledged_batches"] == 0
        assert metrics["redelivered_batches"] == 2
        assert trainer.get("/status").json()["current_step"] == 3


def test_ack_is_checked_and_plain_batch_stays_at_most_once(start_api, tmp_path: Path) -> None:
    """``ack`` ahead of the last step or not a step number is a 422 with a message; a trainer
    that never acknowledges (upstream's) gets upstream's behaviour: a batch is gone once handed
    out, even across a restart."""
    store = tmp_path / "run.sqlite3"
    server = start_api("--store", str(store))
    with httpx.Client(base_url=server.url, timeout=10) as client:
        start_run(client, batch_size=4)
        env = add_env(client, group_size=2)
        _fill(client, env, 1, 4)
        for bad in ("5", "-1", "x", str(2**70)):
            reply = client.get("/batch", params={"ack": bad})
            assert reply.status_code == 422, (bad, reply.status_code, reply.text)
            assert "ack" in reply.text
        plain = client.get("/batch")
        assert plain.headers["X-Atropos-Step"] == "1"
        assert tags(plain.json()["batch"]) == [1, 2]
        server.kill9()
    again = start_api("--store", str(store), port=server.port)
    with httpx.Client(base_url=again.url, timeout=10) as trainer:
        assert tags(trainer.get("/batch").json()["batch"]) == [3, 4]
        assert trainer.get("/metrics", params={"format": "json"}).json()["redelivered_batches"] == 0
