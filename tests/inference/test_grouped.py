"""The lean decode step over a batch that stores each request's prompt once
(:class:`~atroposlib.inference.fastpath.GroupedBatch`) must compute what the per-row cache
computes, through requests joining mid-flight, rows finishing and the buffers growing; the
engine must use it for requests with several samples and generate the same tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from atroposlib.inference import fastpath
from atroposlib.inference.engine import GROUPED_MIN_SAMPLES, GenerationEngine
from atroposlib.inference.fastpath.attention import (
    append_cache,
    select_rows,
    stacked_append_cache,
)
from atroposlib.inference.fastpath.grouped import OWN_HEADROOM, GroupedBatch
from atroposlib.inference.fastpath.packed_linear import packing_supported
from atroposlib.inference.models import load_model
from atroposlib.inference.sampling import SamplingParams
from atroposlib.utils.kv_cache import cache_kwargs, output_cache

pytestmark = pytest.mark.skipif(
    not packing_supported(torch.float32), reason="oneDNN is not available"
)


def _prefill(model, ids: torch.Tensor, mask: torch.Tensor):
    """The prompts' keys and values per layer, as the engine's prefill leaves them."""
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=(mask.cumsum(dim=1) - 1).clamp(min=0),
        **cache_kwargs(model, append_cache()),
        use_cache=True,
        logits_to_keep=1,
    )
    return [(x.keys, x.values) for x in output_cache(out).layers]


class _PerRow:
    """The same rows in the per-row layout the lean step decodes today (the reference)."""

    def __init__(self, prepared, layers, mask: torch.Tensor, samples: list[int]) -> None:
        index = torch.repeat_interleave(torch.arange(len(samples)), torch.tensor(samples))
        self.prepared = prepared
        self.cache = prepared.batch_cache([(k[index], v[index]) for k, v in layers])
        self.mask = mask[index]

    def merge(self, other: _PerRow) -> None:
        width = max(self.mask.shape[1], other.mask.shape[1])
        parts = [[(x.keys, x.values) for x in c.layers] for c in (self.cache, other.cache)]
        self.cache = stacked_append_cache(parts, width)
        self.mask = torch.cat(
            [
                torch.nn.functional.pad(self.mask, (width - self.mask.shape[1], 0)),
                torch.nn.functional.pad(other.mask, (width - other.mask.shape[1], 0)),
            ]
        )

    def keep(self, index: torch.Tensor) -> None:
        select_rows(self.cache, index, 0)
        self.mask = self.mask[index]

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(tokens), 1))], dim=1)
        positions = self.mask.sum(dim=1, keepdim=True) - 1
        return self.prepared.decode(tokens, self.mask, positions, self.cache)


def _prompts(vocab: int, lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), width), generator=gen)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
    return ids, mask


def test_grouped_steps_equal_the_per_row_cache(tiny_model_dir: Path) -> None:
    """Float32: the same logits (to float rounding) at every step, with requests of different
    prompt lengths and sample counts, a second set joining mid-flight, rows finishing (and a
    request's last row, so its prompt is dropped) and more steps than the spare positions."""
    model = load_model(str(tiny_model_dir), "float32").model
    prepared = fastpath.prepare(model)
    assert prepared.grouped
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        ids, mask = _prompts(vocab, [9, 4, 7], seed=0)
        layers = _prefill(model, ids, mask)
        grouped = GroupedBatch.from_prefill(layers, mask, [3, 1, 4])
        reference = _PerRow(prepared, layers, mask, [3, 1, 4])
        rows = 8
        for step in range(OWN_HEADROOM + 6):
            tokens = torch.randint(0, vocab, (rows, 1), generator=gen)
            want = reference.decode(tokens)
            got = prepared.decode_grouped(tokens, grouped)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
            if step == 2:  # two requests join: one with a longer prompt than any so far
                ids, mask = _prompts(vocab, [12, 5], seed=2)
                layers = _prefill(model, ids, mask)
                grouped.merge(GroupedBatch.from_prefill(layers, mask, [2, 5]))
                reference.merge(_PerRow(prepared, layers, mask, [2, 5]))
                rows += 7
            if step == 5:  # rows finish, among them request 1's only row
                keep = torch.tensor([0, 2, 5, 7, 8, 10, 11, 14])
                grouped.keep(keep)
                reference.keep(keep)
                rows = len(keep)
                assert grouped.prompt_mask.shape[0] == 4  # request 1's prompt is gone
            if step == 9:
                ids, mask = _prompts(vocab, [3], seed=3)
                layers = _prefill(model, ids, mask)
                grouped.merge(GroupedBatch.from_prefill(layers, mask, [2]))
                reference.merge(_PerRow(prepared, layers, mask, [2]))
                rows += 2
                assert grouped.prompt_mask.shape[0] == 5
        assert torch.equal(grouped.positions(), reference.mask.sum(dim=1, keepdim=True))


def test_to_padded_is_the_per_row_layout(tiny_model_dir: Path) -> None:
    """The conversion the engine falls back on: the model's own forward pass over
    :meth:`GroupedBatch.to_padded` continues exactly where the grouped steps were."""
    model = load_model(str(tiny_model_dir), "float32").model
    prepared = fastpath.prepare(model)
    vocab = model.config.vocab_size
    with torch.inference_mode():
        ids, mask = _prompts(vocab, [6, 10], seed=4)
        layers = _prefill(model, ids, mask)
        grouped = GroupedBatch.from_prefill(layers, mask, [2, 3])
        reference = _PerRow(prepared, layers, mask, [2, 3])
        tokens = torch.randint(0, vocab, (5, 1), generator=torch.Generator().manual_seed(0))
        for _ in range(3):
            prepared.decode_grouped(tokens, grouped)
            reference.decode(tokens)
        padded, padded_mask = grouped.to_padded(torch.float32)
        assert torch.equal(padded_mask, reference.mask)
        cache = prepared.batch_cache(padded)
        padded_mask = torch.cat([padded_mask, padded_mask.new_ones((5, 1))], dim=1)
        out = model(
            input_ids=tokens,
            attention_mask=padded_mask,
            position_ids=padded_mask.sum(dim=1, keepdim=True) - 1,
            **cache_kwargs(model, cache),
            use_cache=True,
            logits_to_keep=1,
        )
        torch.testing.assert_close(
            out.logits[:, -1, :], reference.decode(tokens), rtol=0, atol=1e-4
        )


def test_bfloat16_grouped_steps_are_as_close_to_float32_as_the_per_row_cache(
    tiny_model_dir: Path,
) -> None:
    """In bfloat16 neither layout is exact; the grouped one (float32 attention) must be as
    close to the float32 model as the per-row one: same mean log-prob error within 20%.

    On a CPU without bfloat16 packed kernels (AVX2 only) the lean step, and so the grouped
    layout, does not run in bfloat16: there the engine must keep the per-row layout for
    requests of many samples and generate what the per-row engine does."""
    if not packing_supported(torch.bfloat16):
        prompts = [[1, 504, 3458, 282], [1, 9, 8, 7, 6, 5, 4, 3, 2, 200, 300]]
        outputs, engines = [], []
        for share in (True, False):
            model = load_model(str(tiny_model_dir), "float32")
            engine = GenerationEngine(
                model.model.to(torch.bfloat16), model.tokenizer, share_prompt_kv=share
            )
            outputs.append(_run(engine, prompts, GROUPED_MIN_SAMPLES * 2))
            engines.append(engine)
        assert engines[0].stats["grouped_steps"] == 0
        assert engines[0].stats["generated_tokens"] > 0
        for got_request, want_request in zip(*outputs, strict=True):
            for (got_ids, got_lp), (want_ids, want_lp) in zip(
                got_request, want_request, strict=True
            ):
                assert got_ids == want_ids
                assert got_lp == pytest.approx(want_lp, abs=0.05)  # bfloat16 batches differ
        return
    ref_model = load_model(str(tiny_model_dir), "float32").model
    bf16_model = load_model(str(tiny_model_dir), "float32").model.to(torch.bfloat16)
    ref, bf16 = fastpath.prepare(ref_model), fastpath.prepare(bf16_model)
    vocab = ref_model.config.vocab_size
    ids, mask = _prompts(vocab, [20, 14, 17, 9], seed=5)
    samples = [4, 4, 4, 4]
    steps = torch.randint(0, vocab, (6, 16, 1), generator=torch.Generator().manual_seed(1))
    errors = {}
    with torch.inference_mode():
        truth_rows = _PerRow(ref, _prefill(ref_model, ids, mask), mask, samples)
        truth = torch.stack([truth_rows.decode(t) for t in steps]).log_softmax(-1)
        layers = _prefill(bf16_model, ids, mask)
        per_row = _PerRow(bf16, layers, mask, samples)
        grouped = GroupedBatch.from_prefill(layers, mask, samples)
        for name, step in (
            ("per_row", per_row.decode),
            ("grouped", lambda t: bf16.decode_grouped(t, grouped)),
        ):
            got = torch.stack([step(t) for t in steps]).float().log_softmax(-1)
            errors[name] = float((got - truth).abs().mean())
    assert errors["grouped"] <= 1.2 * errors["per_row"], errors


def _run(engine: GenerationEngine, prompts: list[list[int]], n: int) -> list[list[list[int]]]:
    async def go() -> list[list[list[int]]]:
        params = SamplingParams(max_tokens=10, n=n, temperature=0.0, ignore_eos=True, logprobs=0)
        # A request in flight first, so the others join a running batch.
        busy = engine.submit(prompts[0], params)
        await asyncio.sleep(0.05)
        handles = [engine.submit(p, params) for p in prompts]
        outs = [await h.result() for h in [busy, *handles]]
        return [[(s.token_ids, s.logprobs) for s in out] for out in outs]

    engine.start()
    try:
        return asyncio.run(go())
    finally:
        engine.shutdown()


@pytest.mark.parametrize("n", [1, GROUPED_MIN_SAMPLES * 2])
def test_engine_generates_the_same_with_prompts_stored_once(tiny_model_dir: Path, n: int) -> None:
    """Requests with several samples run in the grouped layout, requests with one sample in
    the per-row one; either way the greedy tokens and log-probs are the per-row engine's."""
    prompts = [[1, 504, 3458, 282], [1, 9, 8, 7, 6, 5, 4, 3, 2, 200, 300], [1, 77]]
    loaded = load_model(str(tiny_model_dir), "float32")
    grouped = GenerationEngine(loaded.model, loaded.tokenizer)
    got = _run(grouped, prompts, n)
    plain = load_model(str(tiny_model_dir), "float32")
    per_row = GenerationEngine(plain.model, plain.tokenizer, share_prompt_kv=False)
    want = _run(per_row, prompts, n)
    assert (grouped.stats["grouped_steps"] > 0) == (n >= GROUPED_MIN_SAMPLES)
    assert per_row.stats["grouped_steps"] == 0
    for got_request, want_request in zip(got, want, strict=True):
        for (got_ids, got_lp), (want_ids, want_lp) in zip(got_request, want_request, strict=True):
            assert got_ids == want_ids
            assert got_lp == pytest.approx(want_lp, abs=1e-4)


@pytest.mark.slow
def test_engine_layouts_bench_runs() -> None:
    """``bench/engine_layouts.py`` at toy size: both layouts run the recipe's load and the
    default one decodes in the grouped layout."""
    import subprocess
    import sys

    bench = Path(__file__).resolve().parents[2] / "bench" / "engine_layouts.py"
    done = subprocess.run(
        # float32: the lean step (and so the grouped layout) runs in it on every CPU; bfloat16
        # only where oneDNN packs it (CPUs with bfloat16 units)
        [sys.executable, str(bench), "--groups", "2", "--in-flight", "2", "--rounds", "1"]
        + ["--dtype", "float32"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    lines = {line.split(":")[0]: line for line in done.stdout.splitlines() if "median" in line}
    assert set(lines) == {"prompt once per request", "prompt once per row"}, done.stdout
    assert "(0 of " not in lines["prompt once per request"]
    assert "(0 of " in lines["prompt once per row"]
    assert "x" in done.stdout.splitlines()[-1]


def test_long_replies_take_the_flash_kernel_with_the_same_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows' generated keys in bfloat16 beyond ``MANUAL_MAX_POSITIONS`` go through PyTorch's
    flash kernel; its normalised output and log-sum-exp must be the float32 multiplies' (to
    bfloat16 rounding of the output), masked positions included."""
    from atroposlib.inference.fastpath import grouped

    gen = torch.Generator().manual_seed(0)
    rows, kv_heads, per_kv, dim, width = 8, 3, 3, 64, 40
    native = torch.randn(rows, kv_heads, per_kv, dim, generator=gen).to(torch.bfloat16)
    keys = torch.randn(rows, kv_heads, width, dim, generator=gen).to(torch.bfloat16)
    values = torch.randn(rows, kv_heads, width, dim, generator=gen).to(torch.bfloat16)
    bias = torch.zeros(rows, 1, 1, width)
    bias[::3, ..., :5] = float("-inf")  # left padding of some rows
    query = native.float() * 0.125
    out, top, total = grouped._part(query, keys.float(), values.float(), bias)
    monkeypatch.setattr(grouped, "MANUAL_MAX_POSITIONS", 0)
    flash_out, flash_top, flash_total = grouped._own_part(query, native, keys, values, bias, 0.125)
    torch.testing.assert_close(flash_out / flash_total, out / total, rtol=0, atol=1e-2)
    torch.testing.assert_close(flash_top + flash_total.log(), top + total.log(), rtol=0, atol=1e-3)
