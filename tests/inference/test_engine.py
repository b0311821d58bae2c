"""The generation engine through its library API: batching must not change what is generated."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from atroposlib.inference.engine import GenerationEngine
from atroposlib.inference.models import load_model
from atroposlib.inference.sampling import SamplingParams


def _generate(
    model_dir: Path, prompts: list[list[int]], **engine_kwargs
) -> tuple[list, dict[str, int]]:
    loaded = load_model(str(model_dir), "float32")

    async def run() -> tuple[list, dict[str, int]]:
        engine = GenerationEngine(loaded.model, loaded.tokenizer, **engine_kwargs).start()
        try:
            params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True)
            # A request in flight keeps the scheduler busy, so the prompts below (submitted
            # within microseconds) are waiting together at its next admission.
            busy = engine.submit(prompts[0], SamplingParams(max_tokens=40, ignore_eos=True))
            await asyncio.sleep(0.05)
            handles = [engine.submit(ids, params) for ids in prompts]
            outs = [out[0] for out in await asyncio.gather(*(h.result() for h in handles))]
            await busy.result()
            return outs, dict(engine.stats)
        finally:
            engine.shutdown()

    return asyncio.run(run())


def test_shared_prompt_prefix_is_computed_once_without_changing_results(
    tiny_model_dir: Path,
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    system = "You are a careful assistant. Answer with one number and nothing else. " * 2
    prompts = [
        tokenizer(system + question, add_special_tokens=False)["input_ids"]
        for question in ("What is 2+2?", "And 17 times 3, please?", "7-9?", "Sum of 1..10")
    ]
    shared, stats = _generate(tiny_model_dir, prompts, min_shared_prefix=4)
    assert stats["shared_prefix_tokens_saved"] > 0
    separate, stats = _generate(tiny_model_dir, prompts, min_shared_prefix=10**9)
    assert stats["shared_prefix_tokens_saved"] == 0
    alone = [_generate(tiny_model_dir, [p])[0][0] for p in prompts]
    for a, b, c in zip(shared, separate, alone, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        for x, y, z in zip(a.logprobs, b.logprobs, c.logprobs, strict=True):
            assert abs(x - z) < 1e-3 and abs(y - z) < 1e-3


def test_prompts_of_very_different_lengths_prefill_in_passes_of_similar_lengths(
    tiny_model_dir: Path,
) -> None:
    """Prompts waiting together whose lengths differ a lot (an evaluation's questions) are
    prefilled in passes of similar lengths instead of one pass padded to the longest: fewer
    padding positions computed, and every output what the prompt generates alone."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = (
        "2+2?",
        "What is 17 times 3?",
        "A farmer has 12 cows and buys 7 more, then sells 4 of them at the market. " * 3,
        "Tom reads 14 pages a day for a week and then 9 pages a day for 5 days. " * 3 + "How?",
    )
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert max(map(len, prompts)) > 4 * min(map(len, prompts))
    split, stats = _generate(tiny_model_dir, prompts, min_shared_prefix=10**9)
    one_pass, one_stats = _generate(
        tiny_model_dir, prompts, min_shared_prefix=10**9, split_prefill_by_length=False
    )
    # the busy request's pass, then the four prompts: two passes of two (short, long)
    assert stats["prefill_passes"] == 3
    longest = max(map(len, prompts))
    one_pass_padding = sum(longest - len(p) for p in prompts)
    assert stats["prefill_padding_tokens"] < one_pass_padding / 4
    alone = [_generate(tiny_model_dir, [p])[0][0] for p in prompts]
    for a, c in zip(split, alone, strict=True):
        assert a.token_ids == c.token_ids
        for x, z in zip(a.logprobs, c.logprobs, strict=True):
            assert abs(x - z) < 1e-3
    # one pass padded to the longest: the same tokens
    assert one_stats["prefill_passes"] == 2
    assert one_stats["prefill_padding_tokens"] >= one_pass_padding
    assert [o.token_ids for o in one_pass] == [o.token_ids for o in split]


