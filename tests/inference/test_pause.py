"""``POST /pause`` / ``POST /resume`` / ``GET /is_paused`` (vLLM's RL endpoints) on a real server."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.inference.conftest import SERVED_NAME, own_tiny_server, start_server

PROMPT = "Count with me: one, two, three,"


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    yield from own_tiny_server(tmp_path_factory, tiny_model_dir)


@pytest.fixture(autouse=True)
def _always_resume(server):
    yield
    httpx.post(server.url + "/resume", timeout=30)


def _body(max_tokens: int, **extra) -> dict:
    return {
        "model": SERVED_NAME,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


async def _generating(client: httpx.AsyncClient, url: str) -> None:
    """Wait until the request just sent is in the batch (a fixed sleep raced a busy machine)."""
    for _ in range(600):
        if (await client.get(url + "/health")).json()["running"]:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the request never started generating")


async def _stream_times(client: httpx.AsyncClient, url: str, max_tokens: int) -> list[float]:
    """Arrival time of every streamed chunk of one completion, and its finish reason last."""
    times: list[float] = []
    finish = None
    async with client.stream(
        "POST", url + "/v1/completions", json=_body(max_tokens, stream=True)
    ) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            times.append(time.monotonic())
            finish = chunk["choices"][0].get("finish_reason") or finish
    return [*times, finish]


async def test_keep_freezes_generation_and_resume_continues_it(server) -> None:
    url = server.url
    async with httpx.AsyncClient(timeout=120) as client:
        streaming = asyncio.create_task(_stream_times(client, url, 400))
        await _generating(client, url)
        paused = await client.post(url + "/pause", params={"mode": "keep"})
        assert paused.status_code == 200 and paused.json()["mode"] == "keep"
        assert (await client.get(url + "/is_paused")).json() == {"is_paused": True}
        assert (await client.get(url + "/health")).json()["paused"] is True
        frozen_at = time.monotonic()
        # a request that arrives while paused waits; nothing is generated for it
        waiting = asyncio.create_task(client.post(url + "/v1/completions", json=_body(4)))
        await asyncio.sleep(1.5)
        assert not streaming.done() and not waiting.done()
        resumed = await client.post(url + "/resume")
        assert resumed.json() == {"status": "resumed", "was_paused": True}
        resumed_at = time.monotonic()
        *times, finish = await streaming
        late = await waiting
    assert finish == "length" and late.status_code == 200
    assert late.json()["choices"][0]["finish_reason"] == "length"
    # no token arrived while the server was paused
    assert not [t for t in times if frozen_at + 0.05 < t < resumed_at]
    assert [t for t in times if t >= resumed_at]  # and the stream went on afterwards


async def test_wait_lets_running_requests_finish_first(server) -> None:
    url = server.url
    async with httpx.AsyncClient(timeout=120) as client:
        running = asyncio.create_task(client.post(url + "/v1/completions", json=_body(60)))
        await _generating(client, url)
        paused = await client.post(url + "/pause", params={"wait_for_inflight_requests": "true"})
        assert paused.json()["mode"] == "wait"
        # The pause answered only once the running request was done (its reply, sent on
        # another connection, may still be on its way).
        assert (await client.get(url + "/health")).json()["running"] == 0
        reply = (await asyncio.wait_for(running, 30)).json()
        assert reply["choices"][0]["finish_reason"] == "length"
        assert reply["usage"]["completion_tokens"] == 60
        waiting = asyncio.create_task(client.post(url + "/v1/completions", json=_body(4)))
        await asyncio.sleep(1.0)
        assert not waiting.done()
        await client.post(url + "/resume")
        assert (await waiting).status_code == 200


async def test_abort_ends_running_requests_with_their_tokens_so_far(server) -> None:
    url = server.url
    async with httpx.AsyncClient(timeout=120) as client:
        running = asyncio.create_task(client.post(url + "/v1/completions", json=_body(1500)))
        await _generating(client, url)
        paused = await client.post(url + "/pause")  # vLLM's default mode
        assert paused.json()["mode"] == "abort"
        reply = (await running).json()
        assert reply["choices"][0]["finish_reason"] == "abort"
        assert 0 < reply["usage"]["completion_tokens"] < 1500
        await client.post(url + "/resume")
        after = await client.post(url + "/v1/completions", json=_body(4))
        assert after.json()["choices"][0]["finish_reason"] == "length"


async def test_reload_while_paused_in_keep_mode(server, tiny_model_dir_b) -> None:
    url = server.url
    async with httpx.AsyncClient(timeout=120) as client:
        version = (await client.get(url + "/health")).json()["weights_version"]
        running = asyncio.create_task(client.post(url + "/v1/completions", json=_body(300)))
        await _generating(client, url)
        await client.post(url + "/pause", params={"mode": "keep"})
        # frozen rows do not block the reload (they continue on the new weights)
        reload = await client.post(url + "/reload_weights", json={"path": str(tiny_model_dir_b)})
        assert reload.status_code == 200
        assert reload.json()["weights_version"] == version + 1
        assert not running.done()
        await client.post(url + "/resume")
        assert (await running).json()["choices"][0]["finish_reason"] == "length"


def test_bad_mode_is_a_400_and_resume_without_pause_is_harmless(server) -> None:
    bad = httpx.post(server.url + "/pause", params={"mode": "sleep"}, timeout=30)
    assert bad.status_code == 400 and "mode" in bad.text
    assert httpx.get(server.url + "/is_paused", timeout=30).json() == {"is_paused": False}
    again = httpx.post(server.url + "/resume", timeout=30).json()
    assert again == {"status": "resumed", "was_paused": False}


def test_processed_logprobs_mode_reports_the_tempered_distribution(
    tmp_path_factory, tiny_model_dir, reference_model
) -> None:
    """``--logprobs-mode processed_logprobs``: the log-prob reported for a token sampled at
    temperature 0.5 is its log-probability under logits / 0.5, as an RL trainer computes it."""
    server = start_server(
        tmp_path_factory, tiny_model_dir, "--dtype", "float32", "--served-model-name",
        SERVED_NAME, "--logprobs-mode", "processed_logprobs",
    )  # fmt: skip
    try:
        prompt = [504, 3458, 282, 4649, 314]
        reply = httpx.post(
            server.url + "/generate",
            json={
                "prompt": {"prompt_token_ids": prompt},
                "logprobs": 0,
                "max_tokens": 6,
                "temperature": 0.5,
                "seed": 3,
            },
            timeout=60,
        ).json()
    finally:
        server.stop()
    ids = reply["token_ids"][0]
    served = [list(item[0].values())[0] for item in reply["logprobs"][0]]
    import torch

    with torch.no_grad():
        logits = reference_model(torch.tensor([prompt + ids])).logits[0].float()
    tempered = (logits / 0.5).log_softmax(-1)
    expected = [tempered[len(prompt) - 1 + i, t].item() for i, t in enumerate(ids)]
    assert served == pytest.approx(expected, abs=2e-3)
    raw = logits.log_softmax(-1)
    assert served != pytest.approx(
        [raw[len(prompt) - 1 + i, t].item() for i, t in enumerate(ids)], abs=2e-3
    )


@pytest.mark.parametrize("mode", ["abort", "keep", "wait"])
async def test_pausing_under_load_never_hangs(server, mode: str) -> None:
    """Requests keep arriving while the server is paused and resumed again and again (a
    trainer's steps): every pause takes effect, and every request gets its answer."""
    url = server.url
    async with httpx.AsyncClient(timeout=120) as client:

        async def traffic() -> list[str]:
            reasons = []
            for _ in range(12):
                batch = await asyncio.gather(
                    *(client.post(url + "/v1/completions", json=_body(12, n=2)) for _ in range(4))
                )
                reasons += [c["finish_reason"] for r in batch for c in r.json()["choices"]]
            return reasons

        load = asyncio.create_task(traffic())
        for _ in range(15):
            await asyncio.sleep(0.1)
            paused = await asyncio.wait_for(
                client.post(url + "/pause", params={"mode": mode}), timeout=30
            )
            assert paused.status_code == 200
            await asyncio.sleep(0.1)
            await client.post(url + "/resume")
        reasons = await asyncio.wait_for(load, timeout=120)
    assert len(reasons) == 12 * 4 * 2
    assert set(reasons) <= ({"length", "abort"} if mode == "abort" else {"length"})
