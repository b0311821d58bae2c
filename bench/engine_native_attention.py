"""The lean decode step's attention: the C kernel (``fastpath.native``) or PyTorch's.

One engine, set up as ``atropos-serve`` runs it, switches its lean step's attention between
rounds (alternating which goes first, after a warm-up round of each, not counted) on the
gsm8k-format recipe's two loads:

* ``evaluation``: the first ``--items`` GSM8K test questions as ``gsm8k_server.py evaluate``
  sends them (greedy, at most 128 tokens, ``--concurrency`` in flight): the per-row layout;
* ``training``: ``--groups`` GRPO groups of 16 replies (at most 128 tokens, temperature 0.4)
  to GSM8K train questions, 8 in flight: prompts stored once per request (the C kernel takes
  each row's prompt and own tokens in one call; PyTorch's path is a matrix product per
  request for the prompt, the rows' own tokens apart, joined in Python).

It prints items/s or groups/s per round and the median ratio per load. ``--kernel`` times
one layer's attention alone instead (64 and 128 rows, 3 key/value heads of 3 query heads,
head size 64, 150 or 250 cached positions with 0-100 of left padding, a strided view of a
cache with spare positions), the two kernels alternated, medians of 7 x 30 calls.

    python bench/engine_native_attention.py --rounds 2
    python bench/engine_native_attention.py --kernel
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "environments"))

from engine_contention import alternate, serving_dtype, start_engine  # noqa: E402
from engine_max_batch import run_round as training_round  # noqa: E402
from engine_prefill_split import gsm8k_prompts  # noqa: E402
from engine_prefill_split import run_round as evaluation_round  # noqa: E402

from atroposlib.inference.engine import GenerationEngine  # noqa: E402


def set_native(engine: GenerationEngine, on: bool) -> None:
    lean = engine._fast.lean
    if lean is None:
        raise SystemExit(f"no lean decode step for this model: {engine._fast.reason}")
    if on and not lean.native_attention_applies()[0]:
        raise SystemExit(f"the C kernel does not apply: {lean.native_attention_applies()[1]}")
    lean.native_attention = on


def time_kernels() -> None:
    """One layer's decode attention, sdpa vs the C kernel, alternated."""
    import torch

    from atroposlib.inference.fastpath import native

    torch.set_num_threads(2)
    if not native.available():
        raise SystemExit(f"the C kernel is not available: {native.unavailable_reason()}")
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def per_call(function, calls: int = 30) -> float:
        started = time.perf_counter()
        for _ in range(calls):
            function()
        return (time.perf_counter() - started) / calls * 1000

    for rows, length, dtype in (
        (64, 150, torch.bfloat16),
        (64, 250, torch.bfloat16),
        (64, 250, torch.float32),
        (128, 250, torch.bfloat16),
        (16, 250, torch.bfloat16),
    ):
        gen = torch.Generator().manual_seed(0)
        shape = (rows, 3, 400, 64)
        keys = torch.randn(shape, generator=gen).to(dtype)[:, :, :length]
        values = torch.randn(shape, generator=gen).to(dtype)[:, :, :length]
        query = torch.randn(rows, 3, 3, 64, generator=gen).to(dtype)
        lengths = torch.randint(length - 100, length, (rows,), generator=gen)
        mask = torch.arange(length)[None, :] >= (length - lengths)[:, None]
        mask4 = mask[:, None, None, :]
        runs = {
            "sdpa": functools.partial(sdpa, query, keys, values, attn_mask=mask4, scale=0.125),
            "C kernel": functools.partial(
                native.decode_attention, query, keys, values, mask, 0.125
            ),
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        for function in runs.values():
            function()
        for _ in range(7):
            for name, function in runs.items():
                times[name].append(per_call(function))
        a, b = (statistics.median(times[name]) for name in runs)
        print(
            f"{rows} rows, {length} positions, {str(dtype).removeprefix('torch.')}: "
            f"sdpa {a:.3f} ms, C kernel {b:.3f} ms per layer: {a / b:.2f}x",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto", help="auto: as atropos-quickstart serves")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--items", type=int, default=64, help="evaluation questions per round")
    parser.add_argument("--concurrency", type=int, default=64, help="evaluation requests")
    parser.add_argument("--groups", type=int, default=8, help="training groups per round")
    parser.add_argument("--rounds", type=int, default=2, help="counted rounds per setting")
    parser.add_argument("--loads", default="evaluation,training")
    parser.add_argument("--kernel", action="store_true", help="time one layer's attention")
    args = parser.parse_args()
    if args.kernel:
        time_kernels()
        return

    dtype = serving_dtype(args.dtype, args.threads)
    engine = start_engine(args.model, dtype, args.threads, logprobs_mode="processed_logprobs")
    print(f"{dtype}, {args.threads} threads; {engine._fast.reason}", flush=True)
    loads = {
        "evaluation": (
            "items/s",
            gsm8k_prompts(engine.tokenizer, args.items),
            lambda prompts: evaluation_round(engine, prompts, args.concurrency),
        ),
        "training": (
            "groups/s",
            gsm8k_prompts(engine.tokenizer, args.groups, split="train", seed=0),
            lambda prompts: training_round(engine, prompts, 8, 0.4),
        ),
    }
    settings = {"C kernel": True, "PyTorch": False}
    for load in args.loads.split(","):
        unit, prompts, run = loads[load]
        print(f"{load}:", flush=True)
        rates, _ = alternate(
            engine,
            lambda on: set_native(engine, on),
            settings,
            lambda: asyncio.run(run(prompts)),  # noqa: B023 - called before the loop moves on
            args.rounds,
            (),
            unit,
        )
        kernel, torch_path = (statistics.median(rates[name]) for name in settings)
        print(
            f"{load}: C kernel {kernel:.3f}, PyTorch {torch_path:.3f} {unit} "
            f"(medians of {args.rounds}): {kernel / torch_path:.2f}x",
            flush=True,
        )
    engine.shutdown()


if __name__ == "__main__":
    main()
