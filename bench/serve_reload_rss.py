"""Resident memory of ``atropos-serve`` across ``/reload_weights`` calls.

Starts ``atropos-serve`` (default: the packaged SmolLM2-135M-Instruct in float32, as
``atropos-quickstart`` serves it), reloads the same checkpoint folder ``--reloads`` times with
a short generation between reloads (so the new weights' packed copies and decode kernels are
used), and prints the server's RSS after start and after every reload::

    python bench/serve_reload_rss.py --reloads 15
    python bench/serve_reload_rss.py --model /path/to/checkpoint --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx


def rss_mb(pid: int) -> float:
    """Resident set size of ``pid`` in MB (from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument(
        "--checkpoint", default=None, help="Folder to reload (default: the served model's)."
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--reloads", type=int, default=15)
    parser.add_argument(
        "--under-load",
        type=int,
        default=0,
        help="Keep this many requests (n=4, 64 tokens) generating while reloading.",
    )
    args = parser.parse_args()

    if args.checkpoint is None and args.model == "SmolLM2-135M-Instruct":
        from atroposlib.inference.models import smollm2_model_dir

        args.checkpoint = str(smollm2_model_dir())
    checkpoint = args.checkpoint or args.model
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="serve-rss-", suffix=".log", delete=False)
    command = [
        sys.executable,
        "-m",
        "atroposlib.inference.cli",
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not start; log: {log.name}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "Hello", "max_tokens": 16, "ignore_eos": True}

        def generate() -> None:
            httpx.post(url + "/v1/completions", json=body, timeout=300).raise_for_status()

        generate()
        stop = threading.Event()

        def load() -> None:
            busy = {**body, "n": 4, "max_tokens": 64}
            while not stop.is_set():
                httpx.post(url + "/v1/completions", json=busy, timeout=600)

        workers = [threading.Thread(target=load, daemon=True) for _ in range(args.under_load)]
        for worker in workers:
            worker.start()
        start = rss_mb(proc.pid)
        print(f"after start: {start:.0f} MB", flush=True)
        rows = []
        for i in range(1, args.reloads + 1):
            began = time.monotonic()
            reply = httpx.post(url + "/reload_weights", json={"path": checkpoint}, timeout=600)
            reply.raise_for_status()
            generate()
            rows.append(rss_mb(proc.pid))
            print(
                f"reload {i:2d}: {rows[-1]:.0f} MB ({time.monotonic() - began:.1f} s)", flush=True
            )
        stop.set()
        first = rows[0]
        print(
            f"RSS start {start:.0f} MB, after reload 1 {first:.0f} MB, after reload "
            f"{len(rows)} {rows[-1]:.0f} MB (max {max(rows):.0f} MB): "
            f"{(rows[-1] - first) / max(len(rows) - 1, 1):+.0f} MB per reload after the first"
        )
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
