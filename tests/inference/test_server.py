"""``atropos-serve`` with a tiny real model, driven through the official ``openai`` client."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from tests.inference.conftest import SERVED_NAME, reference_logprobs

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
PROMPT_IDS = [504, 3458, 282, 4649, 314]


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def chat_prompt_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def greedy_ids(client, prompt_ids: list[int], max_tokens: int = 12) -> list[int]:
    reply = httpx.post(
        str(client.base_url).replace("/v1/", "/generate"),
        json={
            "prompt": {"prompt_token_ids": prompt_ids},
            "logprobs": 0,
            "max_tokens": max_tokens,
            "temperature": 0,
        },
        timeout=60,
    ).json()
    return reply["token_ids"][0]


def test_health_and_models(tiny_server, client):
    health = httpx.get(tiny_server.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == SERVED_NAME
    ids = [m.id for m in client.models.list().data]
    assert ids == [SERVED_NAME, "tiny-alias"]


def test_chat_n_usage_and_logprobs_match_forward_pass(client, tokenizer, reference_model):
    reply = client.chat.completions.create(
        model=SERVED_NAME,
        messages=MESSAGES,
        n=3,
        max_tokens=10,
        temperature=1.0,
        logprobs=True,
        top_logprobs=3,
        seed=7,
    )
    prompt_ids = chat_prompt_ids(tokenizer, MESSAGES)
    assert reply.object == "chat.completion" and reply.model == SERVED_NAME
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == 30
    assert reply.usage.total_tokens == len(prompt_ids) + 30
    texts = set()
    for choice in reply.choices:
        assert choice.finish_reason == "length"
        assert choice.message.role == "assistant"
        content = choice.logprobs.content
        assert len(content) == 10
        texts.add(choice.message.content)
        assert "".join(t.token for t in content) == choice.message.content
        for entry in content:
            assert len(entry.top_logprobs) == 3
            # Raw log-probs: the top alternatives are sorted and bound the sampled token's.
            tops = [t.logprob for t in entry.top_logprobs]
            assert tops == sorted(tops, reverse=True)
            assert entry.logprob <= tops[0] + 1e-5
    assert len(texts) > 1, "three samples at temperature 1 should differ"
    # The token-level view of the same request checks values against a forward pass.
    gen = httpx.post(
        str(client.base_url).replace("/v1/", "/generate"),
        json={"prompt": {"prompt_token_ids": prompt_ids}, "logprobs": 0, "max_tokens": 10},
        timeout=60,
    ).json()
    output = gen["token_ids"][0]
    served = [list(item[0].values())[0] for item in gen["logprobs"][0]]
    expected = reference_logprobs(reference_model, prompt_ids, output)
    assert served == pytest.approx(expected, abs=2e-3)


def test_logprobs_are_processed_by_default(client, reference_model):
    """atropos-serve reports the log-probs of the distribution it sampled from (temperature,
    top-k and top-p applied, renormalised: ``--logprobs-mode processed_logprobs``, its default;
    docs/compat.md, Unbiased importance ratios), which the trainer's ``token_logprobs`` replays."""
    from atroposlib.trainer.tensors import token_logprobs

    for temperature in (0.3, 2.0):
        gen = httpx.post(
            str(client.base_url).replace("/v1/", "/generate"),
            json={
                "prompt": {"prompt_token_ids": PROMPT_IDS},
                "logprobs": 0,
                "max_tokens": 6,
                "temperature": temperature,
                "top_k": 50,
                "top_p": 0.9,
            },
            timeout=60,
        ).json()
        served = [list(item[0].values())[0] for item in gen["logprobs"][0]]
        ids = torch.tensor([PROMPT_IDS + gen["token_ids"][0]])
        with torch.no_grad():
            logits = reference_model(ids).logits.float()
        processed = token_logprobs(
            logits, ids, torch.tensor([temperature]), torch.tensor([50]), torch.tensor([0.9])
        )[0, len(PROMPT_IDS) :]
        assert served == pytest.approx(processed.tolist(), abs=2e-3)
        raw = reference_logprobs(reference_model, PROMPT_IDS, gen["token_ids"][0])
        assert served != pytest.approx(raw, abs=2e-3)  # not the model's own distribution


