"""APIServer plumbing: reasoning injection, weighted semaphores, health checks, retries, metrics."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from atroposlib.envs.server_handling.openai_server import OpenAIServer
from atroposlib.envs.server_handling.server_baseline import (
    LOCAL_SERVER_DEFAULTS,
    APIServerConfig,
    AsyncSemWithAdaptiveWeight,
    ReasoningConfig,
    local_server_configs,
    server_root,
)
from tests.envs.server_handling.conftest import engine_requests, serve_app

MESSAGES = [{"role": "user", "content": "hi"}]

# ---------------------------------------------------------------- reasoning


def test_reasoning_config_auto_enables_and_validates() -> None:
    assert not ReasoningConfig().enabled
    assert ReasoningConfig(effort="low").enabled
    assert ReasoningConfig(max_tokens=100).enabled
    with pytest.raises(ValueError, match="Invalid reasoning_effort"):
        ReasoningConfig(effort="extreme")


def test_build_extra_body_per_provider() -> None:
    assert ReasoningConfig().build_extra_body("https://openrouter.ai/api/v1") is None
    assert ReasoningConfig(enabled=True).build_extra_body("https://api.openai.com/v1") == {
        "reasoning_effort": "medium"
    }
    both = ReasoningConfig(effort="high", max_tokens=500)
    assert both.build_extra_body("http://x") == {"reasoning": {"enabled": True, "effort": "high"}}
    assert both.build_extra_body("http://x", use_max_tokens=True) == {
        "reasoning": {"enabled": True, "max_tokens": 25600}
    }
    assert ReasoningConfig(max_tokens=500).build_extra_body(None) == {
        "reasoning": {"enabled": True, "max_tokens": 500}
    }


def test_from_env_config() -> None:
    class Cfg:
        thinking_mode = True

    assert ReasoningConfig.from_env_config(Cfg()).enabled
    assert not ReasoningConfig.from_env_config(object()).enabled


def test_inject_reasoning_kwargs() -> None:
    openai_cfg = APIServerConfig(base_url="https://api.openai.com/v1", api_key="k")
    server = OpenAIServer(openai_cfg, reasoning_config=ReasoningConfig(effort="low"))
    out = server._inject_reasoning_kwargs(
        {"max_tokens": 10, "temperature": 0.2, "extra_body": {"a": 1}}
    )
    assert out == {
        "max_completion_tokens": 10,
        "temperature": 1.0,
        "extra_body": {"a": 1, "reasoning_effort": "low"},
    }
    assert server._inject_reasoning_kwargs({"skip_reasoning": True, "max_tokens": 3}) == {
        "max_tokens": 3
    }
    other = OpenAIServer(
        APIServerConfig(base_url="http://127.0.0.1:1/v1"), reasoning_config=ReasoningConfig(True)
    )
    assert other._inject_reasoning_kwargs({"max_tokens": 3}) == {
        "max_tokens": 3,
        "extra_body": {"reasoning": {"enabled": True}},
    }


def test_local_server_configs_defaults_and_overrides() -> None:
    (config,) = local_server_configs()
    assert config.base_url == "http://localhost:9001/v1"  # the embedded atropos-serve
    assert (config.server_type, config.model_name) == ("vllm", "SmolLM2-135M-Instruct")
    assert (config.num_requests_for_eval, config.timeout) == (32, 600)
    (tuned,) = local_server_configs(num_requests_for_eval=8, timeout=300)
    assert (tuned.num_requests_for_eval, tuned.timeout) == (8, 300)
    assert tuned.base_url == config.base_url
    assert LOCAL_SERVER_DEFAULTS["timeout"] == 600  # the defaults are not changed by a call
    with pytest.raises(ValueError):
        local_server_configs(server_type="tgi")


def test_server_root_only_strips_trailing_v1() -> None:
    assert server_root("http://h:1/v1") == "http://h:1"
    assert server_root("http://h:1/v1/") == "http://h:1"
    assert server_root("http://v1.example.com/api/v1") == "http://v1.example.com/api"


# ---------------------------------------------------------------- semaphore


async def test_weighted_semaphore_rations_slots() -> None:
    sem = AsyncSemWithAdaptiveWeight(4)
    sem.update_weight(0.5)
    assert sem.min_val() == 2.0
    await sem.acquire()
    await sem.acquire()
    assert sem.locked()
    third = asyncio.create_task(sem.acquire())
    await asyncio.sleep(0.01)
    assert not third.done()
    sem.update_weight(1.0)  # a larger share frees the waiter at once
    await asyncio.wait_for(third, 1)
    assert sem._value == 1
    for _ in range(3):
        sem.release()
    assert sem._value == sem.max_val == 4


async def test_weighted_semaphore_fifo_and_cancel() -> None:
    sem = AsyncSemWithAdaptiveWeight(1)
    order: list[int] = []

    async def worker(i: int) -> None:
        async with sem:
            order.append(i)
            await asyncio.sleep(0.005)

    await sem.acquire()
    tasks = [asyncio.create_task(worker(i)) for i in range(3)]
    cancelled = asyncio.create_task(sem.acquire())
    await asyncio.sleep(0.01)
    cancelled.cancel()
    sem.release()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    assert sem._value == 1 and not sem._waiters


# ---------------------------------------------------------------- health checks


async def test_health_loop_uses_health_route_not_completions(
    tiny_config: APIServerConfig,
) -> None:
    config = tiny_config.model_copy(update={"health_check_interval": 0.1})
    server = OpenAIServer(config)
    try:
        before = engine_requests(server_root(config.base_url))
        await server.chat_completion(messages=MESSAGES, max_tokens=2)
        assert server.check_task is not None
        await asyncio.sleep(1.0)  # ~10 health probes
        assert server.server_healthy
        # Only the one chat request reached the engine: probes cost nothing.
        assert engine_requests(server_root(config.base_url)) == before + 1
    finally:
        await server.close()
    assert server.check_task is None


def probe_app(health_status: int) -> tuple[FastAPI, dict[str, int]]:
    app = FastAPI()
    hits = {"health": 0, "models": 0, "chat": 0}
    state = {"health_status": health_status}

    @app.get("/health")
    async def health() -> JSONResponse:
        hits["health"] += 1
        return JSONResponse({}, status_code=state["health_status"])

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        hits["models"] += 1
        return {"object": "list", "data": []}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        hits["chat"] += 1
        return {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "ok"},
                }
            ],
        }

    app.state.control = state
    return app, hits


async def test_health_falls_back_to_models_when_no_health_route() -> None:
    app, hits = probe_app(404)
    with serve_app(app) as url:
        server = OpenAIServer(APIServerConfig(base_url=f"{url}/v1", model_name="m"))
        assert await server._probe_health()
        assert hits == {"health": 1, "models": 1, "chat": 0}
        server.config.health_check_method = "completion"  # only when asked for
        assert await server._probe_health()
        assert hits["chat"] == 1
        await server.close()


async def test_health_loop_keeps_one_connection() -> None:
    """The probes of one health loop reuse a client (one kept-alive connection) instead of
    building a client, and its SSL context, per probe."""
    app = FastAPI()
    ports: list[int] = []

    @app.get("/health")
    async def health(request: Request) -> dict[str, str]:
        assert request.client is not None
        ports.append(request.client.port)
        return {"status": "ok"}

    with serve_app(app) as url:
        server = OpenAIServer(
            APIServerConfig(base_url=f"{url}/v1", model_name="m", health_check_interval=0.05)
        )
        server.check_task = asyncio.create_task(server.check_server_status_task())
        try:
            for _ in range(100):
                if len(ports) >= 5:
                    break
                await asyncio.sleep(0.05)
        finally:
            await server.close()
    assert len(ports) >= 5
    assert len(set(ports)) == 1, f"a new connection per probe: {ports}"


async def test_unhealthy_server_holds_requests_until_healthy() -> None:
    app, hits = probe_app(503)
    with serve_app(app) as url:
        server = OpenAIServer(
            APIServerConfig(base_url=f"{url}/v1", model_name="m", health_check_interval=0.05)
        )
        try:
            server.server_healthy = False
            request = asyncio.create_task(server.chat_completion(messages=MESSAGES))
            await asyncio.sleep(0.3)
            assert not request.done() and hits["chat"] == 0 and not server.server_healthy
            app.state.control["health_status"] = 200
            out = await asyncio.wait_for(request, 10)
            assert out.choices[0].message.content == "ok"
        finally:
            await server.close()


async def test_waiting_for_a_down_server_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Down: a warning naming the URL and why, then a reminder with since when at the log
    interval; back: one info line."""
    app, _ = probe_app(503)
    with serve_app(app) as url:
        server = OpenAIServer(
            APIServerConfig(base_url=f"{url}/v1", model_name="m", health_check_interval=0.05)
        )
        server.unhealthy_log_interval = 0.3
        server.server_healthy = False  # as after a first failed probe
        logger_name = "atroposlib.envs.server_handling.server_baseline"
        try:
            with caplog.at_level(logging.INFO, logger=logger_name):
                request = asyncio.create_task(server.chat_completion(messages=MESSAGES))
                await asyncio.sleep(1.0)
                assert not request.done()
                app.state.control["health_status"] = 200
                await asyncio.wait_for(request, 10)
        finally:
            await server.close()
    lines = [r.getMessage() for r in caplog.records if r.name == logger_name]
    down = [line for line in lines if "is not answering" in line]
    assert len(down) == 1 and f"{url}/v1" in down[0] and "error status" in down[0], lines
    waiting = [line for line in lines if line.startswith("still waiting for inference server")]
    assert 1 <= len(waiting) <= 4 and "down since" in waiting[0] and f"{url}/v1" in waiting[0]
    assert sum("is back after" in line for line in lines) == 1, lines


