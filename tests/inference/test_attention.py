"""The engine's decode kernels: single-token attention and the append-in-place KV cache must
give what ``transformers``' own sdpa attention and ``DynamicCache`` give."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers.cache_utils import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from atroposlib.inference.engine import GenerationEngine
from atroposlib.inference.fastpath.attention import (
    ATTENTION_NAME,
    HEADROOM,
    AppendLayer,
    append_cache,
    decode_attention,
)
from atroposlib.inference.models import load_model
from atroposlib.inference.sampling import SamplingParams


class _Attn(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True
        self.eval()


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4), (8, 1)])
def test_single_token_attention_matches_sdpa(mask_kind: str, heads: int, kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(0)
    batch, length, dim = 5, 37, 16
    query = torch.randn(batch, heads, 1, dim, generator=gen)
    key = torch.randn(batch, kv_heads, length, dim, generator=gen)
    value = torch.randn(batch, kv_heads, length, dim, generator=gen)
    mask = None
    if mask_kind != "none":
        allowed = torch.ones(batch, 1, 1, length, dtype=torch.bool)
        for row in range(batch):
            allowed[row, :, :, : row * 3] = False  # left padding of different widths
        mask = allowed
        if mask_kind == "float":
            mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float).min)
    module = _Attn(heads // kv_heads)
    ours, _ = decode_attention(module, query, key, value, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert ours.shape == theirs.shape == (batch, 1, heads, dim)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_several_query_tokens_go_to_sdpa() -> None:
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(2, 4, 6, 8, generator=gen)
    key = torch.randn(2, 2, 6, 8, generator=gen)
    value = torch.randn(2, 2, 6, 8, generator=gen)
    module = _Attn(2)
    ours, _ = decode_attention(module, query, key, value, None, scaling=0.5)
    theirs, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.5)
    torch.testing.assert_close(ours, theirs)


def test_append_layer_grows_past_its_headroom_and_survives_reselection() -> None:
    gen = torch.Generator().manual_seed(2)
    ours, reference = append_cache(), DynamicCache()
    steps = [torch.randn(3, 2, 5, 4, generator=gen)] + [
        torch.randn(3, 2, 1, 4, generator=gen) for _ in range(HEADROOM + 10)
    ]
    for i, states in enumerate(steps):
        k1, v1 = ours.update(states, -states, 0)
        k2, v2 = reference.update(states, -states, 0)
        torch.testing.assert_close(k1, k2, rtol=0, atol=0)
        torch.testing.assert_close(v1, v2, rtol=0, atol=0)
        if i == 20:  # a request finished: keep rows 0 and 2
            index = torch.tensor([0, 2])
            ours.batch_select_indices(index)
            reference.batch_select_indices(index)
            steps[i + 1 :] = [s[index] for s in steps[i + 1 :]]
    assert isinstance(ours.layers[0], AppendLayer)
    assert ours.get_seq_length() == reference.get_seq_length() == 5 + HEADROOM + 10


def _greedy(model_dir: Path, prompts: list[list[int]], fast_decode: bool) -> list:
    loaded = load_model(str(model_dir), "float32")

    async def run() -> list:
        engine = GenerationEngine(
            loaded.model, loaded.tokenizer, fast_decode=fast_decode, min_shared_prefix=10**9
        ).start()
        expected = ATTENTION_NAME if fast_decode else "sdpa"
        assert loaded.model.config._attn_implementation == expected
        try:
            # Different prompt lengths and finishing times: rows are merged with padding,
            # retired mid-run, and decoded past the cache's spare columns.
            handles = [
                engine.submit(
                    ids,
                    SamplingParams(
                        max_tokens=HEADROOM + 20 + 15 * i,
                        temperature=0.0,
                        logprobs=0,
                        ignore_eos=True,
                        n=2 if i == 1 else 1,
                    ),
                )
                for i, ids in enumerate(prompts)
            ]
            return [
                out for outs in await asyncio.gather(*(h.result() for h in handles)) for out in outs
            ]
        finally:
            engine.shutdown()

    return asyncio.run(run())


def test_engine_generates_the_same_with_and_without_the_decode_kernels(
    tiny_model_dir: Path,
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [
        tokenizer(text, add_special_tokens=False)["input_ids"]
        for text in ("Hi", "Count from one to twenty, please:", "The capital of France is")
    ]
    fast = _greedy(tiny_model_dir, prompts, fast_decode=True)
    stock = _greedy(tiny_model_dir, prompts, fast_decode=False)
    assert len(fast) == len(stock) == 4
    for a, b in zip(fast, stock, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
