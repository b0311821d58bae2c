"""The audit of atropos-serve's request fields against vLLM's chat and completion requests (and
OpenAI's), through HTTP against a real server: every field is honoured as vLLM honours it,
refused with a 400 naming it, or accepted and ignored because it does not change what is
generated (docs/compat.md, "Request fields"). A field that changes the output is never
accepted and ignored."""

from __future__ import annotations

import httpx
import pytest

from atroposlib.inference.protocol import IGNORED_FIELDS
from tests.inference.conftest import SERVED_NAME
from tests.inference.test_server import MESSAGES

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
PROMPT = "The capital of France is"
GREEDY = {"max_tokens": 6, "temperature": 0, "return_token_ids": True}


def _post(url: str, path: str, body: dict) -> httpx.Response:
    prompt = {"prompt": PROMPT} if path == COMPLETIONS else {"messages": MESSAGES}
    return httpx.post(url + path, json={"model": SERVED_NAME, **prompt, **body}, timeout=60)


def _ids(reply: httpx.Response) -> tuple[list[int], list[list[int]]]:
    """(prompt ids, each choice's sampled ids) of a 200 reply."""
    assert reply.status_code == 200, reply.text
    data = reply.json()
    choices = data["choices"]
    prompt = data.get("prompt_token_ids") or choices[0]["prompt_token_ids"]
    return prompt, [c["token_ids"] for c in choices]


@pytest.fixture(scope="module")
def baseline(tiny_server) -> dict[str, tuple[list[int], list[list[int]]]]:
    return {path: _ids(_post(tiny_server.url, path, GREEDY)) for path in (COMPLETIONS, CHAT)}


IGNORED_VALUES = {
    "user": "someone",
    "metadata": {"run": "a"},
    "store": True,
    "service_tier": "flex",
    "prediction": {"type": "content", "content": "Paris"},
    "prompt_cache_key": "k",
    "safety_identifier": "s",
    "request_id": "r-1",
    "session_id": "s-1",
    "cache_salt": "salt",
    "parallel_tool_calls": False,
    "truncation_side": "left",
    "stream_interval": 4,
    "return_token_offsets": True,
    "return_mm_kwargs": False,
}
# Fields at a value that means what the server does anyway.
NO_OP_VALUES = [
    (CHAT, "tool_choice", "auto"),
    (CHAT, "tool_choice", "none"),
    (CHAT, "include_reasoning", True),
    (CHAT, "modalities", ["text"]),
    (CHAT, "add_generation_prompt", True),
    (COMPLETIONS, "best_of", 1),
    (COMPLETIONS, "stream_options", {"include_usage": True, "continuous_usage_stats": False}),
]


def test_the_ignored_list_is_the_documented_one() -> None:
    assert set(IGNORED_VALUES) == set(IGNORED_FIELDS)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("field", list(IGNORED_VALUES))
def test_ignored_fields_do_not_change_the_output(tiny_server, baseline, path, field) -> None:
    reply = _post(tiny_server.url, path, {**GREEDY, field: IGNORED_VALUES[field]})
    assert _ids(reply) == baseline[path]


