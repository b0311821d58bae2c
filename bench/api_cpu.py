#!/usr/bin/env python
"""CPU cost per request of the trajectory API's two hot paths, in-process (no sockets):
``POST /scored_data`` of a gzip 8x2048-token group (the envs' fast path) and ``GET /batch`` of
64 sequences with ``Accept-Encoding: gzip``. The ASGI application is called directly and the
process's CPU time (all threads) is divided by the requests made, so the figure moves far less
with the load from other work than the wall-clock figures of ``api_bench.py`` do.

    python bench/api_cpu.py --rounds 7

To compare two checkouts, run it alternately from each (``cd`` there, ``PYTHONPATH=.``).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import statistics
import time
from typing import Any

import orjson

from atroposlib.api.server import create_app
from atroposlib.api.settings import ApiSettings

GROUP_SIZE, SEQ_LEN, BATCH = 8, 2048, 64


def group(i: int) -> dict[str, Any]:
    """One scored group of ``GROUP_SIZE`` sequences of ``SEQ_LEN`` tokens."""
    tokens = [(i + j) % 30000 for j in range(SEQ_LEN)]
    mask = [-100] * 100 + tokens[100:]
    return {
        "tokens": [tokens] * GROUP_SIZE,
        "masks": [mask] * GROUP_SIZE,
        "scores": [float(k % 2) for k in range(GROUP_SIZE)],
    }


async def call(app: Any, method: str, path: str, body: bytes = b"", headers=()) -> int:
    """One request through the ASGI app; returns the status code."""
    hdrs = [(b"host", b"127.0.0.1"), *headers]
    if body:
        hdrs.append((b"content-length", str(len(body)).encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": hdrs,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)  # the client never hangs up
        raise AssertionError

    status = 0

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status


async def run(rounds: int) -> tuple[list[float], list[float]]:
    """Per round: ms of CPU per POST (64 of them) and per GET /batch (8 of them)."""
    app = create_app(ApiSettings(host="127.0.0.1"))
    registration = {
        "wandb_group": "g",
        "wandb_project": "p",
        "batch_size": BATCH,
        "max_token_len": SEQ_LEN,
        "checkpoint_dir": "c",
        "save_checkpoint_interval": 1,
        "starting_step": 0,
        "num_steps": 1,
    }
    json_type = [(b"content-type", b"application/json")]
    assert await call(app, "POST", "/register", orjson.dumps(registration), json_type) == 200
    bodies = [gzip.compress(orjson.dumps(group(i)), 1) for i in range(8)]
    gz = [(b"content-encoding", b"gzip"), *json_type]
    posts, batches = [], []
    per_batch = BATCH // GROUP_SIZE
    for _ in range(rounds):
        start = time.process_time()
        for k in range(8 * per_batch):
            assert await call(app, "POST", "/scored_data", bodies[k % 8], gz) == 200
        posts.append((time.process_time() - start) / (8 * per_batch) * 1000)
        start = time.process_time()
        for _ in range(8):
            status = await call(app, "GET", "/batch", headers=[(b"accept-encoding", b"gzip")])
            assert status == 200
        batches.append((time.process_time() - start) / 8 * 1000)
    return posts, batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="rounds (medians are printed)")
    args = parser.parse_args()
    posts, batches = asyncio.run(run(args.rounds))
    print(
        f"CPU ms per POST /scored_data: median {statistics.median(posts):.3f}; "
        f"per GET /batch: median {statistics.median(batches):.3f} ({args.rounds} rounds)"
    )


if __name__ == "__main__":
    main()
