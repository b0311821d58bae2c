"""How an env's server clients learn their server's policy version: from ``atropos-serve``'s
``GET /policy_version`` inside a rollout only, cached with a TTL and refreshed in the background,
asked once of a server without the route; and how a group gets the lowest version."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from atroposlib.envs.group_sender import group_from_trajectories
from atroposlib.envs.server_handling.policy_version import (
    PolicyVersionTracker,
    end_rollout,
    record,
    rollout_policy_version,
    start_rollout,
)
from atroposlib.envs.server_handling.server_manager import ServerManager
from tests.envs.server_handling.conftest import serve_app, server_config


def _stand_in(state: dict[str, Any]) -> FastAPI:
    """A server whose ``/policy_version`` answers ``state["answer"]`` (a status and a body),
    counting the requests in ``state["hits"]``."""
    app = FastAPI()

    @app.get("/policy_version")
    async def policy_version() -> JSONResponse:
        state["hits"] += 1
        status, body = state["answer"]
        return JSONResponse(body, status_code=status)

    return app


async def test_rollout_records_the_version_of_the_server_it_used(tiny_config) -> None:
    manager = ServerManager([tiny_config])
    (server,) = manager.servers
    try:
        # outside a rollout nothing is asked
        await manager.chat_completion(messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        assert getattr(server, "_policy_versions", None) is None

        async def rollout() -> int | None:
            token = start_rollout()
            try:
                await asyncio.gather(  # sub-tasks of a rollout record into the same collector
                    *(
                        manager.chat_completion(
                            messages=[{"role": "user", "content": "hi"}], max_tokens=1, n=2
                        )
                        for _ in range(3)
                    )
                )
                return rollout_policy_version()
            finally:
                end_rollout(token)

        assert await rollout() == 0  # the shared atropos-serve starts at policy version 0
        assert server.policy_version == 0
        assert await rollout() == 0
        assert server._policy_versions.fetches == 1  # within the TTL: no second request
        assert rollout_policy_version() is None  # the collector is gone with the rollout
    finally:
        await manager.close()


async def test_server_without_the_route_is_asked_once() -> None:
    state = {"hits": 0, "answer": (404, {"detail": "Not Found"})}
    with serve_app(_stand_in(state)) as url:
        tracker = PolicyVersionTracker(url)
        tracker.ttl = 0.0
        for _ in range(20):
            assert await tracker.current() is None
            await asyncio.sleep(0.01)
        assert (state["hits"], tracker.supported) == (1, False)
        await tracker.aclose()
    # an answer of another shape counts as no version too
    for body in ({"policy_version": "7"}, {"policy_version": -1}, {"other": 1}, [1]):
        state = {"hits": 0, "answer": (200, body)}
        with serve_app(_stand_in(state)) as url:
            tracker = PolicyVersionTracker(url)
            assert [await tracker.current() for _ in range(3)] == [None] * 3
            assert state["hits"] == 1
            await tracker.aclose()
    assert await PolicyVersionTracker(None).current() is None


async def test_cached_version_is_refreshed_once_past_the_ttl() -> None:
    state = {"hits": 0, "answer": (200, {"policy_version": 3})}
    with serve_app(_stand_in(state)) as url:
        tracker = PolicyVersionTracker(url)
        tracker.ttl = 0.2
        assert await tracker.current() == 3  # the first request waits for the answer
        state["answer"] = (200, {"policy_version": 4})
        assert [await tracker.current() for _ in range(50)] == [3] * 50  # within the TTL
        assert state["hits"] == 1
        await asyncio.sleep(0.25)
        # past the TTL: the request waits for the fresh answer, and requests starting
        # meanwhile share that one GET (an env idle for minutes must not stamp its first
        # groups after a sync with the version it cached before it)
        assert await asyncio.gather(*(tracker.current() for _ in range(8))) == [4] * 8
        assert state["hits"] == 2
        # a failing server keeps the last value and is asked again after the TTL
        state["answer"] = (503, {"error": "reloading"})
        await asyncio.sleep(0.25)
        await tracker.current()
        await asyncio.sleep(0.1)
        assert (tracker.value, tracker.supported, state["hits"]) == (4, True, 3)
        state["answer"] = (200, {"policy_version": 5})
        await asyncio.sleep(0.25)
        await tracker.current()
        await asyncio.sleep(0.1)
        assert await tracker.current() == 5
        await tracker.aclose()


async def test_unreachable_server_is_retried_after_the_ttl() -> None:
    from tests.conftest import free_port

    tracker = PolicyVersionTracker(f"http://127.0.0.1:{free_port()}")
    tracker.ttl = 0.05
    assert await tracker.current() is None
    assert tracker.supported is None  # not known to lack the route: asked again later
    await asyncio.sleep(0.1)
    await tracker.current()
    await asyncio.sleep(0.1)
    assert tracker.fetches == 2
    await tracker.aclose()


def test_rollout_collector_keeps_the_lowest_version() -> None:
    assert rollout_policy_version() is None
    record(3)  # outside a rollout: ignored
    token = start_rollout()
    for version in (5, None, 2, 7):
        record(version)
    assert rollout_policy_version() == 2
    end_rollout(token)
    assert rollout_policy_version() is None


@pytest.mark.parametrize(
    ("versions", "expected"), [([4, 2, 9], 2), ([None, 6], 6), ([None, None], None)]
)
def test_group_from_trajectories_takes_the_lowest_item_version(versions, expected) -> None:
    items = []
    for i, version in enumerate(versions):
        item: dict[str, Any] = {"tokens": [1, 2], "masks": [-100, 2], "scores": float(i)}
        if version is not None:
            item["policy_version"] = version
        items.append((item, []))
    group, _ = group_from_trajectories(items, len(items))
    assert group is not None
    assert group.get("policy_version") == expected


@pytest.fixture(scope="module")
def own_serve(tmp_path_factory, tiny_model_dir):
    """A tiny atropos-serve of this module's own (these tests reload its weights)."""
    pytest.importorskip("torch")
    from tests.inference.conftest import own_tiny_server

    yield from own_tiny_server(tmp_path_factory, tiny_model_dir)


