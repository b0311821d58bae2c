"""VLLMServer against the real tiny ``atropos-serve``: ``/generate`` for tokens and logprobs."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI, Request

from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.sglang_server import SGLangServer
from atroposlib.envs.server_handling.vllm_server import VLLMServer, drop_double_bos
from tests.envs.server_handling.conftest import serve_app


async def test_tokens_and_logprobs_from_prompt(tiny_config: APIServerConfig) -> None:
    server = VLLMServer(tiny_config)
    try:
        prompt_tokens, outputs, logprobs, reasons = await server.tokens_and_logprobs_completion(
            prompt="The capital of France is", n=3, max_new_tokens=6, temperature=1.0, seed=1
        )
        assert prompt_tokens == server.tokenizer.encode("The capital of France is")
        assert len(outputs) == len(logprobs) == len(reasons) == 3
        for ids, lps, reason in zip(outputs, logprobs, reasons, strict=True):
            assert 1 <= len(ids) <= 6 and len(lps) == len(ids)
            assert all(isinstance(t, int) for t in ids)
            assert all(lp <= 0.0 for lp in lps)
            assert reason in ("stop", "length")
        assert list(server.attempts_list) == [1]
    finally:
        await server.close()


async def test_input_ids_are_sent_verbatim_and_logprobs_are_real(
    tiny_config: APIServerConfig,
) -> None:
    server = VLLMServer(tiny_config)
    try:
        ids = server.tokenizer.encode("Hello there, friend")
        prompt_tokens, outputs, logprobs, _ = await server.tokens_and_logprobs_completion(
            input_ids=ids, prompt="ignored", max_tokens=5, temperature=1.0, seed=3
        )
        assert prompt_tokens == ids
        # Score prompt + completion: the logprob of each generated token matches.
        scored = await server.get_logprobs(input_ids=ids + outputs[0], top_k=2)
        assert scored["prompt_tokens"] == ids + outputs[0]
        assert scored["prompt_topk_token_ids"][0] == []  # no logprob for the first token
        for i, (token, lp) in enumerate(zip(outputs[0], logprobs[0], strict=True)):
            pos = len(ids) + i
            assert scored["prompt_topk_token_ids"][pos][0] == token
            assert scored["prompt_topk_logprobs"][pos][0] == pytest.approx(lp, abs=1e-3)
            assert len(scored["prompt_topk_token_ids"][pos]) in (2, 3)
    finally:
        await server.close()


async def test_chat_and_health(tiny_config: APIServerConfig) -> None:
    server = VLLMServer(tiny_config)
    try:
        assert await server._probe_health()
        out = await server.chat_completion(
            messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=3
        )
        assert len(out.choices) == 2
    finally:
        await server.close()


def test_drop_double_bos() -> None:
    assert drop_double_bos([1, 1, 5], 1) == [1, 5]
    assert drop_double_bos([1, 5], 1) == [1, 5]
    assert drop_double_bos([1, 1], None) == [1, 1]


async def test_sglang_generate_shape(tiny_config: APIServerConfig) -> None:
    """SGLang's native /generate request and response shape, on a loopback stand-in."""
    app = FastAPI()
    seen: list[dict[str, Any]] = []

    @app.post("/generate")
    async def generate(request: Request) -> list[dict[str, Any]]:
        seen.append(await request.json())
        return [
            {
                "meta_info": {
                    "output_token_logprobs": [[-0.5, 7, None], [-1.5, 8, None]],
                    "finish_reason": {"type": "length"},
                }
            },
            {
                "meta_info": {
                    "output_token_logprobs": [[-0.25, 9, None]],
                    "finish_reason": {"type": "stop"},
                }
            },
        ]

    with serve_app(app) as url:
        config = tiny_config.model_copy(
            update={"base_url": f"{url}/v1", "health_check": False, "server_type": "sglang"}
        )
        server = SGLangServer(config)
        result = await server.tokens_and_logprobs_completion(input_ids=[1, 2, 3], max_tokens=2, n=2)
    assert result == (
        [1, 2, 3],
        [[7, 8], [9]],
        [[-0.5, -1.5], [-0.25]],
        [{"type": "length"}, {"type": "stop"}],
    )
    assert seen == [
        {
            "input_ids": [1, 2, 3],
            "sampling_params": {"max_new_tokens": 2, "n": 2},
            "return_logprob": True,
            "return_text_in_logprobs": False,
        }
    ]


async def test_generation_aborted_by_a_pause_is_run_again(tiny_config: APIServerConfig) -> None:
    """A server paused with ``mode=abort`` (for a weight update) ends running generations
    early; the client runs them again once the server resumes, so the env only sees whole
    samples."""
    import asyncio

    import httpx

    base = tiny_config.base_url.removesuffix("/v1")
    server = VLLMServer(tiny_config)
    try:
        call = asyncio.create_task(
            server.tokens_and_logprobs_completion(
                prompt="Count: one, two,", n=2, max_tokens=300, temperature=1.0, ignore_eos=True
            )
        )
        async with httpx.AsyncClient(timeout=60) as client:
            # pause while the rows are generating (a fixed sleep raced a fast machine: the
            # 300 tokens were done before the pause)
            deadline = asyncio.get_running_loop().time() + 30
            while (await client.get(base + "/health")).json().get("running", 0) < 2:
                assert not call.done(), "the generation finished before it could be paused"
                assert asyncio.get_running_loop().time() < deadline, "never started generating"
                await asyncio.sleep(0.01)
            assert (await client.post(base + "/pause", params={"mode": "abort"})).status_code == 200
            await asyncio.sleep(1.0)
            assert not call.done()  # the re-run waits in the paused server's queue
            await client.post(base + "/resume")
        _, outputs, logprobs, reasons = await call
        assert reasons == ["length", "length"]
        assert [len(o) for o in outputs] == [300, 300] and [len(lp) for lp in logprobs] == [
            300,
            300,
        ]
        assert server.aborted_generations == 1
    finally:
        await server.close()
        async with httpx.AsyncClient(timeout=30) as client:
            await client.post(base + "/resume")