def test_generate_matches_upstream_vllm_server_shape(client, reference_model):
    body = {"prompt": {"prompt_token_ids": PROMPT_IDS}, "logprobs": 0, "n": 4, "max_tokens": 7}
    reply = httpx.post(str(client.base_url).replace("/v1/", "/generate"), json=body, timeout=60)
    assert reply.status_code == 200
    results = reply.json()
    assert len(results["logprobs"]) == len(results["finish_reasons"]) == 4
    assert results["prompt_token_ids"] == PROMPT_IDS
    # Parse exactly as upstream's VLLMServer._tokens_and_logprobs_completion_wrapper does.
    for sample, finish, token_ids in zip(
        results["logprobs"], results["finish_reasons"], results["token_ids"], strict=True
    ):
        logprobs = [list(item[0].values())[0] for item in sample]
        output_ids = [int(list(item[0].keys())[0]) for item in sample]
        assert output_ids == token_ids and len(output_ids) == 7
        assert finish == "length"
        assert logprobs == pytest.approx(
            reference_logprobs(reference_model, PROMPT_IDS, output_ids), abs=2e-3
        )


def test_generate_top_logprobs_and_prompt_logprobs(client, reference_model):
    body = {
        "prompt": {"prompt_token_ids": PROMPT_IDS},
        "logprobs": 2,
        "prompt_logprobs": 1,
        "max_tokens": 3,
        "temperature": 0,
    }
    results = httpx.post(str(client.base_url).replace("/v1/", "/generate"), json=body).json()
    for item in results["logprobs"][0]:
        entry = item[0]
        assert 1 <= len(entry) <= 3
    prompt_lp = results["prompt_logprobs"]
    assert prompt_lp[0] is None and len(prompt_lp) == len(PROMPT_IDS)
    for pos, entry in enumerate(prompt_lp[1:], start=1):
        first_id, first_lp = next(iter(entry.items()))
        assert int(first_id) == PROMPT_IDS[pos]
        expected = reference_logprobs(reference_model, PROMPT_IDS[:pos], [PROMPT_IDS[pos]])[0]
        assert first_lp == pytest.approx(expected, abs=2e-3)


def test_token_generate_is_vllms_tokens_in_tokens_out_endpoint(client, reference_model):
    """``POST /inference/v1/generate`` (verifiers' training client, prime-rl): prompt token ids
    in, sampled ids and their log-probs out as ``token_id:N`` entries, nothing re-tokenized."""
    url = str(client.base_url).replace("/v1/", "/inference/v1/generate")
    body = {
        "model": SERVED_NAME,
        "token_ids": PROMPT_IDS,
        "sampling_params": {"max_tokens": 6, "n": 2, "logprobs": 1, "skip_special_tokens": False},
    }
    reply = httpx.post(url, json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    result = reply.json()
    assert result["prompt_token_ids"] == PROMPT_IDS
    assert result["request_id"]
    assert result["usage"]["prompt_tokens"] == len(PROMPT_IDS)
    assert len(result["choices"]) == 2
    for choice in result["choices"]:
        ids = choice["token_ids"]
        assert len(ids) == 6 and choice["finish_reason"] == "length"
        content = choice["logprobs"]["content"]
        assert [c["token"] for c in content] == [f"token_id:{t}" for t in ids]
        assert [c["logprob"] for c in content] == pytest.approx(
            reference_logprobs(reference_model, PROMPT_IDS, ids), abs=2e-3
        )
        assert all(len(c["top_logprobs"]) <= 1 for c in content)
    # without sampling_params.logprobs there are none; max_tokens defaults to the room left
    greedy = httpx.post(
        url, json={"token_ids": PROMPT_IDS, "sampling_params": {"max_tokens": 8, "temperature": 0}}
    ).json()
    assert greedy["choices"][0]["logprobs"] is None
    assert greedy["choices"][0]["token_ids"] == greedy_ids(client, PROMPT_IDS, 8)


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"token_ids": []}, 400, "token_ids"),
        ({"token_ids": [1], "model": "nope"}, 404, "does not exist"),
        ({"token_ids": [1], "sampling_params": {"best_of": 2}}, 400, "sampling_params.best_of"),
        ({"token_ids": [1], "features": {"mm_hashes": []}}, 400, "multimodal"),
        ({"token_ids": [10**9]}, 400, "prompt token ids must be in"),
        ({"token_ids": [1], "sampling_params": {"temperature": -1}}, 400, "temperature"),
    ],
)
def test_token_generate_refuses_bad_requests_by_name(client, body, status, says):
    url = str(client.base_url).replace("/v1/", "/inference/v1/generate")
    reply = httpx.post(url, json=body, timeout=30)
    assert reply.status_code == status, reply.text
    assert says in reply.json()["error"]["message"]


