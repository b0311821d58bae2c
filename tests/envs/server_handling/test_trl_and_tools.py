"""TrlVllmServer against a loopback app with TRL's ``/generate/`` shape; tool-call translation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request

from atroposlib.envs.server_handling import trl_vllm_server
from atroposlib.envs.server_handling.managed_server import ManagedServer
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.server_harness import ServerHarness
from atroposlib.envs.server_handling.tool_call_translator import (
    VLLM_AVAILABLE,
    ToolCallTranslator,
)
from tests.envs.server_handling.conftest import serve_app


def trl_app(tokenizer: Any) -> tuple[FastAPI, list[dict[str, Any]]]:
    """TRL ``vllm-serve``'s ``POST /generate/``: prompts in, ``completion_ids`` out."""
    app = FastAPI()
    seen: list[dict[str, Any]] = []

    @app.post("/generate/")
    async def generate(request: Request) -> dict[str, Any]:
        body = await request.json()
        seen.append(body)
        ids = []
        for i in range(body["n"]):
            # Even choices end with EOS ("stop"), odd ones run out of tokens ("length").
            out = tokenizer.encode(f" reply {i}")
            ids.append(out + [tokenizer.eos_token_id] if i % 2 == 0 else out)
        return {"completion_ids": ids}

    return app, seen


def test_module_level_names() -> None:
    assert trl_vllm_server.AutoTokenizer is not None
    assert trl_vllm_server.aiohttp is not None


async def test_trl_chat_and_completion(tiny_model_dir: Path, tiny_tokenizer: Any) -> None:
    app, seen = trl_app(tiny_tokenizer)
    with serve_app(app) as url:
        server = trl_vllm_server.TrlVllmServer(
            APIServerConfig(base_url=url, model_name=str(tiny_model_dir), server_type="trl")
        )
        messages = [{"role": "user", "content": "Hi"}]
        chat = await server.chat_completion(messages=messages, n=2, max_tokens=9, top_k=5)
        assert [c.message.content for c in chat.choices] == [" reply 0", " reply 1"]
        assert [c.finish_reason for c in chat.choices] == ["stop", "length"]
        assert server.server_healthy and server.check_task is None
        rendered = tiny_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert seen[0] == {
            "prompts": [rendered],
            "n": 2,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 5,
            "min_p": 0.0,
            "max_tokens": 9,
        }
        text = await server.completion(prompt="Say", n=1)
        assert text.choices[0].text == " reply 0" and text.choices[0].finish_reason == "stop"
        assert seen[1]["prompts"] == ["Say"] and seen[1]["max_tokens"] == 1024


# ---------------------------------------------------------------- tool calls

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_vllm_flag_matches_environment() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        assert VLLM_AVAILABLE is False


def test_hermes_parsing_round_trip(tiny_tokenizer: Any) -> None:
    translator = ToolCallTranslator(tiny_tokenizer, "hermes")
    raw = 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    content, calls, reason = translator.parse_model_output(raw, tool_choice="auto", tools=TOOLS)
    assert content == "Let me check." and reason == "tool_calls"
    assert calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == '{"city": "Paris"}'
    # Sent back by the client: the exact raw text is restored for the template.
    message = {"role": "assistant", "content": content, "tool_calls": calls}
    converted = translator.convert_messages_for_template(
        [message, {"role": "tool", "content": "9C"}]
    )
    assert converted[0] == {"role": "assistant", "content": raw}
    assert converted[1] == {"role": "tool", "content": "9C"}
    # Unknown ids are rebuilt in the hermes format.
    rebuilt = translator.reconstruct_raw_text_from_tool_calls(
        [{"id": "other", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    )
    assert json.loads(rebuilt.removeprefix("<tool_call>").removesuffix("</tool_call>")) == {
        "name": "f",
        "arguments": {"a": 1},
    }
    assert translator.parse_model_output(raw, tool_choice="none", tools=TOOLS) == (
        raw,
        None,
        "stop",
    )
    assert translator.parse_model_output("plain", tools=TOOLS) == ("plain", None, "stop")


async def test_managed_server_returns_tool_calls(tiny_tokenizer: Any) -> None:
    harness = ServerHarness()
    managed = ManagedServer(harness, tokenizer=tiny_tokenizer, tool_parser="hermes")
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = managed._convert_messages_to_prompt(messages, tools=TOOLS)
    raw = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    out_ids = tiny_tokenizer.encode(raw) + [tiny_tokenizer.eos_token_id]
    harness.set_tokens_and_logprobs_response(
        prompt, tiny_tokenizer.encode(prompt), [out_ids], [[-0.5] * len(out_ids)], ["stop"]
    )
    out = await managed.chat_completion(messages=messages, tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    (node,) = managed.get_state()["nodes"]
    assert node.full_text.startswith(prompt + raw)  # nodes keep the raw model text
    assert node.masked_tokens[-len(out_ids) :] == out_ids

    # The client sends the call back with its result: the node is extended token-exactly
    # (the generated EOS is not repeated by the template's closing tag).
    turn2 = [
        *messages,
        {
            "role": "assistant",
            "content": choice.message.content,
            "tool_calls": choice.message.tool_calls,  # SDK objects are accepted as-is
        },
        {"role": "tool", "content": "9C"},
    ]
    prompt2 = managed._convert_messages_to_prompt(turn2, tools=TOOLS)
    assert prompt2.startswith(prompt + raw + "<|im_end|>")
    expected = node.tokens + tiny_tokenizer.encode(prompt2[len(prompt + raw + "<|im_end|>") :])
    harness.set_tokens_and_logprobs_response(prompt2, expected, [[5]], [[-1.0]], ["length"])
    out2 = await managed.chat_completion(messages=turn2, tools=TOOLS)
    assert harness.calls[-1][1]["input_ids"] == expected
    assert out2.choices[0].message.tool_calls is None
    (node2,) = managed.get_state()["nodes"]
    assert node2.masked_tokens[: len(node.tokens)] == node.masked_tokens


def test_hermes_parsing_with_trailing_eos_and_no_content(tiny_tokenizer: Any) -> None:
    translator = ToolCallTranslator(tiny_tokenizer, "hermes")
    raw = (
        '<tool_call>\n{"name": "navigate", "arguments": {"url": "https://example.com"}}\n'
        "</tool_call><|im_end|>"
    )
    content, calls, reason = translator.parse_model_output(raw, "auto", TOOLS)
    assert (content, reason) == (None, "tool_calls")
    assert calls[0].function.name == "navigate"
    assert json.loads(calls[0].function.arguments) == {"url": "https://example.com"}
    plain = translator.parse_model_output("Plain answer", "auto", TOOLS)
    assert plain == ("Plain answer", None, "stop")
    broken = translator.parse_model_output("<tool_call>{not json</tool_call>", "auto", TOOLS)
    assert broken[1] is None and broken[2] == "stop"
