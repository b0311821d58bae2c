"""What another busy process costs atropos-serve's engine on 2 cores.

The engine runs its model with one OpenMP thread per core. When another process keeps one
core busy, every parallel region waits for the thread that has no core, and throughput falls
by far more than half. This bench runs the engine in-process on arithmetic-learn's load (GRPO
groups of 16 replies of at most 6 tokens to the env's ~100-token few-shot chat prompts,
``--in-flight`` groups at a time) in rounds, alone and with a single-threaded busy loop in a
second process, alternated, and prints groups/s of each.

    python bench/engine_contention.py --rounds 2 --groups 24

It is why the trainer pauses the server as soon as its batch arrives (before laying it out),
and why nothing else in the loop should compute while the server generates.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "environments"))

from arithmetic_server import chat_messages, make_problem  # noqa: E402

from atroposlib.inference.engine import GenerationEngine  # noqa: E402
from atroposlib.inference.models import load_model  # noqa: E402
from atroposlib.inference.sampling import SamplingParams  # noqa: E402
from atroposlib.trainer.throughput import BF16_SPEEDUP_FOR_MIXED, bf16_speedup  # noqa: E402
from atroposlib.utils.memory import pin_mmap_threshold, use_heap_for_temporaries  # noqa: E402


def _busy(stop: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    while not stop.is_set():
        for _ in range(100_000):
            pass


def recipe_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:  # noqa: ANN001
    """``count`` of arithmetic-learn's chat prompts (system prompt, 3 worked examples, a
    question), as token ids."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        question = make_problem(rng, 20, "+-")["question"]
        ids = tokenizer.apply_chat_template(
            chat_messages(question, few_shot=3), add_generation_prompt=True, tokenize=True
        )
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return prompts


async def run_round(engine: GenerationEngine, prompts: list[list[int]], in_flight: int) -> float:
    """One GRPO group (16 replies of at most 6 tokens) per prompt, ``in_flight`` at a time:
    groups/s."""
    gate = asyncio.Semaphore(in_flight)

    async def group(ids: list[int]) -> None:
        async with gate:
            params = SamplingParams(max_tokens=6, n=16, temperature=1.0, logprobs=0)
            await engine.submit(ids, params).result()

    started = time.perf_counter()
    await asyncio.gather(*(group(p) for p in prompts))
    return len(prompts) / (time.perf_counter() - started)


def serving_dtype(dtype: str, threads: int) -> str:
    """``dtype`` with ``auto`` resolved as atropos-quickstart serves: bfloat16 where the CPU
    has bfloat16 units (its products measured at least 1.5x as fast as float32 ones), else
    float32."""
    if dtype != "auto":
        return dtype
    speedup = bf16_speedup("cpu", threads)
    return "bfloat16" if speedup >= BF16_SPEEDUP_FOR_MIXED else "float32"


def alternate(
    engine: GenerationEngine,
    attribute: str | Callable[[Any], None],
    settings: Mapping[str, Any],
    run: Callable[[], float],
    rounds: int,
    counted: Sequence[str],
    unit: str,
) -> tuple[dict[str, list[float]], dict[str, dict[str, int]]]:
    """``run()`` (a rate) once per setting per round with the engine's ``attribute`` set to
    ``settings[name]`` (or ``attribute(settings[name])`` called, for a setting that is not an
    engine attribute), alternating which setting goes first, after a warm-up round of each
    (not counted); prints each rate in ``unit``. Returns per setting its rates and how much
    each of the engine's ``counted`` stats grew in its counted rounds."""
    rates: dict[str, list[float]] = {name: [] for name in settings}
    grew = {name: dict.fromkeys(counted, 0) for name in settings}
    for round_index in range(rounds + 1):
        order = list(settings) if round_index % 2 == 0 else list(reversed(settings))
        for name in order:
            if callable(attribute):
                attribute(settings[name])
            else:
                setattr(engine, attribute, settings[name])
            before = dict(engine.stats)
            rate = run()
            if round_index == 0:
                continue  # warm-up round, not counted
            rates[name].append(rate)
            for key in counted:
                grew[name][key] += engine.stats[key] - before[key]
            print(f"{name}: {rate:.3f} {unit}", flush=True)
    return rates, grew


def recipe_setup(
    description: str, groups: int, rounds: int
) -> tuple[argparse.Namespace, GenerationEngine, list[list[int]]]:
    """Parse the recipe-load benches' shared flags and start an engine the way atropos-serve
    runs it (one thread per core, heap temporaries): ``(args, engine, prompts)``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto: bfloat16 where the CPU has bfloat16 units, as "
        "atropos-quickstart serves, else float32",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--groups", type=int, default=groups, help="groups per round")
    parser.add_argument("--in-flight", type=int, default=8, help="groups generating at once")
    parser.add_argument("--rounds", type=int, default=rounds, help="rounds of each condition")
    args = parser.parse_args()

    args.dtype = serving_dtype(args.dtype, args.threads)
    engine = start_engine(
        args.model, args.dtype, args.threads, max_batch=256, logprobs_mode="processed_logprobs"
    )
    return args, engine, recipe_prompts(engine.tokenizer, args.groups)


def start_engine(model: str, dtype: str, threads: int, **options: Any) -> GenerationEngine:
    """A started, warmed-up engine for ``model`` set up the way atropos-serve runs it: mmap
    threshold pinned, the caller's thread single-threaded, ``threads`` engine threads, heap
    temporaries. ``options`` go to :class:`GenerationEngine` (``max_batch``, ...)."""
    pin_mmap_threshold()
    torch.set_num_threads(1)
    loaded = load_model(model, dtype)
    engine = GenerationEngine(loaded.model, loaded.tokenizer, threads=threads, **options)
    engine.warmup()
    engine.start()
    use_heap_for_temporaries()
    return engine


def main() -> None:
    args, engine, prompts = recipe_setup(__doc__.split("\n\n")[0], groups=24, rounds=2)

    results: dict[str, list[float]] = {"alone": [], "beside a busy process": []}
    asyncio.run(run_round(engine, prompts, args.in_flight))  # warm-up round, not counted
    for _ in range(args.rounds):
        for condition in results:
            stop = multiprocessing.Event()
            busy = None
            if condition != "alone":
                busy = multiprocessing.Process(target=_busy, args=(stop,), daemon=True)
                busy.start()
                time.sleep(0.5)
            try:
                rate = asyncio.run(run_round(engine, prompts, args.in_flight))
            finally:
                stop.set()
                if busy is not None:
                    busy.join()
            results[condition].append(rate)
            print(f"{condition}: {rate:.2f} groups/s", flush=True)
    engine.shutdown()
    alone = statistics.median(results["alone"])
    beside = statistics.median(results["beside a busy process"])
    print(
        f"\nmedian groups/s: alone {alone:.2f}, beside a busy process {beside:.2f} "
        f"({alone / beside:.1f}x slower; {args.threads} engine threads, "
        f"{torch.get_num_threads()} caller thread)"
    )


if __name__ == "__main__":
    main()
