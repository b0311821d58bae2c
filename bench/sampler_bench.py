"""One draw of atropos-serve's batched sampler (``sample_next``) per setting, on real logits.

The logits are SmolLM2-135M-Instruct's (the bundled model, bfloat16 as atropos-serve serves
it on CPU) at evenly spaced positions of GSM8K train questions in the gsm8k-format recipe's
prompt: real next-token distributions over the 49,152-token vocabulary, ``--rows`` of them (the
rows one decode step samples; atropos-serve decodes up to 64 together by default, 128 with
``--max-concurrency 128``). Each setting is timed ``--repeats`` times (median printed).

``--compare FILE`` times a second copy of ``atroposlib/inference/sampling.py`` (e.g. the
previous commit's: ``git show HEAD~1:atroposlib/inference/sampling.py > /tmp/old.py``) on the
same logits, alternating which runs first, and says whether both drew the same tokens with the
same seeds.

    python bench/sampler_bench.py --rows 128 --repeats 7
    python bench/sampler_bench.py --rows 128 --compare /tmp/old.py
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "environments"))

import torch  # noqa: E402
from engine_prefill_split import gsm8k_prompts  # noqa: E402

from atroposlib.inference import sampling  # noqa: E402
from atroposlib.inference.models import load_model  # noqa: E402

#: (label, SamplingParams fields)
SETTINGS: list[tuple[str, dict[str, float]]] = [
    ("greedy", {"temperature": 0.0}),
    ("temperature 1.0", {"temperature": 1.0}),
    ("temperature 0.3", {"temperature": 0.3}),
    ("temperature 0.5, top-k 50", {"temperature": 0.5, "top_k": 50}),
    ("temperature 0.7, top-p 0.9", {"temperature": 0.7, "top_p": 0.9}),
    ("temperature 1.0, top-p 0.95", {"temperature": 1.0, "top_p": 0.95}),
    ("temperature 1.0, top-k 50, top-p 0.9", {"temperature": 1.0, "top_k": 50, "top_p": 0.9}),
    ("temperature 0.3, min-p 0.05", {"temperature": 0.3, "min_p": 0.05}),
]


def model_logits(rows: int) -> torch.Tensor:
    """``rows`` next-token logit rows (float32) of the bundled model on GSM8K prompts."""
    loaded = load_model("SmolLM2-135M-Instruct", "bfloat16")
    found: list[torch.Tensor] = []
    prompts = iter(gsm8k_prompts(loaded.tokenizer, rows, split="train", seed=0))
    while sum(len(f) for f in found) < rows:  # one prompt gives a row per position
        with torch.inference_mode():
            found.append(loaded.model(torch.tensor([next(prompts)])).logits[0].float())
    every = torch.cat(found)
    pick = torch.linspace(0, len(every) - 1, rows).round().long()
    return every[pick].contiguous()


def load_sampler(path: str) -> ModuleType:
    """A sampling module loaded from ``path`` (another version of sampling.py)."""
    spec = importlib.util.spec_from_file_location("compared_sampling", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def draw(module: ModuleType, logits: torch.Tensor, fields: dict[str, float]) -> tuple[float, list]:
    """Seconds of one ``sample_next`` over every row (seeded rows, processed log-probs) and
    the tokens drawn."""
    rows = []
    for i in range(logits.shape[0]):
        params = module.SamplingParams(max_tokens=1, seed=i, **fields)
        rows.append(
            module.RowState(
                params=params,
                generator=params.make_generator(0),
                output_ids=[],
                prompt_ids=[],
                banned_until_min=[],
            )
        )
    started = time.perf_counter()
    tokens, _ = module.sample_next(logits, rows, processed=True)
    return time.perf_counter() - started, tokens.tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128, help="rows per draw (default 128)")
    parser.add_argument("--repeats", type=int, default=7, help="draws timed per setting")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--compare", help="another sampling.py to time on the same logits")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logits = model_logits(args.rows)
    other = load_sampler(args.compare) if args.compare else None
    print(
        f"{args.rows} rows x {logits.shape[1]:,} vocabulary, {args.threads} threads, "
        f"median of {args.repeats} draws"
    )
    if other is None:
        print("| setting | ms per draw |")
        print("|---|---|")
    else:
        print("| setting | this ms | compared ms | compared / this | same tokens |")
        print("|---|---|---|---|---|")
    for label, fields in SETTINGS:
        ours: list[float] = []
        theirs: list[float] = []
        same = True
        for repeat in range(args.repeats + 1):  # the first of each is a warm-up
            order = [(sampling, ours), (other, theirs)] if other is not None else [(sampling, ours)]
            if repeat % 2:
                order.reverse()
            tokens = []
            for module, times in order:
                seconds, drawn = draw(module, logits, fields)
                if repeat:
                    times.append(seconds * 1000)
                tokens.append(drawn)
            same = same and all(t == tokens[0] for t in tokens)
        mine = statistics.median(ours)
        if other is None:
            print(f"| {label} | {mine:.1f} |")
        else:
            compared = statistics.median(theirs)
            print(
                f"| {label} | {mine:.1f} | {compared:.1f} | {compared / mine:.2f}x | "
                f"{'yes' if same else 'no'} |"
            )


if __name__ == "__main__":
    main()
