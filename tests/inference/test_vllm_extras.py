"""vLLM's token-id extras on atropos-serve's OpenAI routes, as vLLM 0.32 answers them:
``return_token_ids`` (choices carry the sampled ``token_ids``; the prompt's ``prompt_token_ids``
per choice for completions, on the response for chat, in the first chunk when streaming) and
``return_tokens_as_token_ids`` (logprob tokens spelled ``token_id:N``). TRL's ``VLLMClient``
reads exactly these; its own ``parse_logprobs`` reads our answers here. vLLM request fields the
server cannot honour get a 400 naming them."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from tests.inference.conftest import SERVED_NAME, reference_logprobs
from tests.inference.test_server import MESSAGES, PROMPT_IDS, chat_prompt_ids


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _generate(url: str, prompt_ids: list[int], max_tokens: int) -> dict:
    """The same greedy request through ``/generate`` (token ids and log-probs)."""
    body = {"prompt": {"prompt_token_ids": prompt_ids}, "logprobs": 0,
            "max_tokens": max_tokens, "temperature": 0}  # fmt: skip
    return httpx.post(url + "/generate", json=body, timeout=60).json()


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json={"model": SERVED_NAME, **body}, timeout=60)


def _sse(response: httpx.Response) -> list[dict]:
    chunks = []
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


def test_completions_return_token_ids_as_trl_reads_them(tiny_server, reference_model):
    """TRL 1.16's VLLMClient.generate request, answered with the ids and log-probs /generate
    gives, and parsed by TRL's own parse_logprobs."""
    from trl.generation.vllm_client import parse_logprobs

    url = tiny_server.url
    expected = _generate(url, PROMPT_IDS, 6)
    body = {"prompt": [PROMPT_IDS], "n": 2, "max_tokens": 6, "temperature": 0, "logprobs": 0,
            "return_token_ids": True, "return_tokens_as_token_ids": True}  # fmt: skip
    reply = _post(url, "/v1/completions", body)
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    assert [c["prompt_token_ids"] for c in choices] == [PROMPT_IDS, PROMPT_IDS]
    assert [c["token_ids"] for c in choices] == [expected["token_ids"][0]] * 2
    ids = choices[0]["token_ids"]
    logprobs = choices[0]["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in ids]
    assert logprobs["top_logprobs"] == [
        {f"token_id:{t}": lp} for t, lp in zip(ids, logprobs["token_logprobs"], strict=True)
    ]
    # vLLM counts the offsets over the labels it returns
    labels = logprobs["tokens"]
    assert logprobs["text_offset"] == [sum(len(x) for x in labels[:i]) for i in range(len(ids))]
    reference = reference_logprobs(reference_model, PROMPT_IDS, ids)
    assert logprobs["token_logprobs"] == pytest.approx(reference, abs=1e-4)

    parsed, parsed_ids = parse_logprobs([c["logprobs"] for c in choices])
    assert parsed_ids == [[[t] for t in ids]] * 2
    assert [[lp[0] for lp in row] for row in parsed] == [
        c["logprobs"]["token_logprobs"] for c in choices
    ]


def test_completions_text_prompt_and_top_logprobs(tiny_server, tokenizer):
    text = "The capital of France is"
    body = {"prompt": text, "max_tokens": 4, "temperature": 0, "logprobs": 2,
            "return_token_ids": True, "return_tokens_as_token_ids": True}  # fmt: skip
    choice = _post(tiny_server.url, "/v1/completions", body).json()["choices"][0]
    assert choice["prompt_token_ids"] == tokenizer(text)["input_ids"]
    for token, top in zip(choice["logprobs"]["tokens"], choice["logprobs"]["top_logprobs"],
                          strict=True):  # fmt: skip
        assert token in top and all(key.startswith("token_id:") for key in top)
        assert 2 <= len(top) <= 3  # the sampled token plus the top 2 (vLLM: k + 1 at most)
    # without the flags: no ids, tokens spelled as text
    plain = _post(
        tiny_server.url,
        "/v1/completions",
        {**body, "return_token_ids": False, "return_tokens_as_token_ids": False},
    )
    choice = plain.json()["choices"][0]
    assert "token_ids" not in choice and "prompt_token_ids" not in choice
    assert not any(t.startswith("token_id:") for t in choice["logprobs"]["tokens"])


def test_chat_return_token_ids(tiny_server, tokenizer, reference_model):
    """Chat: prompt_token_ids on the response (the rendered template), token_ids per choice;
    logprob tokens spelled token_id:N, bytes of the token's text (as vLLM)."""
    body = {"messages": MESSAGES, "max_tokens": 5, "temperature": 0, "n": 2, "logprobs": True,
            "top_logprobs": 1, "return_token_ids": True,
            "return_tokens_as_token_ids": True}  # fmt: skip
    reply = _post(tiny_server.url, "/v1/chat/completions", body).json()
    prompt = chat_prompt_ids(tokenizer, MESSAGES)
    assert reply["prompt_token_ids"] == prompt
    expected = _generate(tiny_server.url, prompt, 5)["token_ids"][0]
    for choice in reply["choices"]:
        assert choice["token_ids"] == expected
        content = choice["logprobs"]["content"]
        assert [c["token"] for c in content] == [f"token_id:{t}" for t in expected]
        assert [c["bytes"] for c in content] == [
            list(tokenizer.decode([t]).encode()) for t in expected
        ]
        assert all(c["top_logprobs"][0]["token"].startswith("token_id:") for c in content)
        reference = reference_logprobs(reference_model, prompt, expected)
        assert [c["logprob"] for c in content] == pytest.approx(reference, abs=1e-4)
    assert (
        "prompt_token_ids"
        not in _post(
            tiny_server.url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}
        ).json()
    )


