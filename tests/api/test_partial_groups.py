"""Groups shorter than their env's ``group_size``: never merged across prompts (one baseline for
two questions), merged when they are parts of one prompt's group, never left waiting while a
trainer waits, and counted by the env's throttle. Through HTTP against real run-api processes."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from tests.api.helpers import add_env, registration, start_run

PROMPT_A = [11, 12, 13]
PROMPT_B = [21, 22, 23]


def answers(
    prompt: list[int],
    completions: list[int],
    env_id: int | None = None,
    group_size: int | None = None,
) -> dict[str, Any]:
    """A group whose sequences answer ``prompt``: one sequence per completion token, scored
    by the token's parity. ``group_size``: its ``group_overrides.group_size``."""
    body: dict[str, Any] = {
        "tokens": [prompt + [c, c] for c in completions],
        "masks": [[-100] * len(prompt) + [c, c] for c in completions],
        "scores": [float(c % 2) for c in completions],
        "env_id": env_id,
    }
    if group_size is not None:
        body["group_overrides"] = {"group_size": group_size}
    return body


def prompt_of(group: dict[str, Any]) -> set[tuple[int, ...]]:
    """The prompts a served group's sequences answer."""
    return {
        tuple(t for t, m in zip(tokens, mask, strict=True) if m == -100)
        for tokens, mask in zip(group["tokens"], group["masks"], strict=True)
    }


def metrics(api: httpx.Client) -> dict[str, Any]:
    return api.get("/metrics", params={"format": "json"}).json()


def outcomes(api: httpx.Client) -> Counter[str]:
    """What became of held parts so far (process-lifetime counters: compare differences)."""
    return Counter(metrics(api)["partial_groups"])


def test_parts_of_two_prompts_are_served_as_two_groups(api: httpx.Client) -> None:
    """The reproduction: env group_size 4, two parts of 2 (prompts A and B). They used to come
    out of /batch as one group of 4 (one baseline for two questions)."""
    start_run(api, batch_size=4)
    env = add_env(api, group_size=4)
    before = outcomes(api)
    replies = [
        api.post("/scored_data", json=answers(PROMPT_A, [1, 2], env_id=env)).json(),
        api.post("/scored_data", json=answers(PROMPT_B, [3, 4], env_id=env)).json(),
    ]
    # upstream's replies for a group shorter than group_size
    assert replies == [
        {"status": "buffered", "buffer_size": 2},
        {"status": "buffered", "buffer_size": 4},
    ]
    batch = api.get("/batch").json()["batch"]
    assert [len(g["tokens"]) for g in batch] == [2, 2]
    assert [prompt_of(g) for g in batch] == [{tuple(PROMPT_A)}, {tuple(PROMPT_B)}]
    assert [g["scores"] for g in batch] == [[1.0, 0.0], [1.0, 0.0]]
    assert metrics(api)["buffered_groups"] == 0
    assert outcomes(api) - before == {"released": 2}


def test_parts_of_one_prompt_are_merged(api: httpx.Client) -> None:
    start_run(api, batch_size=8)
    env = add_env(api, group_size=4)
    before = outcomes(api)
    assert api.post("/scored_data", json=answers(PROMPT_A, [1], env_id=env)).json() == {
        "status": "buffered",
        "buffer_size": 1,
    }
    api.post("/scored_data", json=answers(PROMPT_B, [5, 6], env_id=env))
    api.post("/scored_data", json=answers(PROMPT_A, [2, 3], env_id=env))
    # prompt A's parts add up to 4 and are queued as one group; B's part is still held
    reply = api.post("/scored_data", json=answers(PROMPT_A, [4], env_id=env)).json()
    assert reply == {"status": "buffered", "buffer_size": 2}
    assert api.get("/status").json()["queue_size"] == 1
    api.post("/scored_data", json=answers(PROMPT_B, [7, 8], env_id=env))
    batch = api.get("/batch").json()["batch"]
    assert [prompt_of(g) for g in batch] == [{tuple(PROMPT_A)}, {tuple(PROMPT_B)}]
    assert [[seq[len(PROMPT_A)] for seq in g["tokens"]] for g in batch] == [
        [1, 2, 3, 4],
        [5, 6, 7, 8],
    ]
    assert outcomes(api) - before == {"merged": 5}