@pytest.mark.parametrize(("path", "field", "value"), NO_OP_VALUES)
def test_no_op_values_are_accepted(tiny_server, baseline, path, field, value) -> None:
    reply = _post(tiny_server.url, path, {**GREEDY, field: value})
    assert _ids(reply) == baseline[path]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"tool_choice": "required"}, "tool_choice"),
        (CHAT, {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        (CHAT, {"function_call": {"name": "f"}}, "function_call"),
        (CHAT, {"functions": [{"name": "f"}]}, "functions"),
        (CHAT, {"include_reasoning": False}, "include_reasoning"),
        (CHAT, {"verbosity": "low"}, "verbosity"),
        (CHAT, {"web_search_options": {"search_context_size": "low"}}, "web_search_options"),
        (CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
        (CHAT, {"documents": [{"title": "a", "text": "b"}]}, "documents"),
        (CHAT, {"return_prompt_text": True}, "return_prompt_text"),
        (CHAT, {"echo": True}, "echo"),
        (CHAT, {"prompt_logprobs": 1}, "prompt_logprobs"),
        (
            CHAT,
            {"continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
        ),
        (CHAT, {"thinking_token_budget": 4}, "thinking_token_budget"),
        (COMPLETIONS, {"echo": True}, "echo"),
        (COMPLETIONS, {"suffix": "!"}, "suffix"),
        (COMPLETIONS, {"best_of": 3}, "best_of"),
        (COMPLETIONS, {"logprob_token_ids": [1, 2], "logprobs": 0}, "logprob_token_ids"),
        (COMPLETIONS, {"truncate_prompt_tokens": -1}, "truncate_prompt_tokens"),
        (COMPLETIONS, {"watermarking": True}, "watermarking"),
        (COMPLETIONS, {"repetition_detection": {"max_pattern_size": 4}}, "repetition_detection"),
        (COMPLETIONS, {"vllm_xargs": {"a": 1}}, "vllm_xargs"),
        (COMPLETIONS, {"routed_experts_prompt_start": 2}, "routed_experts_prompt_start"),
        (
            COMPLETIONS,
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
        ),
        (
            CHAT,
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
        ),
    ],
)
def test_fields_that_would_change_the_output_are_refused_by_name(
    tiny_server, path, body, param
) -> None:
    reply = _post(tiny_server.url, path, {**GREEDY, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and f"'{param}'" in error["message"], error


# Honoured fields, each checked for vLLM's effect here or in the test named (test_server.py:
# stop/stop_token_ids/min_tokens/include_stop_str_in_output/skip_special_tokens/ignore_eos;
# test_vllm_extras.py: return_token_ids/return_tokens_as_token_ids; test_sampling.py: top_k,
# top_p, min_p and the penalties against a reference sampler).
SAMPLED = {"max_tokens": 8, "temperature": 1.0, "return_token_ids": True}


def test_seed_repeats_and_n_counts(tiny_server) -> None:
    url = tiny_server.url
    first = _ids(_post(url, COMPLETIONS, {**SAMPLED, "seed": 7, "n": 3}))
    again = _ids(_post(url, COMPLETIONS, {**SAMPLED, "seed": 7, "n": 3}))
    other = _ids(_post(url, COMPLETIONS, {**SAMPLED, "seed": 8, "n": 3}))
    assert len(first[1]) == 3 and first == again and first != other


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("min_p", 0.9),
        ("top_k", 2),
        ("top_p", 0.1),
        ("presence_penalty", 2.0),
        ("frequency_penalty", 2.0),
        ("repetition_penalty", 3.0),
    ],
)
def test_sampling_fields_change_seeded_samples(tiny_server, field, value) -> None:
    """Same seed, with and without the field: the samples differ (vLLM's effect on the
    distribution is checked against a reference sampler in test_sampling.py)."""
    body = {**SAMPLED, "seed": 11, "n": 2, "max_tokens": 10}
    plain = _ids(_post(tiny_server.url, COMPLETIONS, body))
    changed = _ids(_post(tiny_server.url, COMPLETIONS, {**body, field: value}))
    assert plain[1] != changed[1]


def test_chat_template_fields_change_the_prompt(tiny_server, baseline) -> None:
    url = tiny_server.url
    prompt = baseline[CHAT][0]
    no_gen = _ids(_post(url, CHAT, {**GREEDY, "add_generation_prompt": False}))[0]
    assert no_gen != prompt and prompt[: len(no_gen)] == no_gen
    prefill = [*MESSAGES, {"role": "assistant", "content": "The answer"}]
    cont = httpx.post(
        url + CHAT,
        json={
            "model": SERVED_NAME,
            "messages": prefill,
            "continue_final_message": True,
            "add_generation_prompt": False,
            **GREEDY,
        },  # fmt: skip
        timeout=60,
    )
    cont_prompt = _ids(cont)[0]
    assert cont_prompt[: len(no_gen)] == no_gen and len(cont_prompt) > len(prompt)
    # The template gets chat_template_kwargs (this one does not read enable_thinking); a key
    # that would override a request field is refused instead of one of them losing silently.
    thinking = {**GREEDY, "chat_template_kwargs": {"enable_thinking": False}}
    assert _ids(_post(url, CHAT, thinking)) == baseline[CHAT]
    clash = {**GREEDY, "chat_template_kwargs": {"add_generation_prompt": False}}
    reply = _post(url, CHAT, clash)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "chat_template_kwargs.add_generation_prompt"