async def test_no_health_loop_without_base_url_or_when_disabled() -> None:
    server = OpenAIServer(APIServerConfig(base_url="", api_key="k"))
    server.server_healthy = False
    server._ensure_started()
    assert server.check_task is None and server.server_healthy
    server = OpenAIServer(APIServerConfig(base_url="http://127.0.0.1:9/v1", health_check=False))
    server._ensure_started()
    assert server.check_task is None and server.server_healthy


# ---------------------------------------------------------------- retries and metrics


def flaky_app(fail_first: int, status: int) -> tuple[FastAPI, list[int]]:
    app = FastAPI()
    calls: list[int] = []

    @app.post("/v1/completions")
    async def completions() -> JSONResponse:
        calls.append(1)
        if len(calls) <= fail_first:
            return JSONResponse({"error": {"message": "nope"}}, status_code=status)
        return JSONResponse(
            {
                "id": "x",
                "object": "text_completion",
                "created": 0,
                "model": "m",
                "choices": [{"index": 0, "text": "t", "finish_reason": "stop"}],
            }
        )

    return app, calls


async def test_transient_error_is_retried_and_counted() -> None:
    app, calls = flaky_app(fail_first=1, status=500)
    with serve_app(app) as url:
        server = OpenAIServer(APIServerConfig(base_url=f"{url}/v1", health_check=False))
        out = await server.completion(prompt="p")
        assert out.choices[0].text == "t"
        assert len(calls) == 2 and list(server.attempts_list) == [2]
        metrics = await server.wandb_metrics(None, None)
        assert metrics["server/server_average_num_attempts"] == 2.0
        await server.close()


