"""Weight sync per step, disk vs shared memory, against a real atropos-serve on this machine.

    python bench/weight_sync_bench.py --rounds 5

Starts ``atropos-serve`` (SmolLM2-135M-Instruct, float32, loopback), loads the same model as
the trainer would, and alternates the two paths for ``--rounds`` rounds, changing the weights
before each sync:

- disk: ``save_checkpoint`` (what the example trainer writes) + ``POST /reload_weights``;
- memory: write the parameters into ``/dev/shm`` + ``POST /load_weights_from_shm`` (copy into
  the served model in place, re-pack the fast path), twice per round: ``shm_after_disk`` right
  after the disk reload (which replaced the served model), ``shm`` the next one (what a run
  that syncs through memory at every step sees).

Each figure is the trainer's wall time from "weights ready" to "the server answered that the new
weights serve requests" (the reply of the sync request), the server idle meanwhile. Prints one
JSON line per sync and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="float32", help="the server's --dtype")
    parser.add_argument(
        "--trainer-dtype",
        default="float32",
        help="dtype of the trainer's weights (float32 for --dtype bf16-mixed training)",
    )
    parser.add_argument(
        "--paths",
        default="disk,shm_after_disk,shm",
        help="comma-separated, in round order: disk, shm_after_disk, shm",
    )
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from atroposlib.backends.weight_sync import AtroposServeReload
    from atroposlib.inference.models import resolve_model_source
    from atroposlib.utils.processes import ChildProcess
    from example_trainer.checkpoint import save_checkpoint

    source = resolve_model_source(args.model)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    work = Path(tempfile.mkdtemp(prefix="sync-bench-"))
    server = ChildProcess(
        "atropos-serve",
        [sys.executable, "-m", "atroposlib.inference.cli", "--model", source, "--port", str(port),
         "--dtype", args.dtype, "--log-level", "warning"],
        work / "serve.log",
    ).start()  # fmt: skip
    try:
        server.wait_ready(url + "/health", timeout=300)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=getattr(torch, args.trainer_dtype)
        )
        tokenizer = AutoTokenizer.from_pretrained(source)
        disk = AtroposServeReload(url, transport="disk")
        memory = AtroposServeReload(url, transport="shm")
        memory.attach(model)
        labels = [label.strip() for label in args.paths.split(",") if label.strip()]
        times: dict[str, list[float]] = {label: [] for label in labels}
        version = 0
        for _ in range(args.rounds):
            # a run syncs the same way every step: the second memory sync of each round is the
            # steady state; the first follows a disk reload, which replaced the served model
            # (its fast path packed afresh), so it also pays for laying out new buffers
            for label in labels:
                path = "disk" if label == "disk" else "shm"
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(1.0001)
                version += 1
                started = time.monotonic()
                if path == "disk":
                    folder = save_checkpoint(
                        work / f"step_{version}", model, tokenizer, step=version
                    )
                    saved = time.monotonic() - started
                    disk.sync(folder, policy_version=version)
                    detail = {"save": round(saved, 3), **disk.last_reply}
                else:
                    memory.sync(None, policy_version=version)
                    detail = {**memory.last_timings, **memory.last_reply}
                seconds = time.monotonic() - started
                times[label].append(seconds)
                if path == "shm":
                    # what neither side counts: HTTP, the segment's mapping, JSON
                    detail["other_seconds"] = round(
                        seconds - detail["shm_write_seconds"] - detail["total_seconds"], 4
                    )
                keep = ("save", "shm_write_seconds", "copy_seconds", "prepare_seconds",
                        "load_seconds", "map_seconds", "total_seconds", "other_seconds")  # fmt: skip
                print(json.dumps({"path": label, "seconds": round(seconds, 3),
                                  **{k: detail[k] for k in keep if k in detail}}), flush=True)  # fmt: skip
        memory.close()
        print(json.dumps({
            "load_average": os.getloadavg()[0],
            **{f"{k}_median": round(statistics.median(v), 3) for k, v in times.items()},
            **{f"{k}_all": [round(x, 3) for x in v] for k, v in times.items()},
        }))  # fmt: skip
    finally:
        server.stop()


if __name__ == "__main__":
    main()
