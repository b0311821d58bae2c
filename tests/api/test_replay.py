"""``run-api --store PATH --record`` keeps the batches it hands out; ``run-api --replay PATH``
serves them to a trainer again, in their original batches or re-packed, with their original
policy versions; the same store replayed twice gives byte-identical batches. Real run-api
processes over loopback HTTP, and the CLI's errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import orjson

from tests.api.helpers import add_env, group, registration, tags
from tests.conftest import REPO


def drain(url: str, batch_size: int, ack: bool = False) -> list[tuple[int, bytes]]:
    """Register and pull every batch: ``(step, body)`` pairs (bodies as sent, uncompressed)."""
    pulled: list[tuple[int, bytes]] = []
    with httpx.Client(base_url=url, timeout=30, headers={"Accept-Encoding": "identity"}) as api:
        assert api.post("/register", json=registration(batch_size)).status_code == 200
        last = 0
        while True:
            reply = api.get("/batch", params={"ack": last} if ack else {})
            if orjson.loads(reply.content)["batch"] is None:
                return pulled
            last = int(reply.headers["X-Atropos-Step"])
            pulled.append((last, reply.content))


def record_run(start_api, store: Path) -> list[tuple[int, bytes]]:
    """A run with --record: an env sends groups of 2 (versioned 0..), a trainer pulls batches
    of 4, acknowledging every other one. Returns what the trainer got."""
    server = start_api("--store", str(store), "--record")
    served: list[tuple[int, bytes]] = []
    with httpx.Client(
        base_url=server.url, timeout=30, headers={"Accept-Encoding": "identity"}
    ) as api:
        assert api.post("/register", json=registration(4)).status_code == 200
        assert api.get("/batch").json() == {"batch": None}
        env = add_env(api, group_size=2)
        for tag in range(12):
            body = group(2, env_id=env, tag=tag)
            body["policy_version"] = tag // 4
            assert api.post("/scored_data", json=body).status_code == 200
        for i in range(6):
            reply = api.get("/batch", params={"ack": i} if i % 2 else {})
            served.append((int(reply.headers["X-Atropos-Step"]), reply.content))
        api.get("/batch", params={"ack": 6})  # the last batch acknowledged
    server.stop()
    return served


def test_replay_serves_the_recorded_batches_byte_for_byte(start_api, tmp_path: Path) -> None:
    store = tmp_path / "run.sqlite3"
    served = record_run(start_api, store)
    assert [step for step, _ in served] == [1, 2, 3, 4, 5, 6]

    first = start_api("--replay", str(store))
    second = start_api("--replay", str(store))  # replays only read: both can run at once
    # the trainer's batch_size is not used in the original batches
    assert drain(first.url, batch_size=8) == served
    assert drain(second.url, batch_size=4, ack=True) == served

    with httpx.Client(base_url=first.url, timeout=30) as api:
        batch = orjson.loads(served[2][1])["batch"]
        assert [g["policy_version"] for g in batch] == [1, 1]  # the recorded versions
        env_post = api.post("/scored_data", json=group(2, tag=99))
        assert env_post.status_code == 409 and "replay" in env_post.text
        assert api.post("/register-env", json={
            "max_token_length": 8, "desired_name": "e", "weight": 1.0, "group_size": 2
        }).status_code == 409  # fmt: skip
        # a reset starts the replay over
        assert api.get("/reset_data").status_code == 200
    assert drain(first.url, batch_size=4) == served


def test_repacked_replay_is_identical_twice(start_api, tmp_path: Path) -> None:
    store = tmp_path / "run.sqlite3"
    served = record_run(start_api, store)
    recorded_tags = [t for _, body in served for t in tags(orjson.loads(body)["batch"])]

    runs = []
    for _ in range(2):
        server = start_api("--replay", str(store), "--replay-mode", "repack")
        runs.append(drain(server.url, batch_size=8))
        server.stop()
    assert runs[0] == runs[1]
    assert [step for step, _ in runs[0]] == [1, 2, 3]
    replayed_tags = [t for _, body in runs[0] for t in tags(orjson.loads(body)["batch"])]
    assert replayed_tags == recorded_tags  # the recorded groups, in their recorded order


def _run_api(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "atroposlib.cli.run_api", "--port", "0", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_replay_and_record_errors_are_clear(tmp_path: Path, start_api) -> None:
    unrecorded = tmp_path / "plain.sqlite3"
    server = start_api("--store", str(unrecorded))
    with httpx.Client(base_url=server.url, timeout=30) as api:
        assert api.post("/register", json=registration(4)).status_code == 200
    server.stop()
    done = _run_api("--replay", str(unrecorded))
    assert done.returncode == 1 and "recorded no batches" in done.stderr, done.stderr
    done = _run_api("--replay", str(tmp_path / "missing.sqlite3"))
    assert done.returncode == 1 and "no store at" in done.stderr, done.stderr
    done = _run_api("--record")
    assert done.returncode == 2 and "--store PATH --record" in done.stderr, done.stderr
    done = _run_api("--replay", str(unrecorded), "--store", str(unrecorded))
    assert done.returncode == 2 and "not with store" in done.stderr, done.stderr
