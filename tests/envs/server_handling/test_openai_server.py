"""OpenAIServer against the real tiny ``atropos-serve`` and a provider that ignores ``n``."""

from __future__ import annotations

import time
import warnings
from typing import Any

import pytest
from fastapi import FastAPI, Request

from atroposlib.envs.server_handling.openai_server import APIServerConfig, OpenAIServer
from tests.envs.server_handling.conftest import serve_app

MESSAGES = [{"role": "user", "content": "Say something."}]


async def test_chat_completion_n(tiny_config: APIServerConfig) -> None:
    server = OpenAIServer(tiny_config)
    try:
        out = await server.chat_completion(messages=MESSAGES, n=3, max_tokens=5, temperature=1.0)
        assert len(out.choices) == 3
        assert [c.index for c in out.choices] == [0, 1, 2]
        assert all(isinstance(c.message.content, str) for c in out.choices)
        assert out.model == "tiny"
        assert len(server.request_timings) == 1 and list(server.attempts_list) == [1]
    finally:
        await server.close()


async def test_completion_and_eval_split(tiny_config: APIServerConfig) -> None:
    server = OpenAIServer(tiny_config)
    try:
        out = await server.completion(prompt="Once upon a time", n=2, max_tokens=4, split="eval")
        assert len(out.choices) == 2
        assert all(c.finish_reason in ("stop", "length") for c in out.choices)
        assert len(server.eval_request_timings) == 1 and not server.request_timings
        metrics = await server.wandb_metrics({}, "s0")
        assert "server/s0_eval_request_time_avg" in metrics
        assert metrics["server/s0_eval_retry_rate"] == 1.0
    finally:
        await server.close()


async def test_tokens_and_logprobs_not_available(tiny_config: APIServerConfig) -> None:
    server = OpenAIServer(tiny_config)
    try:
        with pytest.raises(NotImplementedError):
            await server.tokens_and_logprobs_completion(prompt="hi")
        assert not server.attempts_list  # not retried, not recorded
    finally:
        await server.close()


def ignoring_n_app() -> tuple[FastAPI, list[dict[str, Any]]]:
    """An OpenAI-style provider that always answers with a single choice."""
    app = FastAPI()
    seen: list[dict[str, Any]] = []

    def body(kind: str, i: int) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop", "logprobs": None}
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": f"answer {i}"}
        else:
            choice["text"] = f"text {i}"
        return {
            "id": f"x{i}",
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": "m",
            "choices": [choice],
        }

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        seen.append(await request.json())
        return body("chat", len(seen))

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        seen.append(await request.json())
        return body("text", len(seen))

    return app, seen


async def test_provider_ignoring_n_is_detected_and_fanned_out() -> None:
    app, seen = ignoring_n_app()
    with serve_app(app) as url:
        server = OpenAIServer(
            APIServerConfig(base_url=f"{url}/v1", model_name="m", health_check=False)
        )
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = await server.chat_completion(messages=MESSAGES, n=3)
            assert any("ignores the n kwarg" in str(w.message) for w in caught)
            assert server.config.n_kwarg_is_ignored
            assert len(out.choices) == 3 and len(seen) == 3
            assert [c.index for c in out.choices] == [0, 1, 2]
            assert "n" not in seen[1] and "n" not in seen[2]

            # Known to ignore n: exactly n single requests, and one (not two) for n=1.
            seen.clear()
            out = await server.completion(prompt="p", n=2)
            assert len(out.choices) == 2 and len(seen) == 2
            seen.clear()
            out = await server.chat_completion(messages=MESSAGES, n=1)
            assert len(out.choices) == 1 and len(seen) == 1
            seen.clear()
            out = await server.chat_completion(messages=MESSAGES)
            assert len(out.choices) == 1 and len(seen) == 1
        finally:
            await server.close()


async def test_wrong_number_of_choices_raises() -> None:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> dict[str, Any]:
        choices = [{"index": i, "text": "t", "finish_reason": "stop"} for i in range(2)]
        return {
            "id": "x",
            "object": "text_completion",
            "created": 0,
            "model": "m",
            "choices": choices,
        }

    with serve_app(app) as url:
        server = OpenAIServer(
            APIServerConfig(base_url=f"{url}/v1", model_name="m", health_check=False)
        )
        try:
            with pytest.raises(ValueError, match="Expected 1 or 3"):
                await server.completion(prompt="p", n=3)
        finally:
            await server.close()


async def test_fan_out_works_on_a_bare_namespace() -> None:
    """The wrapper needs only ``config`` and ``openai`` (upstream-style unbound use)."""
    import types

    calls: list[dict[str, Any]] = []

    class Response:
        def __init__(self) -> None:
            self.choices = [object()]

    async def create(**kwargs: Any) -> Response:
        calls.append(kwargs)
        return Response()

    fake = types.SimpleNamespace(
        config=types.SimpleNamespace(n_kwarg_is_ignored=True),
        openai=types.SimpleNamespace(
            chat=types.SimpleNamespace(completions=types.SimpleNamespace(create=create))
        ),
    )
    out = await OpenAIServer._chat_completion_wrapper(fake, model="m", messages=MESSAGES, n=3)
    assert len(out.choices) == 3 and len(calls) == 3
    calls.clear()
    out = await OpenAIServer._chat_completion_wrapper(fake, model="m", messages=MESSAGES, n=1)
    assert len(out.choices) == 1 and len(calls) == 1
