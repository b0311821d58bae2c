#!/usr/bin/env python
"""What one big (or hostile) request body costs ``run-api``: while it is sent, how long do
``GET /status`` and ``GET /batch`` take, how much memory does the server peak at, and what does
the sender get back.

    python bench/api_big_body.py                      # a ~114 MiB JSON group, gzip (the repro)
    python bench/api_big_body.py --register           # the same after a trainer registered
    python bench/api_big_body.py --bombs 8            # 8 concurrent 2 MB -> 2 GiB gzip bombs
    python bench/api_big_body.py --mib 250 -- --max-request-bytes 256M   # flags after --

Every figure is from one run on one machine (the load average is printed); compare runs taken
one after the other.
"""

from __future__ import annotations

import argparse
import gzip
import os
import statistics
import sys
import threading
import time
import zlib
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_bench import _children, free_port, start_server  # noqa: E402


def _status_kib(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_rss(pid: int) -> tuple[int, int]:
    """Largest resident set of ``pid`` so far (VmHWM), and its children's RSS now, in bytes."""
    return _status_kib(pid, "VmHWM:"), sum(_status_kib(c, "VmRSS:") for c in _children(pid))


def big_group(mib: float) -> bytes:
    """One valid group whose JSON is about ``mib`` MiB: two sequences of ``1,1,1,...``."""
    n = max(1, int(mib * (1 << 20) / 4))
    ones = b"1," * (n - 1) + b"1"
    return b'{"tokens":[[' + ones + b']],"masks":[[' + ones + b']],"scores":[1]}'


def bomb(plain_bytes: int) -> bytes:
    """gzip of ``plain_bytes`` zero bytes (about 1000:1), built without holding them."""
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = b"\0" * (1 << 20)
    parts = [comp.compress(chunk) for _ in range(plain_bytes >> 20)]
    parts.append(comp.flush())
    return b"".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=114.0, help="JSON size of the big group")
    parser.add_argument("--register", action="store_true", help="register a trainer first")
    parser.add_argument("--bombs", type=int, default=0, help="send N gzip bombs instead")
    parser.add_argument("--bomb-gib", type=float, default=2.0, help="inflated size of a bomb")
    parser.add_argument("server_flags", nargs="*", help="extra run-api flags (after --)")
    args = parser.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path("/tmp") / f"api-big-body-{port}.log"
    proc = start_server(
        [sys.executable, "-m", "atroposlib.cli.run_api", "--port", str(port), *args.server_flags],
        port,
        log,
    )
    try:
        if args.register:
            httpx.post(
                url + "/register",
                json={
                    "wandb_group": "g",
                    "wandb_project": "p",
                    "batch_size": 4,
                    "max_token_len": 4096,
                    "checkpoint_dir": "c",
                    "save_checkpoint_interval": 1,
                    "starting_step": 0,
                    "num_steps": 1,
                },
            ).raise_for_status()
        if args.bombs:
            bodies = [bomb(int(args.bomb_gib * (1 << 30)))] * args.bombs
            what = f"{args.bombs} gzip bomb(s) of {len(bodies[0]) >> 10} KiB -> {args.bomb_gib} GiB"
        else:
            bodies = [gzip.compress(big_group(args.mib), 6)]
            what = f"one group of {args.mib:g} MiB JSON ({len(bodies[0]) >> 10} KiB gzip)"
        base_rss = peak_rss(proc.pid)[0]
        results: list[str] = []
        done = threading.Event()
        peak = [base_rss, 0]

        def send(body: bytes) -> None:
            t0 = time.monotonic()
            try:
                r = httpx.post(
                    url + "/scored_data",
                    content=body,
                    headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
                    timeout=300,
                )
                results.append(f"{r.status_code} in {time.monotonic() - t0:.2f} s: {r.text[:90]}")
            except httpx.HTTPError as exc:
                results.append(f"{type(exc).__name__} after {time.monotonic() - t0:.2f} s")

        def sample_rss() -> None:
            while not done.is_set():
                main_peak, children = peak_rss(proc.pid)
                peak[0] = max(peak[0], main_peak)
                peak[1] = max(peak[1], children)
                time.sleep(0.02)

        senders = [threading.Thread(target=send, args=(b,)) for b in bodies]
        sampler = threading.Thread(target=sample_rss)
        sampler.start()
        started = time.monotonic()
        for t in senders:
            t.start()
        status_ms: list[float] = []
        batch_ms: list[float] = []
        with httpx.Client(base_url=url, timeout=300) as client:
            while any(t.is_alive() for t in senders):
                for path, out in (("/status", status_ms), ("/batch", batch_ms)):
                    t0 = time.monotonic()
                    client.get(path)
                    out.append((time.monotonic() - t0) * 1000)
                time.sleep(0.02)
        for t in senders:
            t.join()
        elapsed = time.monotonic() - started
        done.set()
        sampler.join()
        print(f"load average {os.getloadavg()[0]:.2f}; flags {args.server_flags or '-'}")
        print(f"sent {what}{' after /register' if args.register else ''}; {elapsed:.2f} s")
        for line in sorted(results):
            print("  reply:", line)
        for name, values in (("/status", status_ms), ("/batch", batch_ms)):
            if values:
                print(
                    f"  {name}: {len(values)} calls, median {statistics.median(values):.1f} ms, "
                    f"max {max(values):.1f} ms"
                )
        print(
            f"  server RSS peak {peak[0] / 2**20:.0f} MiB (idle {base_rss / 2**20:.0f} MiB); "
            f"its parser process at most {peak[1] / 2**20:.0f} MiB"
        )
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
