#!/usr/bin/env python
"""Resident memory per queued group: start a server, queue N groups of 8 x 2048 tokens that no
batch can take, and divide the growth of the server's RSS by N.

    python bench/rss_per_group.py                      # this repo's run-api
    python bench/rss_per_group.py --upstream-python /tmp/upstream-venv/bin/python
"""

from __future__ import annotations

import argparse
import gzip
import random
import sys
import time
from pathlib import Path

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import free_port, make_group, rss_bytes, start_server  # noqa: E402


def measure(python: str, groups: int, group_size: int, seq_len: int, logprobs: bool) -> float:
    port = free_port()
    cwd = None if python == sys.executable else "/"
    log = Path("/tmp") / f"rss-{port}.log"
    proc = start_server(
        [python, "-m", "atroposlib.cli.run_api", "--host", "127.0.0.1", "--port", str(port)],
        port,
        log,
        cwd,
    )
    rng = random.Random(0)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            client.post(
                "/register",
                json={
                    "wandb_group": "g",
                    "wandb_project": "p",
                    "batch_size": 1_000_000,  # never fills: everything stays queued
                    "max_token_len": seq_len + 1,
                    "checkpoint_dir": "c",
                    "save_checkpoint_interval": 1,
                    "starting_step": 0,
                    "num_steps": 1,
                },
            ).raise_for_status()
            bodies = []
            for _ in range(8):
                group = make_group(group_size, seq_len, seq_len // 4, rng)
                if logprobs:
                    group["inference_logprobs"] = [
                        [1.0] * (seq_len // 4)
                        + [-rng.random() * 5 for _ in range(seq_len * 3 // 4)]
                        for _ in range(group_size)
                    ]
                bodies.append(gzip.compress(orjson.dumps(group)))
            headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
            # warm up allocator and code paths, then measure
            for body in bodies:
                client.post("/scored_data", content=body, headers=headers).raise_for_status()
            time.sleep(0.5)
            before = rss_bytes(proc.pid)
            for i in range(groups):
                reply = client.post(
                    "/scored_data", content=bodies[i % len(bodies)], headers=headers
                )
                reply.raise_for_status()
            time.sleep(0.5)
            after = rss_bytes(proc.pid)
            assert client.get("/status").json()["queue_size"] == groups + len(bodies)
    finally:
        proc.terminate()
        proc.wait(10)
    return (after - before) / groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--groups", type=int, default=300)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--upstream-python", help="Also measure upstream's run-api.")
    args = parser.parse_args()
    servers = [("atroposlib (this repo)", sys.executable)]
    if args.upstream_python:
        servers.append(("upstream atroposlib 0.4.0", args.upstream_python))
    print("| server | group | RSS per queued group (MiB) |")
    print("|---|---|---|")
    for logprobs in (False, True):
        shape = f"{args.group_size}x{args.seq_len} tokens+masks" + (
            " +inference_logprobs" if logprobs else ""
        )
        for label, python in servers:
            per = measure(python, args.groups, args.group_size, args.seq_len, logprobs)
            print(f"| {label} | {shape} | {per / 2**20:.3f} |", flush=True)


if __name__ == "__main__":
    main()
