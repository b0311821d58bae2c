#!/usr/bin/env python
"""Load generator for the trajectory API: N producers POST scored groups, one trainer pulls
batches, for a bounded time. Prints groups/s accepted, batches/s served, p50/p99 latency of
POST and of /batch, and the server's resident memory.

Against any running server (ours or upstream's ``run-api``)::

    python bench/api_bench.py --url http://127.0.0.1:8000 --producers 8 --duration 20

Side by side, same run (starts each server itself on a free loopback port, one after the
other)::

    python bench/api_bench.py --compare --upstream-python /tmp/upstream-venv/bin/python

Producers behave like upstream's ``BaseEnv``: they post with aiohttp, each group is
gzip-compressed (as upstream does for bodies of 1 KiB or more) and a 429 is retried after
``Retry-After``. The trainer polls ``/batch`` like upstream's example trainer (with
``Accept-Encoding: gzip``), but without its 1 s sleep so that the server, not the poll interval,
is what gets measured.

Two kinds of load:

* closed loop (default): every producer posts its next group as soon as the last one is
  answered, so the server runs flat out and POST latency is mostly queueing (Little's law:
  producers / groups per second);
* open loop (``--rate G``): the producers together offer ``G`` groups/s on a fixed schedule,
  as envs that spend time generating rollouts do. Latency is measured from each post's
  scheduled time, so a server that falls behind is charged for the wait (no coordinated
  omission).

CPU seconds used by the server and by the load generator are printed with each run: on a
2-core machine they share the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import multiprocessing as mp
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import orjson


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` and its children (uvicorn runs in one process)."""
    total = 0
    for p in [pid, *_children(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its children."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for p in [pid, *_children(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


def _children(pid: int) -> list[int]:
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    out = [int(k) for k in kids]
    for k in list(out):
        out.extend(_children(k))
    return out


def pid_listening_on(port: int) -> int | None:
    """The pid of the process listening on 127.0.0.1:``port`` (Linux /proc scan)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if int(parts[1].split(":")[1], 16) == port and parts[3] == "0A":
                inodes.add(parts[9])
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    return int(proc.name)
        except OSError:
            continue
    return None


def make_group(group_size: int, seq_len: int, prompt_len: int, rng: random.Random) -> dict:
    tokens = [[rng.randrange(100, 50_000) for _ in range(seq_len)] for _ in range(group_size)]
    masks = [[-100] * prompt_len + t[prompt_len:] for t in tokens]
    return {
        "tokens": tokens,
        "masks": masks,
        "scores": [rng.choice([1.0, -1.0]) for _ in range(group_size)],
        "advantages": None,
        "ref_logprobs": None,
        "messages": None,
        "overrides": None,
        "group_overrides": None,
        "images": None,
    }


@dataclass
class Result:
    label: str
    producers: int
    duration: float
    accepted: int = 0
    refused_429: int = 0
    errors: int = 0
    batches: int = 0
    post_lat: list[float] = field(default_factory=list)
    batch_lat: list[float] = field(default_factory=list)
    rss_peak: int = 0
    rss_end: int = 0
    offered: float | None = None
    server_cpu: float = 0.0
    client_cpu: float = 0.0
    loadavg: float = 0.0

    def row(self) -> str:
        def pct(values: list[float], q: float) -> str:
            if not values:
                return "-"
            values = sorted(values)
            return f"{values[min(len(values) - 1, int(q * len(values)))] * 1000:.1f}"

        offered = "closed" if self.offered is None else f"{self.offered:g}"
        return (
            f"| {self.label} | {self.producers} | {offered} | "
            f"{self.accepted / self.duration:.1f} | "
            f"{self.batches / self.duration:.2f} | {pct(self.post_lat, 0.5)} | "
            f"{pct(self.post_lat, 0.99)} | {pct(self.batch_lat, 0.5)} | "
            f"{pct(self.batch_lat, 0.99)} | {self.refused_429} | {self.errors} | "
            f"{self.rss_peak / 2**20:.0f} | {self.rss_end / 2**20:.0f} | "
            f"{self.server_cpu / self.duration:.2f} | {self.client_cpu / self.duration:.2f} | "
            f"{self.loadavg:.1f} |"
        )


HEADER = (
    "| server | producers | offered groups/s | groups/s accepted | batches/s served "
    "| POST p50 ms | POST p99 ms | /batch p50 ms | /batch p99 ms | 429s | errors "
    "| RSS peak MiB | RSS end MiB | server cores | load-gen cores | load avg |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


async def run_load(
    url: str,
    label: str,
    producers: int,
    duration: float,
    group_size: int,
    seq_len: int,
    batch_size: int,
    pid: int | None,
    bodies_per_producer: int = 4,
    trainer_sleep: float = 0.0,
    rate: float | None = None,
) -> Result:
    result = Result(label, producers, duration, offered=rate)
    rng = random.Random(0)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await client.get("/reset_data")
        reply = await client.post(
            "/register",
            json={
                "wandb_group": "bench",
                "wandb_project": "bench",
                "batch_size": batch_size,
                "max_token_len": seq_len + 1,
                "checkpoint_dir": "ckpt",
                "save_checkpoint_interval": 100,
                "starting_step": 0,
                "num_steps": 1_000_000,
            },
        )
        reply.raise_for_status()
        await client.get("/batch")
        env = await client.post(
            "/register-env",
            json={
                "max_token_length": seq_len,
                "desired_name": "bench",
                "weight": 1.0,
                "group_size": group_size,
            },
        )
        env_id = env.json()["env_id"]

    # Pre-built gzip bodies (compression is the env's cost, not the server's).
    bodies = []
    for _ in range(bodies_per_producer):
        group = make_group(group_size, seq_len, seq_len // 4, rng)
        group["env_id"] = env_id
        bodies.append(gzip.compress(orjson.dumps(group), 6))
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}

    connector = aiohttp.TCPConnector(limit=producers + 4)
    timeout = aiohttp.ClientTimeout(total=120)
    session = aiohttp.ClientSession(base_url=url, connector=connector, timeout=timeout)
    start = time.monotonic()
    deadline = start + duration
    stop = asyncio.Event()
    period = producers / rate if rate else 0.0

    async def producer(k: int) -> None:
        i = k
        # open loop: producer k posts at start + (k / producers + j) * period
        due = start + period * k / producers
        while True:
            if period:
                now = time.monotonic()
                if due > now:
                    await asyncio.sleep(due - now)
            if time.monotonic() >= deadline:
                return
            body = bodies[i % len(bodies)]
            i += 1
            t0 = time.perf_counter() - (max(0.0, time.monotonic() - due) if period else 0.0)
            try:
                async with session.post("/scored_data", data=body, headers=headers) as r:
                    await r.read()
                    status = r.status
                    retry_after = float(r.headers.get("retry-after", "1"))
            except (aiohttp.ClientError, asyncio.TimeoutError):
                result.errors += 1
                due += period
                continue
            result.post_lat.append(time.perf_counter() - t0)
            due += period
            if status == 200:
                result.accepted += 1
            elif status == 429:
                result.refused_429 += 1
                await asyncio.sleep(retry_after)
            else:
                result.errors += 1

    async def sample_rss() -> None:
        while not stop.is_set() and pid:
            result.rss_peak = max(result.rss_peak, rss_bytes(pid))
            await asyncio.sleep(0.25)

    # The trainer runs in its own process, as it would in a real run, so that handling the
    # large batch responses does not delay the producers' clocks (and vice versa).
    ctx = mp.get_context("spawn")
    results_q = ctx.Queue()
    trainer = ctx.Process(
        target=_trainer_process,
        args=(
            url,
            deadline - time.monotonic(),
            group_size,
            batch_size,
            results_q,
            trainer_sleep,
        ),
    )
    trainer.start()
    server_cpu0 = cpu_seconds(pid) if pid else 0.0
    client_cpu0 = time.process_time()
    sampler = asyncio.create_task(sample_rss())
    try:
        await asyncio.gather(*(producer(k) for k in range(producers)))
    finally:
        await session.close()
    stop.set()
    await sampler
    result.client_cpu = time.process_time() - client_cpu0
    result.loadavg = os.getloadavg()[0]
    if pid:
        result.server_cpu = cpu_seconds(pid) - server_cpu0
    batches, batch_lat, errors, trainer_cpu = await asyncio.to_thread(results_q.get, True, 120)
    trainer.join(30)
    result.client_cpu += trainer_cpu
    result.batches = batches
    result.batch_lat = batch_lat
    result.errors += errors
    if pid:
        result.rss_end = rss_bytes(pid)
        result.rss_peak = max(result.rss_peak, result.rss_end)
    return result


def _trainer_process(
    url: str,
    duration: float,
    group_size: int,
    batch_size: int,
    out: mp.Queue,
    trainer_sleep: float = 0.0,
) -> None:
    """Pull batches as fast as the server hands them out (or with ``trainer_sleep`` seconds of
    "training" after each one); report count and latencies."""

    async def pull() -> tuple[int, list[float], int]:
        batches, latencies, errors = 0, [], 0
        deadline = time.monotonic() + duration
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            while time.monotonic() < deadline:
                t0 = time.perf_counter()
                try:
                    r = await client.get("/batch", headers={"Accept-Encoding": "gzip"})
                except httpx.HTTPError:
                    errors += 1
                    continue
                elapsed = time.perf_counter() - t0
                content = r.content
                if content.startswith((b'{"batch":null', b'{"batch": null')):
                    await asyncio.sleep(0.02)
                    continue
                if content.count(b'"tokens"') * group_size != batch_size:
                    errors += 1
                batches += 1
                latencies.append(elapsed)
                if trainer_sleep:
                    await asyncio.sleep(trainer_sleep)
        return batches, latencies, errors

    cpu0 = time.process_time()
    batches, latencies, errors = asyncio.run(pull())
    out.put((batches, latencies, errors, time.process_time() - cpu0))


def start_server(
    command: list[str], port: int, log: Path, cwd: str | None = None
) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=cwd
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{command[0]} exited early; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/info", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not start; see {log}")


def compare(args: argparse.Namespace) -> None:
    servers = [("atroposlib (this repo)", sys.executable, list(args.our_flags))]
    if args.upstream_python:
        servers.append(("upstream atroposlib 0.4.0", args.upstream_python, []))
    results: list[Result] = []
    logdir = Path(args.logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    for producers in args.producer_counts:
        for label, python, extra in servers:
            port = free_port()
            cmd = [
                python,
                "-m",
                "atroposlib.cli.run_api",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                *extra,
            ]
            log = (logdir / f"{label.split()[0]}-{producers}.log").resolve()
            # upstream runs from a neutral directory so it imports its own atroposlib
            cwd = None if python == sys.executable else "/"
            proc = start_server(cmd, port, log, cwd)
            try:
                res = asyncio.run(
                    run_load(
                        f"http://127.0.0.1:{port}",
                        label,
                        producers,
                        args.duration,
                        args.group_size,
                        args.seq_len,
                        args.batch_size,
                        proc.pid,
                        trainer_sleep=args.trainer_sleep,
                        rate=args.rate,
                    )
                )
            finally:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
            results.append(res)
            print(HEADER.splitlines()[0] if len(results) == 1 else "", end="")
            print(("\n" + HEADER.splitlines()[1] + "\n") if len(results) == 1 else "", end="")
            print(res.row(), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--url", help="Base URL of a running server (single run).")
    parser.add_argument("--pid", type=int, help="Server pid for RSS (default: found by port).")
    parser.add_argument("--producers", type=int, default=8)
    parser.add_argument("--duration", type=float, default=20.0, help="Seconds per run.")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=64, help="Sequences per batch.")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="Start ours (and upstream's, with --upstream-python) and run both.",
    )
    parser.add_argument(
        "--upstream-python", help="Python of a virtualenv with `pip install atroposlib==0.4.0`."
    )
    parser.add_argument(
        "--trainer-sleep",
        type=float,
        default=0.0,
        help="Seconds the trainer 'trains' after each batch (a slow trainer fills the queue).",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="Open loop: groups/s offered by all producers together (default: closed loop, "
        "each producer posts again as soon as it is answered).",
    )
    parser.add_argument("--producer-counts", type=int, nargs="+", default=[8, 32])
    parser.add_argument(
        "--our-flags",
        nargs=argparse.REMAINDER,
        default=[],
        help="Extra run-api flags for our server (last on the line).",
    )
    parser.add_argument("--logdir", default="bench/logs")
    args = parser.parse_args()
    if args.compare:
        compare(args)
        return
    if not args.url:
        parser.error("--url is required unless --compare is given")
    port = httpx.URL(args.url).port or 80
    pid = args.pid or pid_listening_on(port)
    res = asyncio.run(
        run_load(
            args.url,
            args.url,
            args.producers,
            args.duration,
            args.group_size,
            args.seq_len,
            args.batch_size,
            pid,
            trainer_sleep=args.trainer_sleep,
            rate=args.rate,
        )
    )
    print(HEADER)
    print(res.row())


if __name__ == "__main__":
    main()
