"""Weight reload while requests are in flight, API keys and overload behaviour."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.inference.conftest import SERVED_NAME, own_tiny_server, reference_logprobs, start_server

PROMPT_IDS = [504, 3458, 282, 4649, 314]


@pytest.fixture(scope="module")
def reload_server(tmp_path_factory, tiny_model_dir):
    yield from own_tiny_server(tmp_path_factory, tiny_model_dir)


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory, tiny_model_dir):
    """Tiny limits and an API key, to provoke 401 and 429."""
    server = start_server(
        tmp_path_factory,
        tiny_model_dir,
        "--dtype",
        "float32",
        "--served-model-name",
        SERVED_NAME,
        "--api-key",
        "sekret",
        "--max-concurrency",
        "2",
        "--max-queue",
        "1",
    )
    try:
        yield server
    finally:
        server.stop()


def _generate(url: str, max_tokens: int) -> httpx.Response:
    return httpx.post(
        url + "/generate",
        json={
            "prompt": {"prompt_token_ids": PROMPT_IDS},
            "logprobs": 0,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=120,
    )


def _served_logprobs(reply: httpx.Response) -> tuple[list[int], list[float]]:
    body = reply.json()
    ids = body["token_ids"][0]
    return ids, [list(item[0].values())[0] for item in body["logprobs"][0]]


async def test_reload_while_requests_are_in_flight(
    reload_server, tiny_model_dir, tiny_model_dir_b, reference_model
):
    from transformers import AutoModelForCausalLM

    model_b = AutoModelForCausalLM.from_pretrained(tiny_model_dir_b).eval()
    url = reload_server.url
    # The tiny model is a Llama: it decodes on the lean path, before and after the reload.
    assert httpx.get(url + "/health").json()["decode_path"] == "lean"
    before_ids, before_lp = _served_logprobs(_generate(url, 8))
    assert before_lp == pytest.approx(
        reference_logprobs(reference_model, PROMPT_IDS, before_ids), abs=2e-3
    )

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        body = {
            "prompt": {"prompt_token_ids": PROMPT_IDS},
            "logprobs": 0,
            "max_tokens": 300,
            "temperature": 0,
            "ignore_eos": True,
            "n": 2,
        }
        in_flight = asyncio.create_task(client.post("/generate", json=body))
        # Wait until the long request is generating, then reload under it.
        for _ in range(100):
            if (await client.get("/health")).json()["running"]:
                break
            await asyncio.sleep(0.05)
        started = time.time()
        reload = await client.post("/reload_weights", json={"path": str(tiny_model_dir_b)})
        long_reply = await in_flight

    assert reload.status_code == 200, reload.text
    info = reload.json()
    assert info["model"] == SERVED_NAME and info["weights_version"] == 1
    assert info["live_at"] >= started and info["total_seconds"] >= info["load_seconds"]
    # The reload waited for the 300-token request to finish on the old weights.
    assert info["drain_seconds"] > 0
    # The in-flight request finished entirely on the old weights.
    assert long_reply.headers["X-Weights-Version"] == "0"
    long_ids = long_reply.json()["token_ids"][0]
    assert len(long_ids) == 300
    long_lp = [list(item[0].values())[0] for item in long_reply.json()["logprobs"][0]]
    assert long_lp[:50] == pytest.approx(
        reference_logprobs(reference_model, PROMPT_IDS, long_ids[:50]), abs=2e-3
    )
    # New requests run on the new weights, under the same model name.
    after = _generate(url, 8)
    assert after.headers["X-Weights-Version"] == "1"
    assert httpx.get(url + "/health").json()["decode_path"] == "lean"
    after_ids, after_lp = _served_logprobs(after)
    assert after_lp == pytest.approx(reference_logprobs(model_b, PROMPT_IDS, after_ids), abs=2e-3)
    assert (after_ids, after_lp) != (before_ids, before_lp)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    assert [m.id for m in client.models.list().data] == [SERVED_NAME]


def test_reload_rejects_bad_folders(reload_server, tmp_path):
    reply = httpx.post(reload_server.url + "/reload_weights", json={"path": str(tmp_path)})
    assert reply.status_code == 400
    assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
    (tmp_path / "config.json").write_text("{not json")
    reply = httpx.post(reload_server.url + "/reload_weights", json={"path": str(tmp_path)})
    assert reply.status_code == 400
    assert httpx.get(reload_server.url + "/health").status_code == 200


def test_api_key_required(guarded_server):
    url = guarded_server.url
    assert httpx.get(url + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    reply = httpx.post(url + "/generate", json={"prompt": {"prompt_token_ids": [1]}})
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    client = openai.OpenAI(base_url=url + "/v1", api_key="sekret")
    assert client.models.list().data[0].id == SERVED_NAME


@pytest.mark.nightly  # out of per-commit CI (time budget): .ci/nightly runs it
async def test_overload_answers_429_and_never_hangs(guarded_server):
    client = openai.AsyncOpenAI(
        base_url=guarded_server.url + "/v1", api_key="sekret", max_retries=0, timeout=60
    )

    async def one():
        return await client.completions.create(
            model=SERVED_NAME,
            prompt="busy",
            n=2,
            max_tokens=150,
            extra_body={"ignore_eos": True},
        )

    results = await asyncio.gather(*(one() for _ in range(6)), return_exceptions=True)
    ok = [r for r in results if not isinstance(r, BaseException)]
    limited = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert ok and limited and len(ok) + len(limited) == 6, results
    assert limited[0].response.headers.get("retry-after") == "1"
    # Once the load is gone the server serves again.
    assert (await one()).choices
    await client.close()


def test_served_weights_do_not_follow_a_checkpoint_rewritten_in_place(
    tmp_path_factory, tiny_model_dir, tiny_model_dir_b, tmp_path
):
    """A float32 checkpoint served in float32 is not left as a view of its file: when a trainer
    rewrites ``model.safetensors`` in place (same path, same inode) the served weights stay the
    ones loaded, at start and after ``/reload_weights``; the next reload takes the new ones."""
    import shutil

    served = tmp_path / "ckpt"
    shutil.copytree(tiny_model_dir, served)
    other = (tiny_model_dir_b / "model.safetensors").read_bytes()
    original = (tiny_model_dir / "model.safetensors").read_bytes()

    def rewrite_in_place(data: bytes) -> None:
        with open(served / "model.safetensors", "r+b") as f:  # truncate + write: same inode
            f.truncate(0)
            f.write(data)

    def greedy_logprobs(url: str) -> list[float]:
        reply = httpx.post(
            url + "/v1/completions",
            json={"model": SERVED_NAME, "prompt": PROMPT_IDS, "max_tokens": 4,
                  "temperature": 0, "logprobs": 0},
            timeout=60,
        )  # fmt: skip
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["logprobs"]["token_logprobs"]

    server = start_server(
        tmp_path_factory, served, "--dtype", "float32", "--served-model-name", SERVED_NAME
    )
    try:
        before = greedy_logprobs(server.url)
        rewrite_in_place(other)
        assert greedy_logprobs(server.url) == before
        rewrite_in_place(original)
        reply = httpx.post(server.url + "/reload_weights", json={"path": str(served)}, timeout=120)
        assert reply.status_code == 200, reply.text
        assert greedy_logprobs(server.url) == before
        rewrite_in_place(other)  # the reloaded weights do not follow the file either
        assert greedy_logprobs(server.url) == before
        reply = httpx.post(server.url + "/reload_weights", json={"path": str(served)}, timeout=120)
        assert reply.status_code == 200, reply.text
        assert greedy_logprobs(server.url) != before  # a reload reads the file as it is now
    finally:
        server.stop()
