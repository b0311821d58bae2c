"""``atropos-serve --max-cache-memory``: requests are admitted against a key/value cache budget,
through HTTP against a real server with a tiny budget. A request that could never fit alone is
refused (400, ``memory_budget_exceeded``, naming the field); requests that fit alone but not
together wait in the queue and all succeed."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from transformers import AutoConfig

from tests.inference.conftest import SERVED_NAME, start_server

PROMPT = [1, 2, 3, 4]
MAX_TOKENS = 24
HEADROOM = 64


def _bytes_per_token(model_dir) -> int:
    config = AutoConfig.from_pretrained(model_dir)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * 4  # float32


@pytest.fixture(scope="module")
def budget_server(tmp_path_factory, tiny_model_dir):
    one = 2 * 1 * (len(PROMPT) + MAX_TOKENS + HEADROOM) * _bytes_per_token(tiny_model_dir)
    budget = one * 3 // 2  # one request of n=1 fits, two together do not
    server = start_server(
        tmp_path_factory,
        tiny_model_dir,
        "--dtype",
        "float32",
        "--served-model-name",
        SERVED_NAME,
        "--max-cache-memory",
        str(budget),
    )
    try:
        yield server
    finally:
        server.stop()


def test_a_request_that_could_never_fit_is_refused_naming_the_field(budget_server):
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 8100 // 8, "n": 64}
    reply = httpx.post(f"{budget_server.url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "memory_budget_exceeded" and error["param"] == "n"
    assert "--max-cache-memory" in error["message"]
    one = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 2000}
    reply = httpx.post(f"{budget_server.url}/v1/completions", json=one, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "max_tokens"
    # /generate (vLLM's route) is admitted the same way
    reply = httpx.post(
        f"{budget_server.url}/generate",
        json={"prompt": {"prompt_token_ids": PROMPT}, "n": 64, "max_tokens": 1000},
        timeout=30,
    )
    assert reply.status_code == 400, reply.text
    assert httpx.get(f"{budget_server.url}/health").status_code == 200


async def test_requests_that_fit_alone_wait_their_turn_and_all_succeed(budget_server):
    before = httpx.get(f"{budget_server.url}/health").json()["stats"]["memory_waits"]
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 1}
    async with httpx.AsyncClient(base_url=budget_server.url, timeout=120) as client:
        replies = await asyncio.gather(
            *(client.post("/v1/completions", json=body) for _ in range(4))
        )
    assert [r.status_code for r in replies] == [200] * 4
    after = httpx.get(f"{budget_server.url}/health").json()["stats"]["memory_waits"]
    assert after > before  # they queued for the budget instead of growing the cache past it
