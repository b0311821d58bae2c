"""Trainer throughput and weight-sync time per step (SmolLM2-135M-Instruct by default).

Starts ``run-api`` and ``atropos-serve`` as child processes, queues real tokenized groups
(SmolLM2 tokenizer, about ``--tokens`` tokens per sequence) so the trainer never waits for
data, then runs the GRPO trainer with a hot reload of the server after every step. Reports
per step: trainer tokens/s (all tokens of the batch over the forward+backward+optimizer time),
checkpoint save time, and the reload call (``POST /reload_weights``, until the new weights are
live). With ``--vllm-python`` it also times, on one real vLLM in the same run, the trainer's two
vLLM paths onto the last checkpoint: ``--vllm-syncs`` in-place reloads (``VLLMReload``: pause,
``reload_weights`` through ``/collective_rpc``, version, resume; alternating the checkpoint and
the base model so every sync changes the weights) and one restart (stop, relaunch with the same
served name, wait for ``/health``). Both exclude the checkpoint save, which the trainer's
``save_seconds`` reports.

    python bench/trainer_bench.py --steps 4
    python bench/trainer_bench.py --steps 2 --vllm-python /tmp/vllm-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from example_trainer.inference_process import ChildProcess  # noqa: E402
from example_trainer.weight_sync import VLLMReload, vllm_command  # noqa: E402


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _groups(tokenizer, n_groups: int, group_size: int, tokens: int) -> list[dict]:
    from atroposlib.utils.tokenize_for_trainer import tokenize_for_trainer

    filler = " ".join(f"step {i} adds {i} to the total." for i in range(tokens))
    groups = []
    for g in range(n_groups):
        seqs, masks, scores = [], [], []
        for i in range(group_size):
            chat = [
                {"role": "user", "content": f"Sum the numbers from 1 to {g + i}."},
                {"role": "assistant", "content": filler},
            ]
            out = tokenize_for_trainer(tokenizer, chat)
            seqs.append(out["tokens"][:tokens])
            masks.append(out["masks"][:tokens])
            scores.append(float(i))
        groups.append({"tokens": seqs, "masks": masks, "scores": scores})
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--serve-dtype", default="auto")
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="also time vLLM in-place syncs and one restart with this python",
    )
    parser.add_argument("--vllm-syncs", type=int, default=4, help="in-place syncs to time")
    parser.add_argument("--json", default=None, help="write the summary here too")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from transformers import AutoTokenizer

    from atroposlib.inference.models import resolve_model_source
    from example_trainer.config import TrainingConfig
    from example_trainer.grpo import train

    model_dir = resolve_model_source(args.model)
    work = Path(tempfile.mkdtemp(prefix="trainer-bench-"))
    api_port, serve_port = _port(), _port()
    api_url, serve_url = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{serve_port}"
    py = sys.executable
    children = [
        ChildProcess(
            "run-api",
            [py, "-m", "atroposlib.cli.run_api", "--port", api_port, "--log-level", "warning"],
            work / "api.log",
        ),
        ChildProcess(
            "atropos-serve",
            [py, "-m", "atroposlib.inference.cli", "--model", model_dir, "--port", serve_port]
            + ["--served-model-name", "policy", "--dtype", args.serve_dtype],
            work / "serve.log",
        ),
    ]
    try:
        for child in children:
            child.start()
        children[0].wait_ready(api_url + "/info", 60)
        children[1].wait_ready(serve_url + "/health", 300)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        group_size = 4
        for group in _groups(
            tokenizer, args.steps * args.batch // group_size, group_size, args.tokens
        ):
            httpx.post(api_url + "/scored_data", json=group, timeout=30).raise_for_status()
        config = TrainingConfig(
            model_name=model_dir,
            atropos_url=api_url,
            inference="atropos-serve",
            inference_url=serve_url,
            training_steps=args.steps,
            batch_size=args.micro_batch,
            gradient_accumulation_steps=args.batch // args.micro_batch,
            seq_len=max(args.tokens, 64),
            dtype=args.dtype,
            save_path=str(work / "ckpt"),
            weight_sync_interval=1,
            keep_checkpoints=1,
            progress=False,
        )
        started = time.monotonic()
        train(config)
        wall = time.monotonic() - started
        metrics = [
            json.loads(x) for x in (work / "ckpt" / "metrics.jsonl").read_text().splitlines()
        ]
    finally:
        for child in reversed(children):
            child.stop()

    # The first step includes allocator warm-up; report the median over the rest when possible.
    # Batches with no learning signal take no optimizer step and carry no speed.
    metrics = [m for m in metrics if "computed_tokens_per_s" in m] or metrics
    steady = metrics[1:] or metrics
    summary = {
        "model": args.model,
        "dtype": args.dtype,
        "sequences_per_step": args.batch,
        "tokens_per_sequence": args.tokens,
        "steps": args.steps,
        "cpu_count": os.cpu_count(),
        **{
            key: round(statistics.median(m.get(key, 0.0) for m in steady), 3 if key == "mfu" else 1)
            for key in (
                "batch_tokens_per_s",
                "computed_tokens_per_s",
                "trained_tokens_per_s",
                "mfu",
            )
        },
        "train_seconds_per_step": round(statistics.median(m["train_seconds"] for m in steady), 2),
        "save_seconds_per_step": round(statistics.median(m["save_seconds"] for m in steady), 2),
        "reload_seconds_per_step": round(statistics.median(m["reload_seconds"] for m in steady), 2),
        "sync_seconds_per_step": round(statistics.median(m["sync_seconds"] for m in steady), 2),
        "sync_seconds_all_steps": [round(m["sync_seconds"], 2) for m in metrics],
        "wall_seconds": round(wall, 1),
    }

    if args.vllm_python:
        checkpoint = work / "ckpt" / f"step_{args.steps}"
        port = _port()
        vllm = VLLMReload(
            lambda model: vllm_command(
                model,
                served_model_name="policy",
                port=port,
                python=args.vllm_python,
                extra_args=["--dtype", "bfloat16", "--max-model-len", "2048"],
            ),
            f"http://127.0.0.1:{port}",
            work / "vllm.log",
            startup_timeout=900,
            served_model_name="policy",
            env={"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")},
            fallback_to_restart=False,
        )
        try:
            first = time.monotonic()
            vllm.start(str(model_dir), policy_version=0)
            summary["vllm_first_start_seconds"] = round(time.monotonic() - first, 1)
            in_place = []
            for i in range(args.vllm_syncs):
                target = checkpoint if i % 2 == 0 else Path(model_dir)
                in_place.append(vllm.sync(target, policy_version=i + 1))
            summary["vllm_in_place_sync_seconds"] = round(statistics.median(in_place), 2)
            summary["vllm_in_place_sync_all"] = [round(x, 2) for x in in_place]
            summary["vllm_in_place_steps_last"] = {
                k: round(v, 3) for k, v in vllm.last_steps.items()
            }
            summary["vllm_restart_seconds"] = round(
                vllm.restart(checkpoint, policy_version=args.vllm_syncs + 1), 1
            )
            summary["vllm_policy_version_after"] = httpx.get(
                vllm.url + "/policy_version", timeout=10
            ).json()["policy_version"]
        finally:
            vllm.close()

    shutil.rmtree(work / "ckpt", ignore_errors=True)  # ~1.5 GB of checkpoints; logs stay
    summary["logs"] = str(work)
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
