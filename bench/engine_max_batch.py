"""The engine's rows per batch (``--max-concurrency``) on gsm8k-format's training load.

gsm8k-format's env keeps several GRPO groups in flight (16 sampled replies of up to 128 tokens
to a GSM8K question with the recipe's format instruction; ``--temperature`` is 0.3 by default,
the recipe samples at 0.4). The engine decodes at most ``max_batch`` rows together, so with 64
(atropos-serve's default) four groups decode while the others wait. This bench runs one engine on that load in rounds, switching its
``max_batch`` between rounds (alternating which goes first, after a warm-up round of each),
and prints groups/s and generated tokens/s for each setting.

    python bench/engine_max_batch.py --rounds 2 --groups 16 --settings 64,128
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "environments"))

from engine_contention import alternate, serving_dtype, start_engine  # noqa: E402
from engine_prefill_split import gsm8k_prompts  # noqa: E402

from atroposlib.inference.engine import GenerationEngine  # noqa: E402
from atroposlib.inference.sampling import SamplingParams  # noqa: E402


async def run_round(
    engine: GenerationEngine,
    prompts: list[list[int]],
    in_flight: int,
    temperature: float,
) -> float:
    """One group of 16 replies (at most 128 tokens) per prompt, ``in_flight`` at a time:
    groups/s (printed with the tokens generated per second)."""
    gate = asyncio.Semaphore(in_flight)
    generated = 0

    async def group(ids: list[int]) -> None:
        nonlocal generated
        async with gate:
            params = SamplingParams(max_tokens=128, n=16, temperature=temperature, logprobs=0)
            outputs = await engine.submit(ids, params).result()
            generated += sum(len(sample.token_ids) for sample in outputs)

    started = time.perf_counter()
    await asyncio.gather(*(group(p) for p in prompts))
    seconds = time.perf_counter() - started
    print(f"  {generated} tokens in {seconds:.1f} s: {generated / seconds:.0f} tokens/s", end="; ")
    return len(prompts) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto", help="auto: as atropos-quickstart serves")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--groups", type=int, default=16, help="groups per round")
    parser.add_argument("--in-flight", type=int, default=8, help="groups generating at once")
    parser.add_argument("--temperature", type=float, default=0.3)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each setting")
    parser.add_argument("--settings", default="64,128", help="max_batch values, comma-separated")
    args = parser.parse_args()

    args.dtype = serving_dtype(args.dtype, args.threads)
    settings = {f"max_batch {int(s)}": int(s) for s in args.settings.split(",")}
    engine = start_engine(
        args.model,
        args.dtype,
        args.threads,
        max_batch=max(settings.values()),
        logprobs_mode="processed_logprobs",
    )
    # train questions, drawn at random as the env draws them
    prompts = gsm8k_prompts(engine.tokenizer, args.groups, split="train", seed=0)
    print(f"dtype {args.dtype}, {args.groups} groups of 16 per round, {args.in_flight} in flight")
    rates, _ = alternate(
        engine,
        "max_batch",
        settings,
        lambda: asyncio.run(run_round(engine, prompts, args.in_flight, args.temperature)),
        args.rounds,
        (),
        "groups/s",
    )
    engine.shutdown()
    print()
    for name, values in rates.items():
        print(f"{name}: median {statistics.median(values):.3f} groups/s")
    first, *others = (statistics.median(v) for v in rates.values())
    for name, rate in zip(list(rates)[1:], others, strict=True):
        print(f"{name} / {list(rates)[0]}: {rate / first:.2f}x")


if __name__ == "__main__":
    main()