def test_explicit_group_size_is_honoured(api: httpx.Client) -> None:
    """``group_overrides.group_size`` equal to the group's size (what envs that drop replies
    send): a whole group, queued at once. Larger: a part of a group of that size."""
    start_run(api, batch_size=6)
    env = add_env(api, group_size=4)
    whole = answers(PROMPT_A, [1, 2], env_id=env, group_size=2)
    assert api.post("/scored_data", json=whole).json() == {"status": "received"}
    # parts of a group of 8, bigger than the env's group_size: merged at 8, not at 4
    for completions in ([3, 4], [5, 6]):
        part = answers(PROMPT_B, completions, env_id=env, group_size=8)
        assert api.post("/scored_data", json=part).json()["status"] == "buffered"
    assert api.get("/status").json()["queue_size"] == 1
    batch = api.get("/batch").json()["batch"]  # the trainer waits: the parts are released
    assert [(len(g["tokens"]), prompt_of(g)) for g in batch] == [
        (2, {tuple(PROMPT_A)}),
        (4, {tuple(PROMPT_B)}),
    ]


def test_bad_explicit_group_size_is_a_422_naming_it(api: httpx.Client) -> None:
    start_run(api, batch_size=4)
    env = add_env(api, group_size=4)
    for bad in (1, 0, "4", True, 2.5):
        reply = api.post("/scored_data", json=answers(PROMPT_A, [1, 2], env_id=env, group_size=bad))
        assert reply.status_code == 422, (bad, reply.text)
        detail = reply.json()["detail"][0]
        assert detail["loc"] == ["body", "group_overrides", "group_size"], detail
        assert "group_size" in detail["msg"]
    null = answers(PROMPT_A, [1, 2], env_id=env)
    null["group_overrides"] = {"group_size": None}
    assert api.post("/scored_data", json=null).json()["status"] == "buffered"


def test_short_group_of_several_prompts_is_queued_as_it_is(api: httpx.Client) -> None:
    start_run(api, batch_size=4)
    env = add_env(api, group_size=4)
    mixed = answers(PROMPT_A, [1, 2], env_id=env)
    other = answers(PROMPT_B, [3], env_id=env)
    for key in ("tokens", "masks", "scores"):
        mixed[key] += other[key]
    assert api.post("/scored_data", json=mixed).json() == {"status": "received"}
    assert api.get("/status").json()["queue_size"] == 1


def test_throttle_counts_held_parts(api: httpx.Client) -> None:
    """An env throttles itself from ``/status-env``: what run-api holds for it counts there."""
    start_run(api, batch_size=8)
    env = add_env(api, group_size=4)
    other = add_env(api, name="other", group_size=4)
    api.post("/scored_data", json=answers(PROMPT_A, [1, 2], env_id=env))
    api.post("/scored_data", json=answers(PROMPT_B, [3, 4], env_id=env))
    status = api.get("/status-env", params={"env_id": env}).json()
    assert status["self_queue_size"] == 1 and status["queue_size"] == 1
    assert api.get("/status-env", params={"env_id": other}).json()["self_queue_size"] == 0
    per_env = {e["env_id"]: e for e in metrics(api)["envs"]}
    assert per_env[env]["buffered_sequences"] == 4 and per_env[other]["buffered_sequences"] == 0


def test_held_parts_survive_a_restart_and_are_released(start_api, tmp_path: Path) -> None:
    store = str(tmp_path / "run.sqlite3")
    server = start_api("--store", store)
    with httpx.Client(base_url=server.url, timeout=30) as api:
        assert api.post("/register", json=registration(batch_size=4)).status_code == 200
        assert api.get("/batch").json() == {"batch": None}
        env = add_env(api, group_size=4)
        api.post("/scored_data", json=answers(PROMPT_A, [1, 2], env_id=env))
        api.post("/scored_data", json=answers(PROMPT_B, [3, 4], env_id=env))
    server.kill9()
    server = start_api("--store", store)
    with httpx.Client(base_url=server.url, timeout=30) as api:
        assert metrics(api)["buffered_sequences"] == 4
        batch = api.get("/batch").json()["batch"]
        assert [prompt_of(g) for g in batch] == [{tuple(PROMPT_A)}, {tuple(PROMPT_B)}]
