"""The engine's two batch layouts on arithmetic-learn's load: prompts once per request or per row.

Requests with several samples (GRPO groups) run in a layout that keeps each request's prompt
keys and values once (``share_prompt_kv``, the default; ``GroupedBatch``); the other layout
keeps them once per row. This bench runs one engine on the recipe's load in rounds, switching
its layout between rounds (alternating which goes first) (groups of 16 replies of at
most 6 tokens to the env's ~100-token few-shot chat prompts, ``--in-flight`` groups at a time),
then prints groups/s per layout and the decode steps each ran in the grouped layout.

    python bench/engine_layouts.py --rounds 3 --groups 48
"""

from __future__ import annotations

import asyncio
import statistics

from engine_contention import recipe_setup, run_round


def main() -> None:
    args, engine, prompts = recipe_setup(__doc__.split("\n\n")[0], groups=48, rounds=3)
    # One engine, its layout switched between rounds (a batch picks its layout when it starts,
    # and each round drains the batch): two engines in one process would each keep an OpenMP
    # pool, more threads than cores, which slows every step (see GenerationEngine).
    layouts = {"prompt once per request": True, "prompt once per row": False}
    results: dict[str, list[float]] = {name: [] for name in layouts}
    grouped_steps = dict.fromkeys(layouts, 0)
    steps = dict.fromkeys(layouts, 0)
    for round_index in range(args.rounds + 1):
        order = list(layouts) if round_index % 2 == 0 else list(reversed(layouts))
        for name in order:
            engine.share_prompt_kv = layouts[name]
            before = dict(engine.stats)
            rate = asyncio.run(run_round(engine, prompts, args.in_flight))
            if round_index == 0:
                continue  # warm-up round, not counted
            results[name].append(rate)
            grouped_steps[name] += engine.stats["grouped_steps"] - before["grouped_steps"]
            steps[name] += engine.stats["steps"] - before["steps"]
            print(f"{name}: {rate:.2f} groups/s", flush=True)
    engine.shutdown()
    print()
    for name in layouts:
        print(
            f"{name}: median {statistics.median(results[name]):.2f} groups/s "
            f"({grouped_steps[name]} of {steps[name]} decode steps grouped)"
        )
    shared, per_row = (statistics.median(r) for r in results.values())
    print(f"once per request / once per row: {shared / per_row:.2f}x")


if __name__ == "__main__":
    main()