def test_token_generate_ignores_the_renderer_clients_extra_keys(client):
    url = str(client.base_url).replace("/v1/", "/inference/v1/generate")
    body = {
        "token_ids": PROMPT_IDS,
        "cache_salt": "s",
        "sampling_params": {"max_tokens": 2, "routed_experts_prompt_start": 3, "logprobs": 1},
    }
    assert httpx.post(url, json=body, timeout=30).status_code == 200


def test_greedy_is_argmax_and_sampling_controls(client):
    greedy = greedy_ids(client, PROMPT_IDS, 8)

    def completion_ids(**kwargs) -> list[str]:
        reply = client.completions.create(
            model=SERVED_NAME, prompt=PROMPT_IDS, max_tokens=8, logprobs=0, **kwargs
        )
        return [c.logprobs.tokens for c in reply.choices]

    greedy_tokens = completion_ids(temperature=0)[0]
    # top_k=1 and a tiny top_p both reduce sampling to the argmax.
    assert completion_ids(temperature=1.5, extra_body={"top_k": 1}, n=2) == [greedy_tokens] * 2
    assert completion_ids(temperature=1.5, top_p=1e-6) == [greedy_tokens]
    assert len(greedy) == 8
    # A seed makes sampling repeatable; different seeds give different samples.
    first = completion_ids(temperature=1.0, seed=123, n=2)
    assert completion_ids(temperature=1.0, seed=123, n=2) == first
    assert first[0] != first[1]
    assert completion_ids(temperature=1.0, seed=124, n=2) != first


def test_completions_batch_of_prompts_text_and_ids(client, tokenizer):
    special = {added.content for added in tokenizer.added_tokens_decoder.values() if added.special}
    assert "<jupyter_text>" in special
    reply = client.completions.create(
        model="tiny-alias", prompt=["Hello", "The sky is"], n=2, max_tokens=4, logprobs=2
    )
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    for choice in reply.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
        assert lp.text_offset[0] == 0
        # As in vLLM, log-prob tokens name special tokens the text skips (skip_special_tokens).
        assert "".join(t for t in lp.tokens if t not in special) == choice.text
        assert all(len(top) >= 2 for top in lp.top_logprobs)
    batch = client.completions.create(
        model=SERVED_NAME, prompt=[PROMPT_IDS, PROMPT_IDS[:3]], max_tokens=3, temperature=0
    )
    assert len(batch.choices) == 2
    assert batch.usage.prompt_tokens == len(PROMPT_IDS) + 3
    assert batch.usage.completion_tokens == 6


def test_stop_strings_stop_ids_and_length(client, tokenizer):
    greedy = greedy_ids(client, PROMPT_IDS, 12)
    text = tokenizer.decode(greedy)
    stop = tokenizer.decode(greedy[4:6]).strip()
    assert stop and stop in text
    before = text[: text.index(stop)]
    reply = client.completions.create(
        model=SERVED_NAME, prompt=PROMPT_IDS, max_tokens=12, temperature=0, stop=[stop, "@@@"]
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.text == before
    assert choice.model_extra["stop_reason"] == stop
    included = client.completions.create(
        model=SERVED_NAME,
        prompt=PROMPT_IDS,
        max_tokens=12,
        temperature=0,
        stop=stop,
        extra_body={"include_stop_str_in_output": True},
    )
    assert included.choices[0].text == before + stop
    # A stop token id ends the sample on that token; its text is left out.
    by_id = client.completions.create(
        model=SERVED_NAME,
        prompt=PROMPT_IDS,
        max_tokens=12,
        temperature=0,
        extra_body={"stop_token_ids": [greedy[3]]},
    )
    assert by_id.choices[0].finish_reason == "stop"
    assert by_id.usage.completion_tokens == greedy.index(greedy[3]) + 1
    assert by_id.choices[0].text == tokenizer.decode(greedy[: greedy.index(greedy[3])])
    # min_tokens keeps stop ids from ending the sample early.
    at_least = client.completions.create(
        model=SERVED_NAME,
        prompt=PROMPT_IDS,
        max_tokens=12,
        temperature=0,
        extra_body={"stop_token_ids": [greedy[0]], "min_tokens": 5},
    )
    assert at_least.usage.completion_tokens >= 5
    chat = client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, max_completion_tokens=3, temperature=0
    )
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 3


