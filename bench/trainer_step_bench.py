"""One GRPO optimizer step, timed in-process for several trainer layouts on identical batches.

Batches are built the way an environment builds them: real chat prompts through the model's
chat template (the arithmetic-learn recipe's few-shot prompt, or GSM8K test questions),
``--group-size`` replies per prompt with lengths drawn from the task's range (1-4 tokens for
arithmetic, 40-128 for GSM8K), scores drawn so that ``--flat-fraction`` of the groups score
alike. Every layout trains the same batches; rounds alternate the layouts and the medians are
printed, so the ratios hold even while the machine's speed drifts.

Layouts (each adds one change to the one before):

    before     upstream padding (L-1 a multiple of 64), full logits, gradient checkpointing,
               AdamW looping over tensors (the trainer before 2026-11-24)
    no-ckpt    no gradient checkpointing, fused AdamW
    buckets    + each micro-batch padded to its own longest row (multiple of 8)
    trained    + logits only at trained positions
    shared     + each group's prompt run once per micro-batch
    skip       + zero-advantage sequences not run
    packed     + the step's sequences packed without padding, every common beginning once
               (the default trainer, pack_tokens=1024); packed-N: the same with passes of at
               most N tokens (e.g. packed-8192)

Per layout: seconds per step, batch tokens/s (every token of the batch, prompts counted once
per sequence: what a batch holds, not work), computed tokens/s (positions run through forward
and backward) and MFU against this machine's measured GEMM peak (bench/gemm_peak.py).

    python bench/trainer_step_bench.py                     # the arithmetic recipe's shapes
    python bench/trainer_step_bench.py --task gsm8k        # GSM8K-like shapes
    python bench/trainer_step_bench.py --device cuda       # on a GPU (bf16 weights)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYOUTS = ["before", "no-ckpt", "buckets", "trained", "shared", "skip", "packed"]


def _arithmetic_messages(rng):
    from environments.arithmetic_server import chat_messages

    a, op, b = rng.randint(0, 20), rng.choice("+-"), rng.randint(0, 20)
    return chat_messages(f"What is {a} {op} {b}?")


def _gsm8k_messages(rng):
    from environments.gsm8k_server import BUNDLED_GSM8K, load_rows
    from example_trainer.recipes import GSM8K_FORMAT_INSTRUCTION

    rows = load_rows(BUNDLED_GSM8K, "test")
    # the gsm8k-format recipe's prompt: no system turn, a format instruction after the question
    return [{"role": "user", "content": rng.choice(rows)["question"] + GSM8K_FORMAT_INSTRUCTION}]


TASKS = {
    # (chat maker, reply token range): the arithmetic-learn recipe's prompt (system prompt,
    # three worked examples, the question) and bare-integer replies; the gsm8k-format
    # recipe's questions with replies up to its 128-token budget
    "arithmetic": (_arithmetic_messages, (1, 4)),
    "gsm8k": (_gsm8k_messages, (40, 128)),
}


def build_batch(tokenizer, task: str, groups: int, group_size: int, flat: float, seed: int):
    """``groups`` groups of ``group_size`` tokenized chats, as ``GET /batch`` returns them."""
    make_messages, (lo, hi) = TASKS[task]
    rng = random.Random(seed)
    vocab_words = ["1", "2", "3", "4", "5", "plus", "minus", "is", "the", "answer", "="]
    batch = []
    for _ in range(groups):
        messages = make_messages(rng)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False).input_ids
        tokens, masks, old = [], [], []
        for _ in range(group_size):
            reply = []
            while len(reply) < rng.randint(lo, hi):
                reply += tokenizer.encode(" " + rng.choice(vocab_words), add_special_tokens=False)
            reply = reply[:hi] + [tokenizer.eos_token_id]
            tokens.append(prompt + reply)
            masks.append([-100] * len(prompt) + reply)
            old.append([1.0] * len(prompt) + [-rng.random() for _ in reply])
        same = rng.random() < flat
        scores = [1.0] * group_size if same else [float(rng.randint(0, 1)) for _ in tokens]
        if not same and len(set(scores)) == 1:
            scores[0] = 1.0 - scores[0]
        batch.append(
            {
                "tokens": tokens,
                "masks": masks,
                "scores": scores,
                "inference_logprobs": old,
                "overrides": None,
                "generation_params": {"temperature": 1.0},
                "group_overrides": None,
            }
        )
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--task", choices=sorted(TASKS), default="arithmetic")
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64, help="sequences per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--flat-fraction", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--layouts", nargs="*", default=LAYOUTS, help=f"{', '.join(LAYOUTS)} or packed-N"
    )
    parser.add_argument("--json", default=None, help="write the summary here too")
    parser.add_argument("--device", default="cpu", help="torch device the trainer runs on")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bf16-mixed", "bfloat16"],
        help="training precision, as the trainer's --dtype (auto: bf16-mixed on a GPU that "
        "has bfloat16, else float32)",
    )
    args = parser.parse_args()
    for layout in args.layouts:
        size = layout.removeprefix("packed-")
        if layout not in LAYOUTS and not (layout.startswith("packed-") and size.isdigit()):
            parser.error(f"--layouts: unknown layout {layout!r} ({', '.join(LAYOUTS)}, packed-N)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from atroposlib.inference.models import resolve_model_source
    from atroposlib.trainer.throughput import gemm_peak, model_flops
    from example_trainer.config import TrainingConfig
    from example_trainer.data import prepare_batch
    from example_trainer.forward import check_fast_path
    from example_trainer.grpo import autocast, compute_dtype_name, resolve_dtype, train_step

    path = resolve_model_source(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    device = args.device
    precision = TrainingConfig(model_name=path, device=device, dtype=args.dtype)
    dtype = resolve_dtype(precision)
    dtype_name = compute_dtype_name(precision)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.to(device)
    model.config.use_cache = False
    with autocast(precision):
        fast_ok = check_fast_path(model, device)
    flops = model_flops(model)
    peak = gemm_peak(device, dtype_name, torch.get_num_threads())
    flops_done: dict[str, float] = {}
    # keep the weights ~fixed; the loop-over-tensors AdamW for "before", fused for the others
    optimizers = {
        False: torch.optim.AdamW(model.parameters(), lr=1e-12, foreach=False),
        True: torch.optim.AdamW(model.parameters(), lr=1e-12, fused=True),
    }
    schedulers = {
        k: torch.optim.lr_scheduler.LambdaLR(o, lambda _: 1.0) for k, o in optimizers.items()
    }
    groups = args.batch // args.group_size
    batches = [
        build_batch(tokenizer, args.task, groups, args.group_size, args.flat_fraction, seed)
        for seed in range(args.rounds + 1)
    ]

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def run(layout: str, raw) -> tuple[float, int, int]:
        pack = int(layout.removeprefix("packed-")) if layout.startswith("packed-") else 1024
        level = LAYOUTS.index("packed" if layout.startswith("packed-") else layout)
        ckpt = level == 0
        if ckpt:
            (
                getattr(model, "activation_checkpointing_enable", None)
                or model.gradient_checkpointing_enable
            )()
        else:
            (
                getattr(model, "activation_checkpointing_disable", None)
                or model.gradient_checkpointing_disable
            )()
        config = TrainingConfig(
            model_name=path, device=device, batch_size=args.micro_batch, dtype=args.dtype
        )
        batch = prepare_batch(
            raw,
            args.micro_batch,
            upstream_padding=level < 2,
            share_prefix=level >= 4,
            skip_zero_advantage=level >= 5,
            pack_tokens=pack if level >= 6 else 0,
        )
        sync()
        started = time.perf_counter()
        fused = level >= 1
        train_step(
            model, optimizers[fused], schedulers[fused], batch, config, fast=level >= 3 and fast_ok
        )
        sync()
        took = time.perf_counter() - started
        head = batch.run_tokens if level >= 3 and fast_ok else batch.computed_tokens
        flops_done[layout] = flops_done.get(layout, 0.0) + flops.training_flops(
            batch.computed_tokens, head
        )
        return took, batch.total_tokens, batch.computed_tokens

    for layout in args.layouts:  # warm-up: allocator, oneDNN primitives
        took, _, _ = run(layout, batches[0])
        print(f"warm-up {layout}: {took:.1f} s", file=sys.stderr, flush=True)
    seconds: dict[str, list[float]] = {k: [] for k in args.layouts}
    tokens: dict[str, tuple[int, int]] = {}
    for r in range(args.rounds):
        order = args.layouts if r % 2 == 0 else list(reversed(args.layouts))
        for layout in order:
            took, total, computed = run(layout, batches[r + 1])
            print(
                f"round {r + 1}/{args.rounds} {layout}: {took:.1f} s", file=sys.stderr, flush=True
            )
            seconds[layout].append(took)
            tokens.setdefault(layout, (0, 0))
            tokens[layout] = (tokens[layout][0] + total, tokens[layout][1] + computed)

    base = statistics.median(seconds[args.layouts[0]])
    print(
        f"task {args.task}: {args.batch} sequences/step, groups of {args.group_size}, "
        f"micro-batch {args.micro_batch}, {args.rounds} rounds, load {os.getloadavg()[0]:.2f}, "
        f"torch threads {torch.get_num_threads()}"
    )
    where = (
        torch.cuda.get_device_name(device)
        if device.startswith("cuda")
        else f"{torch.get_num_threads()} threads"
    )
    weights = str(dtype).removeprefix("torch.")
    print(f"device {device} ({where}), weights {weights}, arithmetic {dtype_name}")
    print(f"GEMM peak ({dtype_name}, {where}): {peak / 1e9:.1f} GFLOP/s")
    header = f"{'layout':10s} {'s/step':>7s} {'batch tok/s':>12s} {'computed tok/s':>15s}"
    print(header + f" {'computed/batch':>15s} {'mfu':>6s} {'speed-up':>9s}")
    summary = {}
    for layout in args.layouts:
        med = statistics.median(seconds[layout])
        total, computed = tokens[layout]
        per_step, computed_per_step = total / args.rounds, computed / args.rounds
        # the warm-up step is in flops_done too: average over every step run
        mfu = flops_done[layout] / (args.rounds + 1) / med / peak
        summary[layout] = {
            "seconds_per_step": round(med, 3),
            "batch_tokens_per_s": round(per_step / med, 1),
            "computed_tokens_per_s": round(computed_per_step / med, 1),
            "computed_over_batch_tokens": round(computed / total, 3),
            "mfu": round(mfu, 3),
            "speedup": round(base / med, 2),
        }
        print(
            f"{layout:10s} {med:7.2f} {per_step / med:12.0f} {computed_per_step / med:15.0f} "
            f"{computed / total:15.3f} {mfu:6.1%} {base / med:8.2f}x"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