def test_streaming_carries_the_same_ids(tiny_server, tokenizer):
    url = tiny_server.url
    body = {"prompt": PROMPT_IDS, "n": 2, "max_tokens": 6, "temperature": 0, "logprobs": 0,
            "return_token_ids": True, "return_tokens_as_token_ids": True}  # fmt: skip
    full = _post(url, "/v1/completions", body).json()["choices"]
    chunks = _sse(_post(url, "/v1/completions", {**body, "stream": True}))
    ids: dict[int, list[int]] = {0: [], 1: []}
    prompts: dict[int, list] = {0: [], 1: []}
    tokens: dict[int, list[str]] = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            ids[choice["index"]] += choice["token_ids"]
            prompts[choice["index"]].append(choice["prompt_token_ids"])
            tokens[choice["index"]] += choice["logprobs"]["tokens"]
    for i in (0, 1):
        assert ids[i] == full[i]["token_ids"]
        assert prompts[i][0] == PROMPT_IDS and set(map(str, prompts[i][1:])) <= {"None"}
        assert tokens[i] == full[i]["logprobs"]["tokens"]

    chat = {"messages": MESSAGES, "max_tokens": 5, "temperature": 0, "return_token_ids": True,
            "stream": True}  # fmt: skip
    chunks = _sse(_post(url, "/v1/chat/completions", chat))
    assert chunks[0]["prompt_token_ids"] == chat_prompt_ids(tokenizer, MESSAGES)
    streamed = [t for c in chunks[1:] for ch in c["choices"] for t in ch["token_ids"]]
    nonstream = _post(url, "/v1/chat/completions", {**chat, "stream": False}).json()
    assert streamed == nonstream["choices"][0]["token_ids"]


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/completions", "use_beam_search", True),
        ("/v1/completions", "prompt_logprobs", 1),
        ("/v1/completions", "truncate_prompt_tokens", 3),
        ("/v1/completions", "allowed_token_ids", [1, 2]),
        ("/v1/completions", "bad_words", ["x"]),
        ("/v1/completions", "structured_outputs", {"regex": "a+"}),
        ("/v1/completions", "guided_regex", "a+"),
        ("/v1/completions", "response_format", {"type": "json_object"}),
        ("/v1/completions", "priority", 1),
        ("/v1/completions", "spaces_between_special_tokens", False),
        ("/v1/completions", "logit_bias", {"1": 5}),
        ("/v1/chat/completions", "chat_template", "{{ messages }}"),
        ("/v1/chat/completions", "echo", True),
        ("/v1/chat/completions", "reasoning_effort", "low"),
        ("/v1/chat/completions", "length_penalty", 0.5),
    ],
)
def test_vllm_fields_it_cannot_honour_are_refused_by_name(
    tiny_server, path: str, field: str, value: object
):
    prompt = {"prompt": "hi"} if path == "/v1/completions" else {"messages": MESSAGES}
    reply = _post(tiny_server.url, path, {**prompt, "max_tokens": 2, field: value})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == field and f"'{field}'" in error["message"]


def test_vllm_fields_at_their_defaults_are_accepted(tiny_server):
    defaults = {"use_beam_search": False, "priority": 0, "length_penalty": 1.0,
                "spaces_between_special_tokens": True, "truncate_prompt_tokens": None,
                "request_id": "abc", "cache_salt": "s", "bad_words": [],
                "response_format": {"type": "text"}}  # fmt: skip
    reply = _post(tiny_server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                        **defaults})  # fmt: skip
    assert reply.status_code == 200, reply.text
