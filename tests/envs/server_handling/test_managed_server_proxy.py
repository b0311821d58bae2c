"""The ManagedServer proxy on loopback, backed by the real tiny ``atropos-serve``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from atroposlib.envs.server_handling.managed_server_proxy import create_app
from atroposlib.envs.server_handling.proxy_client import ProxyManagedServer
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.server_manager import ServerManager
from tests.envs.server_handling.conftest import serve_app

MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture()
def proxy(tiny_config: APIServerConfig, tiny_tokenizer: Any) -> Iterator[tuple[str, str]]:
    """(proxy URL, backend base_url)."""
    config = tiny_config.model_copy(update={"health_check": False})
    manager = ServerManager([config])
    with serve_app(create_app(manager, tiny_tokenizer, model_name="tiny")) as url:
        yield url, config.base_url


def test_health_models_servers(proxy: tuple[str, str]) -> None:
    url, backend = proxy
    assert httpx.get(f"{url}/health").json() == {
        "status": "ok",
        "model": "tiny",
        "sessions": 0,
        "servers": 1,
        "healthy_servers": 1,
    }
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"
    (server,) = httpx.get(f"{url}/servers").json()["servers"]
    assert server["base_url"] == backend and server["server_type"] == "vllm"


async def test_session_chat_nodes_render_delete(proxy: tuple[str, str], tiny_tokenizer) -> None:
    url, backend = proxy
    created = httpx.post(f"{url}/sessions/create", json={"base_url": backend}).json()
    assert set(created) == {"uuid", "model_name", "tool_parser", "base_url", "created_at"}
    assert created["base_url"] == backend and created["tool_parser"] == "hermes"
    session = created["uuid"]

    client = openai.AsyncOpenAI(base_url=f"{url}/{session}/v1", api_key="x", max_retries=0)
    first = await client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=5, n=2, seed=3
    )
    assert first.id.startswith("chatcmpl-") and len(first.choices) == 2
    nodes = httpx.get(f"{url}/{session}/nodes").json()["nodes"]
    assert len(nodes) == 2
    assert all(-100 in n["masked_tokens"] and len(n["tokens"]) == len(n["logprobs"]) for n in nodes)

    # Render shows exactly what the next turn would send: the first branch's tokens reused.
    turn2 = [
        *MESSAGES,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "More"},
    ]
    rendered = httpx.post(
        f"{url}/{session}/v1/chat/completions/render", json={"messages": turn2}
    ).json()
    assert rendered["prompt_text"].endswith("<|im_start|>assistant\n")
    assert rendered["token_ids"][: len(nodes[0]["tokens"])] == nodes[0]["tokens"]
    assert rendered["num_tokens"] == len(rendered["token_ids"])

    await client.chat.completions.create(model="tiny", messages=turn2, max_tokens=3)
    nodes2 = httpx.get(f"{url}/{session}/nodes").json()["nodes"]
    assert len(nodes2) == 2  # branch 0 extended in place, branch 1 untouched
    assert nodes2[0]["tokens"][: len(rendered["token_ids"])] == rendered["token_ids"]

    listed = httpx.get(f"{url}/sessions").json()["sessions"]
    assert [(s["uuid"], s["num_nodes"]) for s in listed] == [(session, 2)]
    assert httpx.delete(f"{url}/{session}").json() == {"status": "deleted", "uuid": session}
    await client.close()


def test_errors_use_openai_shape(proxy: tuple[str, str]) -> None:
    url, _ = proxy
    missing = httpx.post(f"{url}/nope/v1/chat/completions", json={"messages": MESSAGES})
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == 404
    assert "not found" in missing.json()["error"]["message"]
    session = httpx.post(f"{url}/sessions/create", json={}).json()["uuid"]
    empty = httpx.post(f"{url}/{session}/v1/chat/completions", json={"messages": []})
    assert empty.status_code == 400 and empty.json()["error"]["type"] == "invalid_request_error"
    bad = httpx.post(f"{url}/{session}/v1/chat/completions", json={"messages": "x"})
    assert bad.status_code == 400
    pinned = httpx.post(f"{url}/sessions/create", json={"base_url": "http://127.0.0.1:1/v1"})
    assert pinned.status_code == 404 and "Available" in pinned.json()["error"]["message"]
    assert httpx.delete(f"{url}/nope").status_code == 404


def test_setup_replaces_backends(proxy: tuple[str, str], tiny_model_dir) -> None:
    url, backend = proxy
    body = {
        "model_name": "tiny",
        "tokenizer_name": str(tiny_model_dir),
        "servers": [{"base_url": backend}, {"base_url": "http://127.0.0.1:1/v1"}],
    }
    assert httpx.post(f"{url}/setup", json=body).json() == {
        "status": "ok",
        "servers": 2,
        "model_name": "tiny",
    }
    assert len(httpx.get(f"{url}/servers").json()["servers"]) == 2


async def test_server_manager_uses_proxy(proxy: tuple[str, str], monkeypatch) -> None:
    url, backend = proxy
    monkeypatch.delenv("ATROPOS_PROXY_URL", raising=False)
    manager = ServerManager([APIServerConfig(base_url=backend, health_check=False)], proxy_url=url)
    async with manager.managed_server(base_url=backend) as managed:
        assert isinstance(managed, ProxyManagedServer)
        assert managed.get_url() == f"{url}/{managed.session_uuid}/v1"
        out = await managed.chat_completion(messages=MESSAGES, max_tokens=3, n=2)
        assert len(out.choices) == 2
        nodes = managed.get_state()["nodes"]
        assert len(nodes) == 2 and all(-100 in n.masked_tokens for n in nodes)
        session = managed.session_uuid
    assert httpx.get(f"{url}/{session}/nodes").status_code == 404  # cleaned up
    await manager.close()


def test_agentic_tool_conversation_stays_one_exact_node(tiny_tokenizer: Any) -> None:
    """user -> tool call -> tool result -> text -> user -> tool call -> result -> text: one
    node, token-exact, every assistant output trainable (scripted backend, real tokenizer)."""
    from fastapi.testclient import TestClient

    from atroposlib.envs.server_handling.server_harness import ServerHarness

    tok = tiny_tokenizer
    harness = ServerHarness(tokenizer=tok)
    manager = ServerManager(APIServerConfig(), testing=True)
    manager.servers = [harness]
    client = TestClient(create_app(manager, tok, model_name="tiny"))
    session = client.post("/sessions/create", json={}).json()["uuid"]
    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    outputs: list[list[int]] = []

    def step(messages: list[dict[str, Any]], output: str) -> dict[str, Any]:
        body = {"messages": messages, "tools": tools, "max_tokens": 50}
        rendered = client.post(f"/{session}/v1/chat/completions/render", json=body).json()
        ids = tok.encode(output, add_special_tokens=False) + [tok.eos_token_id]
        outputs.append(ids)
        harness.set_tokens_and_logprobs_response(
            rendered["prompt_text"], None, [ids], [[-0.5] * len(ids)], ["stop"]
        )
        reply = client.post(f"/{session}/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        (node,) = client.get(f"/{session}/nodes").json()["nodes"]
        assert node["tokens"] == rendered["token_ids"] + ids  # what was sent, then the output
        return reply.json()["choices"][0]

    call = '<tool_call>{"name": "search", "arguments": {"q": "cats"}}</tool_call>'
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Find cats"}]
    first = step(messages, call)
    assert first["finish_reason"] == "tool_calls"
    tool_calls = first["message"]["tool_calls"]
    messages += [
        {"role": "assistant", "content": None, "tool_calls": tool_calls},
        {"role": "tool", "tool_call_id": tool_calls[0]["id"], "content": "10 cats"},
    ]
    assert step(messages, "Here are 10 cats!")["message"]["content"] == "Here are 10 cats!"
    messages += [
        {"role": "assistant", "content": "Here are 10 cats!"},
        {"role": "user", "content": "And dogs?"},
    ]
    second = step(messages, call.replace("cats", "dogs"))
    messages += [
        {"role": "assistant", "content": None, "tool_calls": second["message"]["tool_calls"]},
        {"role": "tool", "tool_call_id": "x", "content": "5 dogs"},
    ]
    step(messages, "5 dogs too!")

    (node,) = client.get(f"/{session}/nodes").json()["nodes"]
    trained = [t for t in node["masked_tokens"] if t != -100]
    assert trained == [t for ids in outputs for t in ids]
    # No doubled EOS: the tokens spell the text (plus the final generated EOS) exactly.
    assert tok.decode(node["tokens"]) == node["full_text"] + "<|im_end|>"
