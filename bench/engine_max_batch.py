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
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_contention import alternate, serving_dtype  # noqa: E402

from atroposlib.inference.engine import GenerationEngine  # noqa: E402
from atroposlib.inference.models import load_model  # noqa: E402
from atroposlib.inference.sampling import SamplingParams  # noqa: E402
from atroposlib.utils.memory import pin_mmap_threshold, use_heap_for_temporaries  # noqa: E402

SUFFIX = "\n\nSolve it step by step. Write the final answer as \\boxed{N}."


def gsm8k_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:  # noqa: ANN001
    """``count`` GSM8K train questions as gsm8k-format prompts them (no system turn, the
    format instruction after the question), as token ids."""
    from environments.gsm8k_server import BUNDLED_GSM8K, load_rows

    rows = load_rows(BUNDLED_GSM8K, "train")
    rng = random.Random(seed)
    prompts = []
    for row in rng.sample(rows, count):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["question"] + SUFFIX}],
            add_generation_prompt=True,
            tokenize=True,
        )
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return prompts


async def run_round(
    engine: GenerationEngine,
    prompts: list[list[int]],
    in_flight: int,
    temperature: float,
    tokens: list[int],
) -> float:
    """One group of 16 replies (at most 128 tokens) per prompt, ``in_flight`` at a time:
    groups/s; the tokens generated are appended to ``tokens``."""
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
    tokens.append(generated)
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
    pin_mmap_threshold()
    torch.set_num_threads(1)
    loaded = load_model(args.model, args.dtype)
    engine = GenerationEngine(
        loaded.model,
        loaded.tokenizer,
        max_batch=max(settings.values()),
        threads=args.threads,
        logprobs_mode="processed_logprobs",
    )
    engine.warmup()
    engine.start()
    use_heap_for_temporaries()
    prompts = gsm8k_prompts(loaded.tokenizer, args.groups)
    tokens: list[int] = []
    print(f"dtype {args.dtype}, {args.groups} groups of 16 per round, {args.in_flight} in flight")
    rates, _ = alternate(
        engine,
        "max_batch",
        settings,
        lambda: asyncio.run(run_round(engine, prompts, args.in_flight, args.temperature, tokens)),
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