async def test_client_error_is_not_retried() -> None:
    app, calls = flaky_app(fail_first=5, status=400)
    with serve_app(app) as url:
        server = OpenAIServer(APIServerConfig(base_url=f"{url}/v1", health_check=False))
        with pytest.raises(Exception, match="nope"):
            await server.completion(prompt="p")
        assert len(calls) == 1
        await server.close()


async def test_metric_buffers_are_bounded() -> None:
    app, _ = flaky_app(fail_first=0, status=500)
    with serve_app(app) as url:
        config = APIServerConfig(base_url=f"{url}/v1", health_check=False, rolling_buffer_length=3)
        server = OpenAIServer(config)
        for _ in range(5):
            await server.completion(prompt="p")
            await server.completion(prompt="p", split="eval")
        assert len(server.request_timings) == len(server.attempts_list) == 3
        assert len(server.eval_request_timings) == len(server.eval_attempts_list) == 3
        metrics = await server.wandb_metrics({}, "a")
        assert set(metrics) == {
            "server/a_request_time_avg",
            "server/a_request_time_std",
            "server/a_request_time_99p",
            "server/a_eval_request_time_avg",
            "server/a_eval_request_time_std",
            "server/a_eval_request_time_99p",
            "server/a_average_num_attempts",
            "server/a_eval_retry_rate",
        }
        await server.close()


async def test_exhausted_retries_raise_retry_error_after_three_attempts() -> None:
    from tenacity import RetryError

    app, calls = flaky_app(fail_first=10, status=503)
    with serve_app(app) as url:
        server = OpenAIServer(APIServerConfig(base_url=f"{url}/v1", health_check=False))
        with pytest.raises(RetryError) as info:
            await server.completion(prompt="p")
        assert len(calls) == 3  # one budget of 3 attempts, not nested retries
        assert "503" in str(info.value.last_attempt.exception())
        assert not server.attempts_list  # failed requests are not timed
        await server.close()


@pytest.mark.parametrize(("status", "healthy", "models_hits"), [(401, True, 1), (503, False, 0)])
async def test_health_status_handling(status: int, healthy: bool, models_hits: int) -> None:
    app, hits = probe_app(status)
    with serve_app(app) as url:
        server = OpenAIServer(APIServerConfig(base_url=f"{url}/v1", model_name="m"))
        assert await server._probe_health() is healthy
        assert hits["models"] == models_hits and hits["chat"] == 0
        await server.close()