@pytest.mark.nightly  # out of per-commit CI (time budget): .ci/nightly runs it
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cc") is None, reason="torch.compile on CPU needs a C compiler")
def test_compiled_decode_matches_eager_and_survives_a_reload(
    tiny_model_dir: Path, tiny_model_dir_b: Path
) -> None:
    loaded = load_model(str(tiny_model_dir), "float32")
    other = load_model(str(tiny_model_dir_b), "float32")
    prompt = loaded.tokenizer("Count: one two three", add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=0, ignore_eos=True)

    async def generate(engine: GenerationEngine) -> list[int]:
        return (await engine.submit(prompt, params).result())[0].token_ids

    async def run() -> None:
        eager = GenerationEngine(loaded.model, loaded.tokenizer).start()
        eager_b = GenerationEngine(other.model, other.tokenizer).start()
        compiled = GenerationEngine(
            load_model(str(tiny_model_dir), "float32").model, loaded.tokenizer, compile=True
        )
        compiled.warmup()
        compiled.start()
        try:
            before, after = await generate(eager), await generate(eager_b)
            assert before != after, "the two checkpoints should generate differently"
            assert await generate(compiled) == before
            info = await asyncio.wrap_future(compiled.request_reload(other.model))
            assert info.weights_version == 1
            assert await generate(compiled) == after
        finally:
            for engine in (eager, eager_b, compiled):
                engine.shutdown()

    asyncio.run(run())


def test_a_replaced_model_is_freed_at_once(tiny_model_dir: Path, tiny_model_dir_b: Path) -> None:
    """Each reload frees the model it replaces, without waiting for Python's cyclic collector
    (which a training run that reloads every step outpaced: the server grew by one model per
    reload). Checked with the collector off, after reloads that generated in between."""
    import gc
    import weakref

    import torch
    from transformers import AutoTokenizer

    from atroposlib.inference.models import load_weights

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True)
    folders = [tiny_model_dir, tiny_model_dir_b, tiny_model_dir, tiny_model_dir_b]

    async def run() -> list[weakref.ref]:
        model = load_weights(str(folders[0]), torch.float32)
        served = [weakref.ref(model)]
        engine = GenerationEngine(model, tokenizer).start()
        del model
        try:
            for folder in folders[1:]:
                await engine.submit([1, 2, 3, 4], params).result()
                model = load_weights(str(folder), torch.float32)
                await asyncio.wrap_future(engine.request_reload(model))
                served.append(weakref.ref(model))
                del model
            await engine.submit([1, 2, 3, 4], params).result()
        finally:
            engine.shutdown()
        return served

    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        served = asyncio.run(run())
        # every model that was replaced is gone by reference counting alone
        assert [ref() is None for ref in served[:-1]] == [True, True, True]
    finally:
        if enabled:
            gc.enable()


