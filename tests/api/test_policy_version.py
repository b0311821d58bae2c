"""``policy_version`` on the wire and ``run-api --max-staleness``, over loopback HTTP: the field
is validated (422 naming it), kept through the queue, both stores (across a restart) and
``/batch``, merged partial groups keep the oldest version, and stale groups are dropped when a
batch is formed, counted in ``/metrics``, with nothing else lost. Plus: upstream's 0.4.0
run-api accepts a group that carries the field."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.helpers import add_env, group, start_run, tags
from tests.conftest import free_port

UPSTREAM_KEYS = {
    "tokens",
    "masks",
    "scores",
    "advantages",
    "ref_logprobs",
    "messages",
    "generation_params",
    "inference_logprobs",
    "overrides",
    "group_overrides",
    "images",
    "env_id",
    "distill_token_ids",
    "distill_logprobs",
}


def versioned(tag: int, version: int | None, size: int = 2, env_id: int | None = None) -> dict:
    body = group(size=size, env_id=env_id, tag=tag)
    if version is not None:
        body["policy_version"] = version
    return body


def take(client: httpx.Client) -> tuple[int, list[dict[str, Any]]]:
    """The next batch and its step (fails when none is ready)."""
    reply = client.get("/batch")
    batch = reply.json()["batch"]
    assert batch, reply.json()
    return int(reply.headers["X-Atropos-Step"]), batch


def metrics(client: httpx.Client) -> dict[str, Any]:
    return client.get("/metrics", params={"format": "json"}).json()


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "bad", [-1, 1.5, 2.0, "3", True, [1], {"v": 1}, 1 << 63, 1 << 64], ids=repr
)
def test_bad_policy_version_is_a_422_naming_it(api: httpx.Client, bad: Any) -> None:
    body = versioned(1, None)
    body["policy_version"] = bad
    reply = api.post("/scored_data", json=body)
    assert reply.status_code == 422, reply.text
    (error,) = reply.json()["detail"]
    assert error["loc"] == ["body", "policy_version"], error

    many = [versioned(1, 0), {**versioned(2, None), "policy_version": bad}]
    reply = api.post("/scored_data_list", json=many)
    assert reply.status_code == 422
    assert reply.json()["detail"][0]["loc"] == ["body", 1, "policy_version"]
    assert metrics(api)["queue_groups"] == 0  # all or none


def test_largest_version_and_null_are_accepted(api: httpx.Client) -> None:
    start_run(api, batch_size=4)
    assert api.post("/scored_data", json=versioned(1, (1 << 63) - 1)).status_code == 200
    assert api.post("/scored_data", json={**versioned(2, None), "policy_version": None}).json() == {
        "status": "received"
    }
    _, batch = take(api)
    assert [g.get("policy_version", "absent") for g in batch] == [(1 << 63) - 1, "absent"]


def test_version_ahead_of_the_trainer_is_taken_and_counted(api: httpx.Client) -> None:
    """A policy_version newer than any weights the trainer can have made (it has been handed
    ``step`` batches) used to be accepted silently: now it is counted and logged (a trainer
    that counts several optimizer steps per batch makes them; so does a server from another
    run). Before /register nothing is ahead of anything."""
    before = metrics(api)["policy_version_ahead"]
    api.post("/scored_data", json=versioned(1, 50))  # before /register: no step yet
    start_run(api, batch_size=2)  # its /batch hands that group out: step 1
    assert metrics(api)["policy_version_ahead"] == before
    assert api.post("/scored_data", json=versioned(2, 1)).json() == {"status": "received"}
    assert api.post("/scored_data", json=versioned(3, 2)).json() == {"status": "received"}
    assert metrics(api)["policy_version_ahead"] == before + 1
    assert "atropos_policy_version_ahead_groups_total" in api.get("/metrics").text
    served = [take(api) for _ in range(2)]
    assert [(step, batch[0]["policy_version"]) for step, batch in served] == [(2, 1), (3, 2)]


# ---------------------------------------------------------------- carried end to end


def test_version_is_carried_to_batch_and_absent_when_not_sent(api: httpx.Client) -> None:
    start_run(api, batch_size=6)
    api.post("/scored_data", json=versioned(1, 7))
    api.post("/scored_data_list", json=[versioned(2, None), versioned(3, 0)])
    latest = api.get("/latest_example").json()
    assert latest["policy_version"] == 0
    _, batch = take(api)
    assert tags(batch) == [1, 2, 3]
    assert set(batch[0]) == UPSTREAM_KEYS | {"policy_version"}
    assert batch[0]["policy_version"] == 7
    assert set(batch[1]) == UPSTREAM_KEYS  # an upstream client's group keeps upstream's shape
    assert batch[2]["policy_version"] == 0


def test_merged_partial_groups_keep_the_oldest_version(api: httpx.Client) -> None:
    start_run(api, batch_size=8)
    env = add_env(api, group_size=4)

    def part(tag: int, version: int | None, prompt: int) -> dict:
        body = versioned(tag, version, env_id=env)
        body["tokens"] = [[prompt, tag, tag, tag]] * 2  # parts of one prompt's group
        return body

    parts = [part(1, 5, prompt=100), part(2, 3, prompt=100)]
    assert [api.post("/scored_data", json=p).json()["status"] for p in parts] == [
        "buffered",
        "buffered",
    ]
    # a part without a version counts as current: the merged group keeps the other's
    api.post("/scored_data", json=part(3, None, prompt=101))
    api.post("/scored_data", json=part(4, 9, prompt=101))
    api.post("/scored_data", json=part(5, None, prompt=102))
    api.post("/scored_data", json=part(6, None, prompt=102))
    _, batch = take(api)
    assert [len(g["tokens"]) for g in batch] == [4, 4]
    assert [g.get("policy_version", "absent") for g in batch] == [3, 9]


@pytest.mark.parametrize("durable", [False, True], ids=["memory", "sqlite"])
def test_both_stores_keep_versions_and_a_restart_keeps_them(
    start_api, tmp_path: Path, durable: bool
) -> None:
    args = ("--store", str(tmp_path / "q.sqlite3")) if durable else ()
    server = start_api(*args)
    with httpx.Client(base_url=server.url, timeout=10) as client:
        start_run(client, batch_size=2)
        client.post("/scored_data_list", json=[versioned(t, t * 10) for t in range(1, 4)])
        client.post("/scored_data", json=versioned(4, None))
        step, batch = take(client)
        assert (step, [g["policy_version"] for g in batch]) == (1, [10])
    if not durable:
        return
    server.stop()
    again = start_api(*args, port=server.port)
    with httpx.Client(base_url=again.url, timeout=10) as client:
        got = [take(client)[1][0] for _ in range(3)]
    assert [g["tokens"][0][0] for g in got] == [2, 3, 4]
    assert [g.get("policy_version", "absent") for g in got] == [20, 30, "absent"]


def test_store_written_before_policy_versions_is_upgraded(start_api, tmp_path: Path) -> None:
    """A store file from before this field (no ``policy_version`` column) opens, serves its
    groups as they were, and then keeps versions."""
    import json
    import sqlite3

    from tests.api.helpers import registration

    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(
        """
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE envs (env_id INTEGER PRIMARY KEY, record TEXT NOT NULL);
        CREATE TABLE groups (gid INTEGER PRIMARY KEY, env_id INTEGER, size INTEGER NOT NULL,
            buffered INTEGER NOT NULL DEFAULT 0, payload BLOB NOT NULL, served_step INTEGER);
        """
    )
    meta = {"registration": registration(2), "step": 4, "started": True, "requesters": []}
    db.executemany("INSERT INTO meta VALUES (?, ?)", [(k, json.dumps(v)) for k, v in meta.items()])
    old = {key: None for key in UPSTREAM_KEYS} | group(size=2, tag=9)
    db.execute("INSERT INTO groups(gid, env_id, size, payload) VALUES (1, NULL, 2, ?)",
               (json.dumps(old).encode(),))  # fmt: skip
    db.commit()
    db.close()
    server = start_api("--store", str(path), "--max-staleness", "0")
    with httpx.Client(base_url=server.url, timeout=10) as client:
        step, batch = take(client)
        assert (step, tags(batch), set(batch[0])) == (5, [9], UPSTREAM_KEYS)
        client.post("/scored_data_list", json=[versioned(1, 2), versioned(2, 5)])
        step, batch = take(client)  # (6 - 1) - 2 > 0: the first is stale
        assert (step, tags(batch), batch[0]["policy_version"]) == (6, [2], 5)
        assert metrics(client)["dropped"] == {"stale": 1}


# ---------------------------------------------------------------- --max-staleness


def test_max_staleness_0_serves_version_0_at_step_1_and_drops_it_at_step_2(start_api) -> None:
    """Staleness as TRL counts it: the batch of step s is trained on version s - 1, so version-0
    data at step 1 is on-policy (staleness 0) and ``--max-staleness 0`` keeps it."""
    server = start_api("--max-staleness", "0")
    with httpx.Client(base_url=server.url, timeout=10) as client:
        start_run(client, batch_size=2)  # one group of 2 per batch
        client.post(
            "/scored_data_list",
            json=[versioned(1, 0), versioned(2, 0), versioned(3, 1), versioned(4, None)],
        )
        assert take(client)[0] == 1  # the first version-0 group: (1 - 1) - 0 = 0, served
        step, batch = take(client)  # the second: (2 - 1) - 0 = 1 > 0, dropped; the next
        # (version 1, on-policy at step 2) served
        assert (step, tags(batch)) == (2, [3])
        m = metrics(client)
        assert m["dropped"] == {"stale": 1}
        assert m["max_staleness"] == 0
        text = client.get("/metrics").text
        assert 'atropos_dropped_groups_total{reason="stale"} 1' in text
        # a group without a version is never stale, however late it is served
        step, batch = take(client)
        assert (step, tags(batch), "policy_version" in batch[0]) == (3, [4], False)
        assert client.get("/batch").json() == {"batch": None}
    assert "Dropped 1 stale group(s)" in server.log_path.read_text()


def test_without_max_staleness_nothing_is_stale(api: httpx.Client) -> None:
    start_run(api, batch_size=2)
    api.post("/scored_data_list", json=[versioned(t, 0) for t in range(5)])
    assert [take(api)[1][0]["tokens"][0][0] for _ in range(5)] == [0, 1, 2, 3, 4]
    assert "stale" not in metrics(api)["dropped"]


def test_every_accepted_group_is_served_or_counted_stale(start_api) -> None:
    """Versions lagging the step by 0..4, K=2, mixed group sizes: the accepted groups are
    exactly the served ones plus the dropped ones, and nothing served is stale."""
    server = start_api("--max-staleness", "2")
    sent: dict[int, int | None] = {}
    served: list[tuple[int, dict]] = []
    with httpx.Client(base_url=server.url, timeout=10) as client:
        start_run(client, batch_size=4)
        tag = 0
        for _ in range(12):
            step = metrics(client)["step"]
            for lag in (0, 1, 2, 3, 4, None):
                version = None if lag is None else max(0, step - lag)
                body = versioned(tag, version, size=2 if tag % 3 else 4)
                assert client.post("/scored_data", json=body).status_code == 200
                sent[tag] = version
                tag += 1
            for _ in range(2):
                reply = client.get("/batch")
                if reply.json()["batch"]:
                    step_served = int(reply.headers["X-Atropos-Step"])
                    served += [(step_served, g) for g in reply.json()["batch"]]
        m = metrics(client)
    served_tags = [g["tokens"][0][0] for _, g in served]
    assert len(served_tags) == len(set(served_tags))
    dropped = m["dropped"].get("stale", 0)
    assert dropped > 0
    assert m["accepted_groups"] == len(sent)
    assert len(served_tags) + dropped + m["queue_groups"] == len(sent)
    for step_served, g in served:
        if g.get("policy_version") is not None:
            assert (step_served - 1) - g["policy_version"] <= 2
        assert g.get("policy_version") == sent[g["tokens"][0][0]]


def test_durable_store_enforces_staleness_after_a_restart(start_api, tmp_path: Path) -> None:
    args = ("--store", str(tmp_path / "q.sqlite3"), "--max-staleness", "0")
    server = start_api(*args)
    with httpx.Client(base_url=server.url, timeout=10) as client:
        start_run(client, batch_size=2)
        client.post("/scored_data_list", json=[versioned(1, 0), versioned(2, 0), versioned(3, 1)])
        assert take(client)[0] == 1
    server.kill9()
    again = start_api(*args, port=server.port)
    with httpx.Client(base_url=again.url, timeout=10) as client:
        step, batch = take(client)
        assert (step, tags(batch)) == (2, [3])
        assert metrics(client)["dropped"] == {"stale": 1}


def test_redelivered_batch_is_not_rechecked(start_api) -> None:
    server = start_api("--max-staleness", "0")
    with httpx.Client(base_url=server.url, timeout=10) as client:
        start_run(client, batch_size=2)
        client.post("/scored_data_list", json=[versioned(1, 0), versioned(2, 1)])
        first = client.get("/batch", params={"ack": 0})
        assert tags(first.json()["batch"]) == [1]
        # the response was "lost": the trainer asks again, acknowledging nothing new
        again = client.get("/batch", params={"ack": 0})
        assert again.headers.get("X-Atropos-Redelivered") == "1"
        assert again.json() == first.json()
        assert metrics(client)["dropped"] == {}


def test_max_staleness_flag_is_validated() -> None:
    from atroposlib.cli.run_api import parse_settings

    settings, _ = parse_settings(["--max-staleness", "3"], environ={})
    assert settings.max_staleness == 3
    assert parse_settings([], environ={})[0].max_staleness is None
    assert parse_settings([], environ={"ATROPOS_MAX_STALENESS": "2"})[0].max_staleness == 2
    with pytest.raises(SystemExit):
        parse_settings(["--max-staleness", "-1"], environ={})


# ---------------------------------------------------------------- upstream's run-api

UPSTREAM_PY = Path(os.environ.get("ATROPOS_UPSTREAM_PYTHON", "/tmp/upstream-venv/bin/python"))


@pytest.mark.slow
@pytest.mark.skipif(
    not UPSTREAM_PY.exists(), reason=f"upstream atroposlib 0.4.0 not found at {UPSTREAM_PY}"
)
def test_upstream_run_api_accepts_and_ignores_policy_version(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATROPOS_")}
    with open(tmp_path / "api.log", "wb") as log:
        proc = subprocess.Popen(
            [str(UPSTREAM_PY), "-m", "atroposlib.cli.run_api", "--port", str(port)],
            cwd="/",
            env={**env, "PYTHONPATH": ""},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
                deadline = time.monotonic() + 60
                while True:
                    try:
                        client.get("/status")
                        break
                    except httpx.TransportError:
                        assert time.monotonic() < deadline, (tmp_path / "api.log").read_text()
                        time.sleep(0.2)
                start_run(client, batch_size=4)
                one = client.post("/scored_data", json=versioned(1, 3))
                assert (one.status_code, one.json()["status"]) == (200, "received")
                many = client.post("/scored_data_list", json=[versioned(2, 4)])
                assert many.status_code == 200
                batch = client.get("/batch").json()["batch"]
                assert sorted(tags(batch)) == [1, 2]
        finally:
            proc.terminate()
            proc.wait(10)
