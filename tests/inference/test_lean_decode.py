"""The lean decode step must compute exactly what the ``transformers`` model computes, and the
engine must fall back to the model whenever it cannot."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from atroposlib.inference.engine import GenerationEngine
from atroposlib.inference.fastpath.attention import append_cache, use_decode_attention
from atroposlib.inference.fastpath.lean_decode import LeanDecoder
from atroposlib.inference.fastpath.packed_linear import (
    is_packed,
    pack_linear_weights,
    packing_supported,
)
from atroposlib.inference.models import load_model
from atroposlib.inference.sampling import SamplingParams
from tests.inference.conftest import PACKED_DTYPES as DTYPES

pytestmark = pytest.mark.skipif(
    not packing_supported(torch.float32), reason="oneDNN is not available"
)


def _prepared(model_dir: Path, dtype: torch.dtype):
    loaded = load_model(str(model_dir), "float32")
    model = loaded.model.to(dtype)
    assert use_decode_attention(model)
    pack_linear_weights(model)
    return model, loaded.tokenizer


def _random_model(model_type: str, **overrides):
    """A small randomly initialised model of another Llama-like architecture, with random
    (not zero or one) biases and norm weights so that every term is exercised."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        **overrides,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.copy_(torch.randn_like(param) * 0.5 + (0.0 if name.endswith("bias") else 1))
    return model


OTHER_ARCHITECTURES = {
    "qwen2": {},  # biases on q, k and v
    "qwen3": {},  # per-head norms on q and k
    "mistral": {"sliding_window": None},
}


def _forward(model, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache):
    """The ``transformers`` forward pass as the engine calls it: last position's logits."""
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1, :]


def _prefill(model, ids: torch.Tensor, mask: torch.Tensor):
    cache = append_cache()
    logits = _forward(model, ids, mask, (mask.cumsum(dim=1) - 1).clamp(min=0), cache)
    return cache, logits.argmax(-1, keepdim=True)


def _assert_lean_steps_equal_the_model_forward(
    model, padded: bool, lean: LeanDecoder | None = None, tolerance: float = 0.0
) -> None:
    """Six greedy steps of three rows: the lean step's logits and cache against the
    ``transformers`` forward pass's, bit for bit (``tolerance`` 0), else within ``tolerance``
    (absolute and relative) with the same greedy tokens."""
    lean = lean or LeanDecoder.build(model)
    if not packing_supported(model.dtype):
        # No packed kernels for this dtype on this CPU (bf16 without AVX-512/AMX): nothing was
        # packed and the engine keeps the model's own forward.
        assert lean is None
        assert not any(is_packed(m) for m in model.modules())
        return
    assert lean is not None and lean.current()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (3, 12), generator=gen)
    mask = torch.ones_like(ids)
    if padded:  # rows of 12, 7 and 3 prompt tokens, left-padded as the engine does
        mask[1, :5] = 0
        mask[2, :9] = 0
    with torch.inference_mode():
        stock_cache, stock_tokens = _prefill(model, ids, mask)
        lean_cache, lean_tokens = _prefill(model, ids, mask)
        for _ in range(6):
            mask = torch.cat([mask, mask.new_ones((3, 1))], dim=1)
            positions = mask.sum(dim=1, keepdim=True) - 1
            stock = _forward(model, stock_tokens, mask, positions, stock_cache)
            got = lean(lean_tokens, mask, positions, lean_cache)
            # The same operations in the same order: the very same numbers.
            assert _close(got, stock, tolerance)
            stock_tokens = stock.argmax(-1, keepdim=True)
            lean_tokens = got.argmax(-1, keepdim=True)
            assert torch.equal(stock_tokens, lean_tokens)
        for stock_layer, lean_layer in zip(stock_cache.layers, lean_cache.layers, strict=True):
            assert _close(stock_layer.keys, lean_layer.keys, tolerance)
            assert _close(stock_layer.values, lean_layer.values, tolerance)


def _close(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> bool:
    if tolerance == 0.0:
        return torch.equal(a, b)
    return torch.allclose(a, b, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("padded", [False, True])
def test_lean_steps_equal_the_model_forward(
    tiny_model_dir: Path, dtype: torch.dtype, padded: bool
) -> None:
    model, _ = _prepared(tiny_model_dir, dtype)
    _assert_lean_steps_equal_the_model_forward(model, padded)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model_type", sorted(OTHER_ARCHITECTURES))
def test_lean_steps_equal_the_forward_of_related_architectures(
    model_type: str, dtype: torch.dtype
) -> None:
    model = _random_model(model_type, **OTHER_ARCHITECTURES[model_type]).to(dtype)
    assert use_decode_attention(model)
    pack_linear_weights(model)
    _assert_lean_steps_equal_the_model_forward(model, padded=True)


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        ("mistral", {"sliding_window": 8}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),
    ],
)
def test_sliding_window_models_keep_the_model_forward(model_type: str, overrides) -> None:
    model = _random_model(model_type, **overrides)
    use_decode_attention(model)
    pack_linear_weights(model)
    assert LeanDecoder.build(model) is None


