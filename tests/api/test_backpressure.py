"""Bounded queue: past its limits POSTs get 429 with Retry-After, and memory stays bounded."""

from __future__ import annotations

import httpx

from tests.api.helpers import group, start_run


def test_sequence_limit_answers_429_then_recovers(start_api) -> None:
    server = start_api("--max-queue-sequences", "6", "--retry-after-s", "2")
    with httpx.Client(base_url=server.url) as client:
        start_run(client, batch_size=4)
        for _ in range(3):
            assert client.post("/scored_data", json=group(2)).status_code == 200
        full = client.post("/scored_data", json=group(2))
        assert full.status_code == 429
        assert full.headers["retry-after"] == "2"
        assert "queue is full" in full.text
        listed = client.post("/scored_data_list", json=[group(1)])
        assert listed.status_code == 429
        assert client.get("/batch").json()["batch"] is not None
        assert client.post("/scored_data", json=group(2)).status_code == 200
        metrics = client.get("/metrics", params={"format": "json"}).json()
        assert metrics["refused"]["queue_full"] == 2
        assert metrics["queue_sequences"] == 4


def test_byte_limit(start_api) -> None:
    server = start_api("--max-queue-bytes", "8K")
    with httpx.Client(base_url=server.url) as client:
        start_run(client, batch_size=2)
        accepted = 0
        while client.post("/scored_data", json=group(1, length=200)).status_code == 200:
            accepted += 1
            assert accepted < 100
        assert 2 <= accepted <= 8
        metrics = client.get("/metrics", params={"format": "json"}).json()
        assert metrics["queue_bytes"] <= 8 * 1024
        huge = client.post("/scored_data", json=group(2, length=2000))
        assert huge.status_code == 413 and "byte limit" in huge.text