def test_a_request_that_fails_to_sample_fails_alone(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever slips past validation and breaks one row, at prefill or at a later decode
    step, fails that request only; the requests batched with it finish normally."""
    from atroposlib.inference import sampling
    from atroposlib.inference.engine import EngineError

    # Values the server refuses (tests/inference/test_hardening.py), let through here.
    monkeypatch.setattr(SamplingParams, "validate", lambda self, *a, **k: None)
    real_penalties = sampling._apply_penalties

    def flaky(scores, row):
        if row.params.presence_penalty == 1.5 and len(row.output_ids) >= 3:
            raise RuntimeError("injected failure at the 4th token")
        real_penalties(scores, row)

    monkeypatch.setattr(sampling, "_apply_penalties", flaky)
    real_generator = SamplingParams.make_generator

    def no_generator(self, index):
        if self.seed == 666:
            raise RuntimeError("injected failure while preparing the rows")
        return real_generator(self, index)

    monkeypatch.setattr(SamplingParams, "make_generator", no_generator)
    loaded = load_model(str(tiny_model_dir), "float32")

    async def run() -> None:
        engine = GenerationEngine(loaded.model, loaded.tokenizer).start()
        try:
            good = SamplingParams(max_tokens=30, n=2, ignore_eos=True, logprobs=1)
            first = engine.submit([1, 2, 3], good)
            await asyncio.sleep(0.05)
            # Admitted together with a good request: prefill is retried one by one.
            bad_at_prefill = engine.submit(
                [4, 5, 6], SamplingParams(max_tokens=8, stop_token_ids=[10**6], min_tokens=2)
            )
            bad_rows = engine.submit([4, 5], SamplingParams(max_tokens=8, seed=666))
            second = engine.submit([4, 5, 6], good, stream=True)
            bad_at_decode = engine.submit(
                [7, 8], SamplingParams(max_tokens=20, n=3, presence_penalty=1.5), stream=True
            )
            with pytest.raises(EngineError, match="for this request: IndexError"):
                await bad_at_prefill.result()
            with pytest.raises(EngineError, match="while preparing the rows"):
                await bad_rows.result()
            events = []
            with pytest.raises(EngineError, match="injected failure"):
                async for event in bad_at_decode.events():
                    events.append(event)
            assert sum(len(e.token_ids) for e in events) <= 3 * 3
            for handle in (first, second):
                outs = await handle.result()
                assert [len(o.token_ids) for o in outs] == [30, 30]
                assert {o.finish_reason for o in outs} == {"length"}
            assert engine.load() == {"running": 0, "waiting": 0} and engine.healthy
            # The engine serves on afterwards.
            assert len((await engine.submit([9], good).result())[0].token_ids) == 30
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_prefix_cache_reuses_a_shared_beginning_across_requests(
    tiny_model_dir: Path, tiny_model_dir_b: Path
) -> None:
    """Requests that arrive one at a time (an evaluation, a GRPO env's groups) share a system
    prompt: the second computes it once more and keeps it, later ones reuse it. Outputs are
    those of the prompt run alone; after a weight swap the kept keys/values are not used."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    system = "You are a calculator. Reply with only the final integer answer. " * 3
    questions = ("What is 2+2?", "What is 17-3?", "What is 7+9?", "What is 10-1?")
    prompts = [tokenizer(system + q, add_special_tokens=False)["input_ids"] for q in questions]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True)

    def one_by_one(
        engine_kwargs: dict,
        swap_to: Path | None = None,
        model_dir: Path = tiny_model_dir,
        reset: bool = False,
    ) -> tuple[list, dict]:
        loaded = load_model(str(model_dir), "float32")

        async def run() -> tuple[list, dict]:
            engine = GenerationEngine(loaded.model, loaded.tokenizer, **engine_kwargs).start()
            try:
                outs = [(await engine.submit(p, params).result())[0] for p in prompts]
                if reset:
                    engine.reset_prefix_cache()
                    hits = engine.stats["prefix_cache_hits"]
                    outs.append((await engine.submit(prompts[0], params).result())[0])
                    assert engine.stats["prefix_cache_hits"] == hits  # recomputed
                    assert len(engine.prefix_cache) == 1  # and kept again
                if swap_to is not None:
                    other = load_model(str(swap_to), "float32").model
                    await asyncio.wrap_future(engine.request_reload(other))
                    assert len(engine.prefix_cache) == 0
                    outs += [(await engine.submit(p, params).result())[0] for p in prompts]
                return outs, dict(engine.stats)
            finally:
                engine.shutdown()

        return asyncio.run(run())

    cached, stats = one_by_one({}, reset=True)
    assert cached[-1].token_ids == cached[0].token_ids
    cached = cached[: len(prompts)]
    # the 1st prompt is only remembered, the 2nd computes the shared part and keeps it
    assert stats["prefix_cache_hits"] == len(prompts) - 2
    assert stats["prefix_cache_tokens_reused"] >= (len(prompts) - 2) * 16
    plain, stats = one_by_one({"prefix_cache_entries": 0})
    assert stats["prefix_cache_hits"] == 0
    for a, b in zip(cached, plain, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(x - y) < 1e-4

    swapped, stats = one_by_one({}, swap_to=tiny_model_dir_b)
    # after the swap: the 1st prompt recomputes (the cache was emptied), the rest reuse again
    assert stats["prefix_cache_hits"] == (len(prompts) - 2) + (len(prompts) - 1)
    alone_b, _ = one_by_one({"prefix_cache_entries": 0}, model_dir=tiny_model_dir_b)
    for a, b in zip(swapped[len(prompts) :], alone_b, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(x - y) < 1e-3
