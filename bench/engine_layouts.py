"""The engine's two batch layouts on arithmetic-learn's load: prompts once per request or per row.

Requests with several samples (GRPO groups) run in a layout that keeps each request's prompt
keys and values once (``share_prompt_kv``, the default; ``GroupedBatch``); the other layout
keeps them once per row. This bench loads the model twice in one process, one engine per
layout, and runs the recipe's load on each in alternating rounds (groups of 16 replies of at
most 6 tokens to the env's ~100-token few-shot chat prompts, ``--in-flight`` groups at a time),
then prints groups/s per layout and the decode steps each ran in the grouped layout.

    python bench/engine_layouts.py --rounds 3 --groups 48
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

import torch
from engine_contention import recipe_prompts, run_round

from atroposlib.inference.engine import GenerationEngine
from atroposlib.inference.models import load_model
from atroposlib.utils.memory import pin_mmap_threshold, use_heap_for_temporaries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--groups", type=int, default=48, help="groups per round")
    parser.add_argument("--in-flight", type=int, default=8, help="groups generating at once")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each layout")
    args = parser.parse_args()

    pin_mmap_threshold()
    torch.set_num_threads(1)
    engines = {}
    for name, share in (("prompt once per request", True), ("prompt once per row", False)):
        loaded = load_model(args.model, args.dtype)
        engine = GenerationEngine(
            loaded.model, loaded.tokenizer, max_batch=256, threads=args.threads,
            logprobs_mode="processed_logprobs", share_prompt_kv=share,
        )  # fmt: skip
        engine.warmup()
        engines[name] = engine.start()
    use_heap_for_temporaries()
    prompts = recipe_prompts(next(iter(engines.values())).tokenizer, args.groups)
    for engine in engines.values():  # warm-up round, not counted
        asyncio.run(run_round(engine, prompts, args.in_flight))
    results: dict[str, list[float]] = {name: [] for name in engines}
    for round_index in range(args.rounds):
        order = list(engines) if round_index % 2 == 0 else list(reversed(engines))
        for name in order:
            rate = asyncio.run(run_round(engines[name], prompts, args.in_flight))
            results[name].append(rate)
            print(f"{name}: {rate:.2f} groups/s", flush=True)
    print()
    for name, engine in engines.items():
        stats = engine.stats
        print(
            f"{name}: median {statistics.median(results[name]):.2f} groups/s "
            f"({stats['grouped_steps']} of {stats['steps']} decode steps grouped)"
        )
        engine.shutdown()
    shared, per_row = (statistics.median(r) for r in results.values())
    print(f"once per request / once per row: {shared / per_row:.2f}x")


if __name__ == "__main__":
    main()
