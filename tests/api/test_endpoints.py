"""Every endpoint of the trajectory API, over loopback HTTP, as upstream clients call them."""

from __future__ import annotations

import gzip
import json

import httpx
import pytest
import requests

from tests.api.helpers import add_env, env_registration, group, registration, start_run, tags

FULL_KEYS = {
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


def test_probes_answer_get_and_head(api: httpx.Client) -> None:
    """``HEAD /health`` (what load balancers send) was a 405 although documented open."""
    for path in ("/", "/health"):
        head = api.head(path)
        assert head.status_code == 200 and head.content == b"", path
    assert api.get("/health").json()["status"] == "ok"


def test_root_and_unregistered_state(api: httpx.Client) -> None:
    assert api.get("/").json() == {"message": "AtroposLib API"}
    assert api.get("/info").json() == {"batch_size": -1, "max_token_len": -1}
    assert api.get("/status").json() == {"current_step": 0, "queue_size": 0}
    assert api.get("/wandb_info").json() == {"group": None, "project": None}
    assert api.get("/batch").json() == {
        "status": "error",
        "message": "Trainer not registered. Call /register first.",
        "batch": [],
    }
    latest = api.get("/latest_example").json()
    assert latest["tokens"] == [] and latest["images"] == []


def test_upstream_registration_flow(api: httpx.Client) -> None:
    """Trainer /register, env waits, first /batch opens registration, env registers."""
    reply = api.post("/register", json=registration(batch_size=8, max_token_len=1024))
    assert isinstance(reply.json()["uuid"], int)
    assert api.get("/info").json() == {"batch_size": 8, "max_token_len": 1024}
    assert api.get("/wandb_info").json() == {"group": "group", "project": "project"}

    early = api.post("/register-env", json=env_registration("gsm8k"))
    assert early.json() == {"status": "wait for trainer to start"}

    assert api.get("/batch").json() == {"batch": None}
    first = api.post("/register-env", json=env_registration("gsm8k")).json()
    second = api.post("/register-env", json=env_registration("gsm8k")).json()
    assert first == {
        "status": "success",
        "env_id": 0,
        "wandb_name": "gsm8k_0",
        "checkpoint_dir": "checkpoints",
        "starting_step": 0,
        "checkpoint_interval": 10,
        "num_steps": 100,
    }
    assert (second["env_id"], second["wandb_name"]) == (1, "gsm8k_1")

    # upstream envs send GET with a JSON body
    status = requests.get(f"{api.base_url}/status-env", json={"env_id": 0}).json()
    assert status == {
        "current_step": 0,
        "queue_size": 0,
        "unallocated_fraction": 1.0,
        "self_queue_size": 0,
        "max_group_size": 1,
        "env_weight": 0.5,
    }
    assert api.post("/status-env", json={"env_id": 0}).json() == status
    assert api.get("/status-env", params={"env_id": 0}).json() == status


def test_second_register_keeps_first_settings(api: httpx.Client) -> None:
    a = api.post("/register", json=registration(batch_size=4)).json()["uuid"]
    b = api.post("/register", json=registration(batch_size=16)).json()["uuid"]
    assert a != b
    assert api.get("/info").json()["batch_size"] == 4


def test_batches_are_fifo_and_step_counts_handed_out_batches(api: httpx.Client) -> None:
    start_run(api, batch_size=2)
    for tag in range(6):
        assert api.post("/scored_data", json=group(size=1, tag=tag)).json() == {
            "status": "received"
        }
    assert api.get("/status").json() == {"current_step": 0, "queue_size": 6}
    seen = []
    for step in (1, 2, 3):
        batch = api.get("/batch").json()["batch"]
        seen.append(tags(batch))
        assert api.get("/status").json()["current_step"] == step
    assert seen == [[0, 1], [2, 3], [4, 5]]
    assert api.get("/batch").json() == {"batch": None}
    assert api.get("/status").json() == {"current_step": 3, "queue_size": 0}


def test_batch_groups_carry_every_key(api: httpx.Client) -> None:
    start_run(api, batch_size=2)
    env = add_env(api, group_size=2)
    body = group(size=2, env_id=env)
    body["overrides"] = [{"set_advantage_to_zero": True}, {}]
    body["generation_params"] = {"temperature": 0.7}
    body["messages"] = [[{"role": "user", "content": "hi", "reward": None}]] * 2
    api.post("/scored_data", json=body)
    (got,) = api.get("/batch").json()["batch"]
    assert set(got) == FULL_KEYS
    assert got["env_id"] == env
    assert got["overrides"] == body["overrides"]
    assert got["generation_params"] == {"temperature": 0.7}
    assert got["advantages"] is None and got["distill_logprobs"] is None
    assert api.get("/latest_example").json() == got


def test_non_power_of_two_groups_pack_exactly(api: httpx.Client) -> None:
    """Group sizes 3 and 4 with batch 10: upstream starves the 3s; here 3+3+4 packs."""
    start_run(api, batch_size=10)
    for tag, size in enumerate([4, 3, 4, 3, 3, 4, 3]):
        api.post("/scored_data", json=group(size=size, tag=tag))
    # oldest-first: the shortest queue prefix holding an exact fill, earliest groups within it
    assert tags(api.get("/batch").json()["batch"]) == [0, 1, 3]
    assert tags(api.get("/batch").json()["batch"]) == [2, 4, 6]
    assert api.get("/batch").json() == {"batch": None}
    assert api.get("/status").json() == {"current_step": 2, "queue_size": 1}


def test_partial_groups_of_one_prompt_are_merged_into_one_group(api: httpx.Client) -> None:
    """Parts of one prompt's group (same tokens before the first trained position) are merged;
    tests/api/test_partial_groups.py has the rest of the rule."""
    start_run(api, batch_size=4)
    env = add_env(api, group_size=4)
    replies = []
    for t, s in enumerate([1, 2, 1]):
        part = group(size=s, env_id=env, tag=t)
        part["tokens"] = [[7, t, t, t] for _ in range(s)]  # prompt [7], answers t
        replies.append(api.post("/scored_data", json=part).json())
    assert replies == [
        {"status": "buffered", "buffer_size": 1},
        {"status": "buffered", "buffer_size": 3},
        {"status": "buffered", "buffer_size": 0},
    ]
    (merged,) = api.get("/batch").json()["batch"]
    assert [seq[1] for seq in merged["tokens"]] == [0, 1, 1, 2]
    assert len(merged["masks"]) == len(merged["scores"]) == 4


def test_scored_data_list(api: httpx.Client) -> None:
    start_run(api, batch_size=4)
    env = add_env(api, group_size=2)
    reply = api.post(
        "/scored_data_list", json=[group(2, env_id=env), group(1, env_id=env), group(2)]
    ).json()
    assert reply == {
        "status": "received",
        "groups_processed": 3,
        "buffered": 1,
        "last_buffer_size": 1,
    }
    assert api.get("/status").json()["queue_size"] == 2


def test_status_env_counts_own_and_others(api: httpx.Client) -> None:
    start_run(api, batch_size=8)
    a = add_env(api, name="a", group_size=2, max_token_length=512, weight=1.0)
    b = add_env(api, name="b", group_size=4, max_token_length=1024, weight=2.0)
    for _ in range(3):
        api.post("/scored_data", json=group(2, env_id=a))
    api.post("/scored_data", json=group(4, env_id=b))
    sa = api.get("/status-env", params={"env_id": a}).json()
    sb = api.get("/status-env", params={"env_id": b}).json()
    assert sa["env_weight"] == pytest.approx(0.2) and sb["env_weight"] == pytest.approx(0.8)
    assert sa["max_group_size"] == 4
    assert sa["self_queue_size"] == 3 and sa["queue_size"] == (6 + 4) // 2
    assert sb["self_queue_size"] == 1 and sb["queue_size"] == (4 + 8) // 4


def test_status_env_does_not_count_a_queue_that_cannot_make_a_batch(api: httpx.Client) -> None:
    """Groups of 16, 15 and 15 (an env dropped a few short completions) for a batch of 32:
    46 sequences, yet no exact batch. Counted as two queued groups, the env's throttle saw a
    full queue and stopped generating while the trainer waited for a batch (a gsm8k-format
    run hung for minutes); the queue now reads as empty until a batch can form."""
    start_run(api, batch_size=32)
    env = add_env(api, group_size=16)
    for size, tag in ((16, 0), (15, 1), (15, 2)):
        api.post("/scored_data", json=group(size, env_id=env, tag=tag))
    assert api.get("/batch").json() == {"batch": None}
    status = api.get("/status-env", params={"env_id": env}).json()
    assert status["queue_size"] == 0
    assert status["self_queue_size"] == 46 // 16
    api.post("/scored_data", json=group(16, env_id=env, tag=3))
    status = api.get("/status-env", params={"env_id": env}).json()
    assert status["queue_size"] == 62 // 16
    assert tags(api.get("/batch").json()["batch"]) == [0, 3]
    # what is left (15 + 15) is less than a batch: counted as queued, as before
    assert api.get("/status-env", params={"env_id": env}).json()["queue_size"] == 30 // 16


def test_min_batch_allocation_reserves_share(api: httpx.Client) -> None:
    start_run(api, batch_size=8)
    a = add_env(api, name="a", group_size=2)
    b = add_env(api, name="b", group_size=2, min_batch_allocation=0.5)
    for tag in range(6):
        api.post("/scored_data", json=group(2, env_id=a, tag=tag))
    # b holds batches back until it has data
    assert api.get("/batch").json() == {"batch": None}
    api.post("/scored_data", json=group(2, env_id=b, tag=100))
    api.post("/scored_data", json=group(2, env_id=b, tag=101))
    batch = api.get("/batch").json()["batch"]
    assert tags(batch) == [0, 1, 100, 101]
    status = api.get("/status-env", params={"env_id": a}).json()
    assert status["unallocated_fraction"] == pytest.approx(0.5)


def test_disconnect_env(api: httpx.Client) -> None:
    start_run(api)
    env = add_env(api, group_size=4)
    api.post("/scored_data", json=group(2, env_id=env, tag=7))
    assert api.post("/disconnect-env", json={"env_id": env}).json() == {"status": "success"}
    # the disconnected env's partial group is queued as it is, not lost
    assert api.get("/status").json()["queue_size"] == 1
    unknown = api.post("/disconnect-env", json={"env_id": 42})
    assert unknown.status_code == 404 and unknown.json()["status"] == "failure"


def test_data_before_register_does_not_wedge(api: httpx.Client) -> None:
    api.post("/scored_data", json=group(2, tag=1))
    api.post("/scored_data", json=group(2, tag=2))
    api.post("/register", json=registration(batch_size=4))
    assert api.get("/info").json()["batch_size"] == 4
    assert tags(api.get("/batch").json()["batch"]) == [1, 2]
    assert api.post("/register-env", json=env_registration()).json()["status"] == "success"


def test_reset_then_batch_and_info(api: httpx.Client) -> None:
    start_run(api, batch_size=2)
    api.post("/scored_data", json=group(2))
    reply = api.get("/reset_data")
    assert reply.status_code == 200 and reply.text == "Reset successful"
    assert api.get("/info").json() == {"batch_size": -1, "max_token_len": -1}
    assert api.get("/batch").status_code == 200
    assert api.get("/status").json() == {"current_step": 0, "queue_size": 0}
    metrics = api.get("/metrics", params={"format": "json"}).json()
    assert metrics["dropped"]["reset"] >= 1


def test_request_gzip(api: httpx.Client) -> None:
    start_run(api, batch_size=2)
    body = gzip.compress(json.dumps(group(2, length=600, tag=5)).encode())
    reply = api.post(
        "/scored_data",
        content=body,
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
    )
    assert reply.json() == {"status": "received"}
    bad = api.post("/scored_data", content=b"not gzip", headers={"Content-Encoding": "gzip"})
    assert (bad.status_code, bad.text) == (400, "Invalid gzip payload")


def test_response_gzip(api: httpx.Client) -> None:
    start_run(api, batch_size=2)
    api.post("/scored_data", json=group(2, length=600, tag=3))
    raw = requests.get(f"{api.base_url}/batch", headers={"Accept-Encoding": "gzip"}, stream=True)
    assert raw.headers["content-encoding"] == "gzip"
    batch = json.loads(gzip.decompress(raw.raw.read()))["batch"]
    assert tags(batch) == [3]
    small = api.get("/info", headers={"Accept-Encoding": "gzip"})
    assert "content-encoding" not in small.headers
    big = api.get("/openapi.json", headers={"Accept-Encoding": "gzip"})
    assert big.headers.get("content-encoding") == "gzip"
    plain = api.get("/latest_example", headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in plain.headers


def test_cors(api: httpx.Client) -> None:
    """No cross-origin reads by default; upstream's allow-all is opt-in (test_http_security)."""
    reply = api.options(
        "/status",
        headers={"Origin": "http://example.test", "Access-Control-Request-Method": "GET"},
    )
    assert "access-control-allow-origin" not in reply.headers
    assert "access-control-allow-credentials" not in reply.headers


def test_metrics(api: httpx.Client) -> None:
    """Counters are monotonic over the process lifetime (a reset does not zero them)."""
    before = api.get("/metrics", params={"format": "json"}).json()
    start_run(api, batch_size=2)
    env = add_env(api, group_size=2)
    api.post("/scored_data", json=group(2, env_id=env))
    api.post("/scored_data", json={"tokens": [[1]], "masks": [], "scores": [1.0]})
    api.get("/batch")
    text = api.get("/metrics").text
    assert "# TYPE atropos_batches_served_total counter" in text
    assert 'atropos_refused_groups_total{reason="invalid"}' in text
    assert 'atropos_env_queued_sequences{env_id="0",name="env_0"} 0' in text
    data = api.get("/metrics", params={"format": "json"}).json()
    assert data["accepted_groups"] - before["accepted_groups"] == 1
    assert data["sequences_served"] - before["sequences_served"] == 2
    assert data["refused"]["invalid"] - before["refused"].get("invalid", 0) == 1
    assert data["batches_served"] - before["batches_served"] == 1
    assert data["envs"] == [
        {
            "env_id": 0,
            "name": "env_0",
            "connected": True,
            "queued_sequences": 0,
            "buffered_sequences": 0,
            "accepted_groups": 1,
            "served_groups": 1,
            "dropped_before_send": {},
        }
    ]
    assert api.get("/metrics", params={"format": "xml"}).status_code == 422