def test_weights_changed_in_place_switch_the_lean_step_off(tiny_model_dir: Path) -> None:
    model, _ = _prepared(tiny_model_dir, torch.float32)
    lean = LeanDecoder.build(model)
    assert lean is not None and lean.current()
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(0.5)
    assert not lean.current()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_refresh_after_an_in_place_update_rewrites_the_copies_it_has(
    tiny_model_dir: Path, dtype: torch.dtype, model_type: str
) -> None:
    """After new weights are copied in place (a shared-memory sync), ``fastpath.refresh``
    rewrites the packed and fused copies where they are (the same tensors, no new ones) and
    the lean step then computes exactly the model's forward pass with the *new* weights
    (qwen2: biases on the fused q/k/v too)."""
    from atroposlib.inference import fastpath

    if model_type == "llama":
        model, _ = _prepared(tiny_model_dir, dtype)
    else:
        model = _random_model(model_type, **OTHER_ARCHITECTURES[model_type]).to(dtype)
        use_decode_attention(model)
    # PyTorch's attention: bit-identical to the forward pass (the C kernel is float32 attention)
    prepared = fastpath.prepare(model, fastpath.FastPathOptions(native_attention=False))
    if not packing_supported(dtype):  # bf16 without AVX-512/AMX: nothing packed, nothing to do
        assert prepared.lean is None and prepared.packed_layers == 0
        assert fastpath.refresh(prepared).decode_path == "transformers"
        return
    assert prepared.lean is not None
    packed = _packed_copies(model)
    fused = [(layer.qkv, layer.gate_up) for layer in prepared.lean.layers]
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator).to(dtype) * 0.05)
    assert not prepared.current()
    refreshed = fastpath.refresh(prepared)
    assert refreshed is prepared and refreshed.current()
    assert refreshed.decode_path == "lean"
    assert _packed_copies(model) == packed
    for layer, (qkv, gate_up) in zip(refreshed.lean.layers, fused, strict=True):
        assert layer.qkv is qkv and layer.gate_up is gate_up
    _assert_lean_steps_equal_the_model_forward(model, padded=True, lean=refreshed.lean)


def _packed_copies(model) -> dict[str, int]:
    """Each packed layer's packed matrix (its own, or the one it shares with its fused
    siblings), by identity."""
    copies = {}
    for name, module in model.named_modules():
        if is_packed(module):
            group = getattr(module, "_atropos_fused", None)
            copies[name] = id(group.packed if group is not None else module._atropos_packed)
    return copies


def test_models_it_cannot_run_exactly_get_none(tiny_model_dir: Path) -> None:
    loaded = load_model(str(tiny_model_dir), "float32")
    model = loaded.model
    assert LeanDecoder.build(model) is None  # stock sdpa attention, weights not packed
    use_decode_attention(model)
    assert LeanDecoder.build(model) is None  # weights not packed
    pack_linear_weights(model)
    assert LeanDecoder.build(model) is not None
    model.config.hidden_act = "gelu"
    assert LeanDecoder.build(model) is None


def _greedy(engine: GenerationEngine, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
    async def run() -> list[tuple[list[int], list]]:
        handles = [
            engine.submit(p, SamplingParams(max_tokens=20, temperature=0, logprobs=2))
            for p in prompts
        ]
        results = await asyncio.gather(*(h.result() for h in handles))
        return [(r[0].token_ids, r[0].logprobs) for r in results]

    return asyncio.run(run())


def test_engine_decodes_the_same_on_either_path(tiny_model_dir: Path) -> None:
    """Greedy generations of a batch of different-length prompts (padding, rows retiring at
    different times) are identical on the lean path and the model's own forward pass."""
    loaded = load_model(str(tiny_model_dir), "float32")
    lean_engine = GenerationEngine(loaded.model, loaded.tokenizer).start()
    assert lean_engine.decode_path == "lean"
    plain = load_model(str(tiny_model_dir), "float32")
    plain_engine = GenerationEngine(plain.model, plain.tokenizer, lean_decode=False).start()
    assert plain_engine.decode_path == "transformers"
    prompts = [[1, 504, 3458, 282], [1, 9, 8, 7, 6, 5, 4, 3, 2, 200, 300], [1, 77]]
    try:
        lean = _greedy(lean_engine, prompts)
        stock = _greedy(plain_engine, prompts)
    finally:
        lean_engine.shutdown()
        plain_engine.shutdown()
    for (lean_ids, lean_lp), (stock_ids, stock_lp) in zip(lean, stock, strict=True):
        assert lean_ids == stock_ids
        assert lean_lp == pytest.approx(stock_lp, abs=1e-5)