@pytest.mark.parametrize("server_type", ["vllm", "openai"])
async def test_a_generation_rerun_on_new_weights_gets_their_version(
    own_serve, tiny_model_dir, server_type
) -> None:
    """A trainer pauses atropos-serve (abort) mid-generation, loads new weights as policy
    version V and resumes; the client re-runs the aborted generation, which now runs on the
    new weights: the rollout records V (the response's ``X-Policy-Version``), not the version
    it read before its first attempt, which made such groups look one or two steps stale."""
    import httpx

    from atroposlib.schema import POLICY_VERSION_HEADER

    manager = ServerManager([server_config(own_serve, tiny_model_dir, server_type)])
    (server,) = manager.servers
    async with httpx.AsyncClient(base_url=own_serve.url, timeout=120) as http:
        before = (await http.get("/policy_version")).json()["policy_version"]
        new = before + 2  # a trainer that skipped a sync number: not just "old + 1"

        async def generate() -> Any:
            if server_type == "vllm":
                return await server.tokens_and_logprobs_completion(
                    prompt="Count: one, two,", max_tokens=300, temperature=1.0, ignore_eos=True
                )
            return await server.chat_completion(
                messages=[{"role": "user", "content": "Count to a thousand."}],
                max_tokens=300,
                temperature=1.0,
                extra_body={"ignore_eos": True},
            )

        async def rollout() -> int | None:
            token = start_rollout()
            try:
                await generate()
                return rollout_policy_version()
            finally:
                end_rollout(token)

        try:
            task = asyncio.create_task(rollout())
            deadline = asyncio.get_running_loop().time() + 60
            while (await http.get("/health")).json().get("running", 0) < 1:
                assert not task.done(), "the generation finished before it could be paused"
                assert asyncio.get_running_loop().time() < deadline, "never started generating"
                await asyncio.sleep(0.01)
            assert (await http.post("/pause", params={"mode": "abort"})).status_code == 200
            reload = await http.post(
                "/reload_weights", json={"path": str(tiny_model_dir), "policy_version": new}
            )
            assert reload.status_code == 200, reload.text
            assert (await http.post("/resume")).status_code == 200
            assert await task == new
            assert server.aborted_generations == 1
            reply = await http.post(
                "/generate",
                json={"prompt": {"prompt_token_ids": [1, 2, 3]}, "max_tokens": 2},
            )
            assert reply.headers[POLICY_VERSION_HEADER] == str(new)
        finally:
            await http.post("/resume")
            await manager.close()
