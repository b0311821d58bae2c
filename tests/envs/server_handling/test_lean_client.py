"""OpenAIServer's lean request path: same wire request, results and errors as the SDK."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from openai.types.chat.chat_completion import ChatCompletion
from openai.types.completion import Completion

from atroposlib.envs.server_handling.openai_server import (
    APIServerConfig,
    LeanOpenAIClient,
    OpenAIServer,
    env_proxy_for,
)
from tests.conftest import free_port
from tests.envs.server_handling.conftest import serve_app

MESSAGES = [{"role": "user", "content": "hi"}]


def recording_app() -> tuple[FastAPI, list[dict[str, Any]]]:
    """Records each request (body and headers); answers like an OpenAI provider, with an
    extra field and, for ``model == "odd"``, a float ``created`` that does not validate."""
    app = FastAPI()
    seen: list[dict[str, Any]] = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        seen.append({"body": body, "headers": dict(request.headers)})
        if body.get("model") == "bad":
            return JSONResponse({"error": {"message": "no such model"}}, status_code=400)
        n = body.get("n") or 1
        return {
            "id": "c",
            "object": "chat.completion",
            "created": 1.5 if body.get("model") == "odd" else 0,
            "model": body["model"],
            "provider_extra": {"x": 1},
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": f"a{i}"},
                    "finish_reason": "stop",
                    "stop_reason": None,
                }
                for i in range(n)
            ],
        }

    @app.post("/v1/completions")
    async def text(request: Request) -> Any:
        body = await request.json()
        seen.append({"body": body, "headers": dict(request.headers)})
        return {
            "id": "t",
            "object": "text_completion",
            "created": 0,
            "model": body["model"],
            "choices": [
                {"index": i, "text": f"t{i}", "finish_reason": "length", "logprobs": None}
                for i in range(body.get("n") or 1)
            ],
        }

    return app, seen


def server_for(url: str, model: str = "m", **extra: Any) -> OpenAIServer:
    return OpenAIServer(
        APIServerConfig(
            base_url=f"{url}/v1", api_key="sk-1", model_name=model, health_check=False, **extra
        )
    )


async def test_request_and_result_match_the_sdk() -> None:
    app, seen = recording_app()
    with serve_app(app) as url:
        server = server_for(url)
        try:
            out = await server.chat_completion(
                messages=MESSAGES,
                n=2,
                max_tokens=3,
                extra_body={"top_k": 5},
                extra_headers={"X-Trace": "t1"},
            )
            assert isinstance(out, ChatCompletion)
            assert [c.message.content for c in out.choices] == ["a0", "a1"]
            assert out.choices[0].stop_reason is None  # provider extras are kept
            assert out.provider_extra == {"x": 1}
            body, headers = seen[0]["body"], seen[0]["headers"]
            assert body == {
                "messages": MESSAGES,
                "n": 2,
                "max_tokens": 3,
                "top_k": 5,
                "model": "m",
            }
            assert headers["authorization"] == "Bearer sk-1"
            assert headers["x-trace"] == "t1"
            assert headers["content-type"] == "application/json"

            text = await server.completion(prompt=[1, 2, 3], n=3, max_tokens=2)
            assert isinstance(text, Completion)
            assert [c.text for c in text.choices] == ["t0", "t1", "t2"]
            assert seen[1]["body"]["prompt"] == [1, 2, 3]
        finally:
            await server.close()


async def test_answers_that_do_not_validate_are_built_leniently() -> None:
    app, _ = recording_app()
    with serve_app(app) as url:
        server = server_for(url, model="odd")
        try:
            out = await server.chat_completion(messages=MESSAGES)
            assert out.created == 1.5 and out.choices[0].message.content == "a0"
        finally:
            await server.close()


async def test_http_errors_are_the_sdk_exceptions_and_not_retried() -> None:
    app, seen = recording_app()
    with serve_app(app) as url:
        server = server_for(url, model="bad")
        try:
            with pytest.raises(openai.BadRequestError, match="no such model") as info:
                await server.chat_completion(messages=MESSAGES)
            assert info.value.status_code == 400
            assert len(seen) == 1
        finally:
            await server.close()


async def test_unreachable_server_is_an_api_connection_error() -> None:
    lean = LeanOpenAIClient(
        openai.AsyncClient(api_key="k", base_url=f"http://127.0.0.1:{free_port()}/v1")
    )
    try:
        with pytest.raises(openai.APIConnectionError):
            await lean.create("chat", {"model": "m", "messages": MESSAGES})
    finally:
        await lean.close()


async def test_unknown_arguments_go_to_the_sdk() -> None:
    app, seen = recording_app()
    with serve_app(app) as url:
        server = server_for(url)
        try:
            # the SDK rejects what it does not know, before sending anything
            with pytest.raises(TypeError, match="not_a_param"):
                await server.chat_completion(messages=MESSAGES, not_a_param=1)
            assert not seen
            lean = server.lean
            assert (
                await lean.create("chat", {"model": "m", "messages": MESSAGES, "stream": True})
                is None
            )
            assert await lean.create("chat", {"model": "m", "messages": iter(MESSAGES)}) is None
            assert not seen
            # and what the lean path declines still works, through the SDK
            out = await server.chat_completion(messages=iter(MESSAGES), stream=False)
            assert out.choices[0].message.content == "a0"
            assert seen[0]["body"]["messages"] == MESSAGES
        finally:
            await server.close()


def test_proxy_comes_from_the_environment_once(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
        monkeypatch.delenv(var.lower(), raising=False)
    assert env_proxy_for("https://api.openai.com/v1") is None
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.local:3128")
    monkeypatch.setenv("NO_PROXY", "localhost,127.0.0.1")
    assert env_proxy_for("https://api.openai.com/v1") == "http://proxy.local:3128"
    assert env_proxy_for("http://api.example.com/v1") is None  # no HTTP_PROXY
    assert env_proxy_for("https://127.0.0.1:9000/v1") is None
    lean = LeanOpenAIClient(openai.AsyncClient(api_key="k", base_url="https://api.openai.com/v1"))
    assert lean.proxy == "http://proxy.local:3128"
