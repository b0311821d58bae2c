"""Prefill in passes of similar prompt lengths, or one pass padded to the longest, on an evaluation.

The load is the gsm8k-format recipe's held-out evaluation as ``gsm8k_server.py evaluate``
sends it: the first ``--items`` GSM8K test questions (74-186 tokens with the recipe's
instruction), greedy, at most 128 tokens each, ``--concurrency`` requests in flight (the env's
``max_eval_workers``). One engine, set up as ``atropos-serve`` runs it, switches
``split_prefill_by_length`` between rounds (alternating which goes first; a warm-up round of
each first, not counted) and prints items/s, the prefill passes and the padding positions
they computed, per setting.

    python bench/engine_prefill_split.py --rounds 2 --items 64
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "environments"))

from engine_contention import alternate, serving_dtype, start_engine  # noqa: E402
from gsm8k_server import BUNDLED_GSM8K, load_rows  # noqa: E402

from atroposlib.inference.engine import GenerationEngine  # noqa: E402
from atroposlib.inference.sampling import SamplingParams  # noqa: E402
from example_trainer.recipes import GSM8K_FORMAT_INSTRUCTION  # noqa: E402


def gsm8k_prompts(
    tokenizer,  # noqa: ANN001
    count: int,
    split: str = "test",
    seed: int | None = None,
) -> list[list[int]]:
    """``count`` GSM8K questions of ``split`` as the gsm8k-format recipe prompts them (no
    system turn, the question, the format instruction), as token ids: the first ``count``
    (the evaluation's), or with ``seed`` a random sample."""
    rows = load_rows(BUNDLED_GSM8K, split)
    rows = rows[:count] if seed is None else random.Random(seed).sample(rows, count)
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": row["question"] + GSM8K_FORMAT_INSTRUCTION}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
        for row in rows
    ]


async def run_round(engine: GenerationEngine, prompts: list[list[int]], concurrency: int) -> float:
    """Every prompt once, ``concurrency`` at a time; returns items/s."""
    params = SamplingParams(max_tokens=128, temperature=0.0)
    gate = asyncio.Semaphore(concurrency)

    async def one(ids: list[int]) -> None:
        async with gate:
            await engine.submit(ids, params).result()

    started = time.perf_counter()
    await asyncio.gather(*(one(ids) for ids in prompts))
    return len(prompts) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 with bf16 units")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--items", type=int, default=64, help="test questions per round")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    parser.add_argument("--rounds", type=int, default=2, help="counted rounds of each setting")
    args = parser.parse_args()

    dtype = serving_dtype(args.dtype, args.threads)
    engine = start_engine(args.model, dtype, args.threads)
    prompts = gsm8k_prompts(engine.tokenizer, args.items)
    lengths = sorted(map(len, prompts))
    print(f"{dtype}; {len(prompts)} prompts of {lengths[0]}-{lengths[-1]} tokens", flush=True)

    settings = {"passes of similar lengths": True, "one pass, padded": False}

    rates, grew = alternate(
        engine,
        "split_prefill_by_length",
        settings,
        lambda: asyncio.run(run_round(engine, prompts, args.concurrency)),
        args.rounds,
        ("prefill_passes", "prefill_padding_tokens"),
        "items/s",
    )
    passes = {name: grew[name]["prefill_passes"] for name in settings}
    padding = {name: grew[name]["prefill_padding_tokens"] for name in settings}
    engine.shutdown()
    print()
    real = sum(lengths) * args.rounds
    for name in settings:
        print(
            f"{name}: median {statistics.median(rates[name]):.3f} items/s; "
            f"{passes[name]} prefill passes, {padding[name]} padding positions "
            f"({100 * padding[name] / (padding[name] + real):.0f}% of those computed)"
        )
    split, single = (statistics.median(r) for r in rates.values())
    print(f"passes of similar lengths / one pass: {split / single:.2f}x")


if __name__ == "__main__":
    main()
