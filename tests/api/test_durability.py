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