def test_skip_special_tokens_and_ignore_eos(client, tokenizer):
    eos = tokenizer.eos_token_id
    # Prompt the model with token ids; ask it to keep special tokens in decoded text.
    reply = client.completions.create(
        model=SERVED_NAME,
        prompt=PROMPT_IDS,
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )
    assert reply.choices[0].finish_reason == "length"
    # EOS used as an explicit stop id behaves like EOS: finish "stop", no text for it.
    greedy = greedy_ids(client, PROMPT_IDS, 3)
    text = client.completions.create(
        model=SERVED_NAME,
        prompt=PROMPT_IDS,
        max_tokens=3,
        temperature=0,
        extra_body={"stop_token_ids": [eos, greedy[1]]},
    )
    assert text.choices[0].finish_reason == "stop"


def test_streaming_chat_matches_non_streaming(client):
    kwargs = dict(model=SERVED_NAME, messages=MESSAGES, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}, n=2
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in chunks[:-1]:
        assert chunk.object == "chat.completion.chunk"
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {0: full, 1: full}
    assert finishes == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_streaming_completion_with_stop_and_logprobs(client, tokenizer):
    greedy = greedy_ids(client, PROMPT_IDS, 12)
    text = tokenizer.decode(greedy)
    stop = tokenizer.decode(greedy[5:7]).strip()
    expected = text[: text.index(stop)]
    stream = client.completions.create(
        model=SERVED_NAME,
        prompt=PROMPT_IDS,
        max_tokens=12,
        temperature=0,
        stop=stop,
        logprobs=1,
        stream=True,
    )
    received, tokens, finish = "", [], None
    for chunk in stream:
        choice = chunk.choices[0]
        received += choice.text
        if choice.logprobs:
            tokens += choice.logprobs.tokens
        finish = choice.finish_reason or finish
    assert received == expected and finish == "stop"
    assert tokens, "logprobs arrive with the streamed tokens"


async def test_async_client_concurrent_requests_are_batched(tiny_server):
    client = openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0)
    before = httpx.get(tiny_server.url + "/health").json()["stats"]["steps"]

    async def one(i: int):
        return await client.chat.completions.create(
            model=SERVED_NAME,
            messages=[{"role": "user", "content": f"Question {i}"}],
            n=2,
            max_tokens=32,
            extra_body={"ignore_eos": True},
        )

    replies = await asyncio.gather(*(one(i) for i in range(8)))
    after = httpx.get(tiny_server.url + "/health").json()["stats"]["steps"]
    assert all(len(r.choices) == 2 for r in replies)
    assert all(c.finish_reason == "length" for r in replies for c in r.choices)
    # 16 sequences of 32 tokens: sequentially 16 * 31 decode steps; batched far fewer.
    assert after - before < 4 * 32, f"{after - before} decode steps for 16 sequences"
    stream = await client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, max_tokens=5, stream=True
    )
    pieces = [c.choices[0].delta.content async for c in stream if c.choices]
    assert len(pieces) >= 2
    await client.close()


def test_bad_requests_are_openai_errors(client, tiny_server):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="nope", messages=MESSAGES)
    assert exc.value.body["code"] == "model_not_found"
    bad = [
        dict(n=0),
        dict(top_p=1.5),
        dict(temperature=-0.5),
        dict(logprobs=True, top_logprobs=50),
        dict(max_tokens=0),
        dict(max_tokens=100_000),
        dict(extra_body={"tools": [{"type": "function", "function": {"name": "f"}}]}),
        dict(extra_body={"messages": []}),
    ]
    for kwargs in bad:
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(
                **{"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 2, **kwargs}
            )
        assert set(exc.value.body) == {"message", "type", "param", "code"}, kwargs
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=SERVED_NAME, prompt="x" * 20000, max_tokens=4)
    assert exc.value.body["code"] == "context_length_exceeded"
    raw = httpx.post(tiny_server.url + "/v1/chat/completions", json={"model": SERVED_NAME})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    raw = httpx.post(tiny_server.url + "/generate", json={"prompt": {"prompt_token_ids": []}})
    assert raw.status_code == 400
    raw = httpx.post(tiny_server.url + "/generate", json={"prompt": "x", "bogus_kwarg": 1})
    assert raw.status_code == 400
    # The server still answers after all of that.
    assert client.completions.create(model=SERVED_NAME, prompt="ok", max_tokens=1).choices


def test_client_disconnect_frees_the_batch(tiny_server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            tiny_server.url + "/v1/completions",
            json={"model": SERVED_NAME, "prompt": "long", "max_tokens": 1500, "ignore_eos": True},
            timeout=0.5,
        )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if httpx.get(tiny_server.url + "/health").json()["running"] == 0:
            break
        time.sleep(0.2)
    assert httpx.get(tiny_server.url + "/health").json()["running"] == 0
