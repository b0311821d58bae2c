"""/register-env is bounded: names by length, envs per run by --max-envs."""

from __future__ import annotations

import httpx

from tests.api.helpers import add_env, env_registration, start_run


def test_env_count_is_bounded(start_api) -> None:
    server = start_api("--max-envs", "2")
    with httpx.Client(base_url=server.url) as client:
        start_run(client)
        assert add_env(client, name="a") == 0
        assert add_env(client, name="b") == 1
        assert client.post("/disconnect-env", json={"env_id": 0}).status_code == 200
        reply = client.post("/register-env", json=env_registration("c"))
        assert reply.status_code == 409, reply.text
        assert "--max-envs" in reply.text and "/reset_data" in reply.text
        metrics = client.get("/metrics", params={"format": "json"}).json()
        assert metrics["refused"]["too_many_envs"] == 1 and len(metrics["envs"]) == 2
        assert client.get("/reset_data").status_code == 200
        start_run(client)
        assert add_env(client, name="c") == 0


def test_env_name_length_is_bounded(api: httpx.Client) -> None:
    start_run(api)
    reply = api.post("/register-env", json=env_registration("n" * 257))
    assert reply.status_code == 422 and "desired_name" in reply.text
    assert add_env(api, name="n" * 256) == 0
