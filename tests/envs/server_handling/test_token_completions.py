"""Token ids and sampler log-probs through vLLM's ``/v1/completions`` (``return_token_ids``):

- ``TrlVllmServer`` (``server_type: trl``) against a real server speaking the routes of
  ``trl vllm-serve`` 1.16 (vLLM's OpenAI server): our ``atropos-serve``. ``ManagedServer`` gets
  the exact prompt ids, the sampled ids and their log-probs (checked against ``/generate``).
- its fallback to older TRL servers' ``POST /generate/`` (TRL 1.0's answer with log-probs;
  earlier ones without: token-level calls then say to upgrade).
- ``VLLMServer`` (``server_type: vllm``) against a server without ``/generate`` (vLLM's own
  OpenAI server; here the stand-in ``tests/trainer/fake_vllm.py``): it switches to
  ``/v1/completions`` and stays token-exact, prompt log-probs included.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from fastapi import FastAPI, Request

from atroposlib.envs.server_handling.managed_server import ManagedServer
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.trl_vllm_server import TrlVllmServer
from atroposlib.envs.server_handling.vllm_server import VLLMServer
from atroposlib.utils.processes import ChildProcess
from tests.conftest import free_port
from tests.envs.server_handling.conftest import serve_app

FAKE_VLLM = Path(__file__).resolve().parents[2] / "trainer" / "fake_vllm.py"
MESSAGES = [{"role": "user", "content": "Hello"}]


def _generate(url: str, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"prompt": {"prompt_token_ids": prompt_ids}, "logprobs": 0,
            "max_tokens": max_tokens, "temperature": 0}  # fmt: skip
    reply = httpx.post(url + "/generate", json=body, timeout=60).json()
    lps = [float(next(iter(e[0].values()))) for e in reply["logprobs"][0]]
    return {"ids": reply["token_ids"][0], "logprobs": lps}


def _trl(url: str, model_dir: Path, model_name: str = "tiny") -> TrlVllmServer:
    return TrlVllmServer(
        APIServerConfig(
            base_url=url,
            model_name=model_name,
            tokenizer_name=str(model_dir),
            server_type="trl",
            timeout=60,
        )  # fmt: skip
    )


async def test_trl_server_is_token_exact_through_managed_server(
    tiny_serve: Any, tiny_model_dir: Path
) -> None:
    server = _trl(tiny_serve.url, tiny_model_dir)
    managed = ManagedServer(server)
    out = await managed.chat_completion(messages=MESSAGES, max_tokens=6, temperature=0)
    assert server.protocol == "completions"
    (node,) = managed.get_state()["nodes"]
    tokenizer = server.tokenizer
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt)
    expected = _generate(tiny_serve.url, prompt_ids, 6)
    n = len(prompt_ids)
    assert node.tokens == prompt_ids + expected["ids"]
    assert node.masked_tokens == [-100] * n + expected["ids"]
    assert node.logprobs[:n] == [1.0] * n
    assert node.logprobs[n:] == pytest.approx(expected["logprobs"], abs=1e-4)
    assert out.choices[0].message.content == tokenizer.decode(
        expected["ids"], skip_special_tokens=True
    )

    # a second turn extends the same node: the earlier tokens are sent back exactly
    messages = [*MESSAGES, {"role": "assistant", "content": out.choices[0].message.content},
                {"role": "user", "content": "And?"}]  # fmt: skip
    await managed.chat_completion(messages=messages, max_tokens=4, temperature=0)
    (extended,) = managed.get_state()["nodes"]
    assert extended.tokens[: len(node.tokens)] == node.tokens
    assert len(extended.tokens) > len(node.tokens)

    # plain chat and text completions (no token ids needed) work on the same route
    chat = await server.chat_completion(messages=MESSAGES, max_tokens=3, temperature=0, n=2)
    assert len(chat.choices) == 2 and chat.choices[0].finish_reason in ("stop", "length")
    text = await server.completion(prompt="Say", max_tokens=3, temperature=0)
    assert text.choices[0].text and text.choices[0].finish_reason == "length"


async def test_trl_server_wrong_model_is_an_error_not_a_fallback(
    tiny_serve: Any, tiny_model_dir: Path
) -> None:
    server = _trl(tiny_serve.url, tiny_model_dir, model_name="no-such-model")
    with pytest.raises(aiohttp.ClientResponseError) as exc:
        await server.tokens_and_logprobs_completion(input_ids=[1, 2, 3], max_tokens=2)
    assert exc.value.status == 404 and "no-such-model" in exc.value.message
    assert server.protocol is None


def _legacy_app(with_logprobs: bool) -> tuple[FastAPI, list[dict[str, Any]]]:
    """An older TRL server: only ``POST /generate/`` (TRL 1.0's answer, or the earlier one
    without log-probs). Its log-probs are sorted by probability, the sampled token second."""
    app = FastAPI()
    seen: list[dict[str, Any]] = []

    @app.post("/generate/")
    async def generate(request: Request) -> dict[str, Any]:
        body = await request.json()
        seen.append(body)
        completions = [[11, 12, 2], [13, 14]][: body["n"]]
        reply: dict[str, Any] = {"completion_ids": completions}
        if with_logprobs:
            reply["prompt_ids"] = [[7, 8, 9]]
            reply["logprobs"] = [[[-0.1, -t / 10] for t in ids] for ids in completions]
            reply["logprob_token_ids"] = [[[99, t] for t in ids] for ids in completions]
        return reply

    return app, seen


async def test_trl_server_falls_back_to_older_trl_generate(tiny_model_dir: Path) -> None:
    app, seen = _legacy_app(with_logprobs=True)
    with serve_app(app) as url:
        server = _trl(url, tiny_model_dir)
        prompt, outputs, logprobs, reasons = await server.tokens_and_logprobs_completion(
            input_ids=[7, 8, 9], n=2, max_tokens=3
        )
        assert server.protocol == "legacy"
        assert prompt == [7, 8, 9]  # as the server tokenized it
        assert outputs == [[11, 12, 2], [13, 14]]
        assert logprobs == [[-1.1, -1.2, -0.2], [-1.3, -1.4]]  # the sampled tokens' entries
        assert reasons == ["stop", "length"]
        assert seen[-1]["prompts"] == [server.tokenizer.decode([7, 8, 9])]
        assert (seen[-1]["logprobs"], seen[-1]["n"], seen[-1]["max_tokens"]) == (0, 2, 3)


async def test_trl_server_older_than_1_0_has_no_token_logprobs(tiny_model_dir: Path) -> None:
    app, _ = _legacy_app(with_logprobs=False)
    with serve_app(app) as url:
        server = _trl(url, tiny_model_dir)
        with pytest.raises(NotImplementedError, match="upgrade TRL"):
            await server.tokens_and_logprobs_completion(input_ids=[7, 8, 9], max_tokens=2)
        text = await server.completion(prompt="hi", max_tokens=2)
        assert text.choices[0].finish_reason == "stop"  # completion 0 ends with EOS (2)


# ---------------------------------------------------------------- VLLMServer, no /generate


@pytest.fixture()
def fake_vllm(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    argv = [sys.executable, str(FAKE_VLLM), "--model", "base", "--served-model-name", "policy",
            "--port", str(port), "--middleware", "atropos_policy_version.PolicyVersionMiddleware"]  # fmt: skip
    child = ChildProcess(
        "fake-vllm",
        argv,
        tmp_path / "fake_vllm.log",
        env={"VLLM_SERVER_DEV_MODE": "1", "FAKE_VLLM_RECORD": str(tmp_path / "launches.jsonl")},
    ).start()
    try:
        child.wait_ready(f"http://127.0.0.1:{port}/health", 30)
        yield f"http://127.0.0.1:{port}"
    finally:
        child.stop()


async def test_vllm_server_without_generate_uses_completions(
    fake_vllm: str, tiny_model_dir: Path
) -> None:
    server = VLLMServer(
        APIServerConfig(
            base_url=fake_vllm + "/v1",
            model_name="policy",
            tokenizer_name=str(tiny_model_dir),
            server_type="vllm",
            health_check=False,
        )  # fmt: skip
    )
    try:
        prompt, outputs, logprobs, reasons = await server.tokens_and_logprobs_completion(
            input_ids=[200, 201, 202], n=2, max_tokens=5, temperature=1.0, seed=3
        )
        assert server.has_generate_route is False
        assert prompt == [200, 201, 202] and len(outputs) == len(logprobs) == 2
        assert all(reason in ("stop", "length") for reason in reasons)
        # the sampler's log-probs are the model's: scoring the same ids gives them back
        for ids, lps in zip(outputs, logprobs, strict=True):
            scored = await server.get_logprobs(input_ids=prompt + ids)
            assert scored["prompt_tokens"] == prompt + ids
            at = [scored["prompt_topk_logprobs"][3 + i][0] for i in range(len(ids))]
            assert [scored["prompt_topk_token_ids"][3 + i][0] for i in range(len(ids))] == ids
            assert at == pytest.approx(lps, abs=1e-9)

        managed = ManagedServer(server)
        await managed.chat_completion(messages=MESSAGES, max_tokens=4, temperature=0)
        (node,) = managed.get_state()["nodes"]
        completion = [t for t, m in zip(node.tokens, node.masked_tokens, strict=True) if m != -100]
        assert completion and all(200 <= t < 264 or t == 2 for t in completion)
        assert all(lp <= 0 for lp in node.logprobs[-len(completion) :])
    finally:
        await server.close()
