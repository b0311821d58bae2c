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

from engine_contention import alternate, recipe_setup, run_round


def main() -> None:
    args, engine, prompts = recipe_setup(__doc__.split("\n\n")[0], groups=48, rounds=3)
    # One engine, its layout switched between rounds (a batch picks its layout when it starts,
    # and each round drains the batch): two engines in one process would each keep an OpenMP
    # pool, more threads than cores, which slows every step (see GenerationEngine).
    layouts = {"prompt once per request": True, "prompt once per row": False}

    results, grew = alternate(
        engine,
        "share_prompt_kv",
        layouts,
        lambda: asyncio.run(run_round(engine, prompts, args.in_flight)),
        args.rounds,
        ("grouped_steps", "steps"),
        "groups/s",
    )
    engine.shutdown()
    print()
    for name in layouts:
        print(
            f"{name}: median {statistics.median(results[name]):.2f} groups/s "
            f"({grew[name]['grouped_steps']} of {grew[name]['steps']} decode steps grouped)"
        )
    shared, per_row = (statistics.median(r) for r in results.values())
    print(f"once per request / once per row: {shared / per_row:.2f}x")


if __name__ == "__main__":
    main()
