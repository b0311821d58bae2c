"""How long a trainer waits after its batch is complete: long-polled ``/batch`` vs polling.

Starts one ``run-api``; a producer posts the groups of each batch at random moments (the last
group of a batch completes it), and a ``TrainerClient`` takes batches with ``get_batch``: once
with the long poll (``long_poll=10``, the default) and once polling every ``--poll`` seconds
(``long_poll=0``, what ``get_batch`` did before), alternating, ``--rounds`` times each. For
each batch it prints the hand-over delay: from the POST that completed the batch to
``get_batch`` returning it.

    python bench/batch_wait.py [--batches 20] [--rounds 2] [--poll 1.0]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from atroposlib.api.client import TrainerClient  # noqa: E402
from tests.conftest import ApiProcess  # noqa: E402

GROUP = 4
BATCH = 16  # 4 groups of 4


def group(tag: int) -> dict:
    return {
        "tokens": [[tag] * 32 for _ in range(GROUP)],
        "masks": [[-100] + [tag] * 31 for _ in range(GROUP)],
        "scores": [float(i % 2) for i in range(GROUP)],
    }


def run(url: str, long_poll: float, poll: float, batches: int, seed: int) -> list[float]:
    """Hand-over delays (s) of ``batches`` batches."""
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=30) as api:
        api.get("/reset_data")
        client = TrainerClient(url, api_key="", long_poll=long_poll)
        client.register(batch_size=BATCH, max_token_len=64, num_steps=batches)
        client.try_batch()
        completed: list[float] = []

        def produce() -> None:
            for b in range(batches):
                for g in range(BATCH // GROUP):
                    time.sleep(rng.uniform(0.05, 0.35))
                    api.post("/scored_data", json=group(b * 10 + g))
                completed.append(time.monotonic())
                # the next batch's groups come after the trainer took this one (one step)
                while client.last_step is None or client.last_step < b + 1:
                    time.sleep(0.01)

        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        delays = []
        for b in range(batches):
            client.get_batch(timeout=60, poll=poll)
            got = time.monotonic()
            while len(completed) <= b:  # the POST reply may trail the batch by a hair
                time.sleep(0.001)
            delays.append(got - completed[b])
        producer.join()
        client.close()
        return delays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--poll", type=float, default=1.0)
    args = parser.parse_args()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "batch_wait_run_api.log"
    server = ApiProcess(log_path=log).start()
    try:
        print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs")
        results: dict[str, list[float]] = {"long poll": [], f"poll every {args.poll:g} s": []}
        for r in range(args.rounds):
            for name, long_poll in (("long poll", 10.0), (f"poll every {args.poll:g} s", 0.0)):
                delays = run(server.url, long_poll, args.poll, args.batches, seed=r)
                results[name].extend(delays)
                print(
                    f"round {r + 1} {name:>18}: median {statistics.median(delays) * 1000:7.1f} ms"
                    f"  max {max(delays) * 1000:7.1f} ms"
                )
        for name, delays in results.items():
            print(
                f"{name:>18}: {len(delays)} batches, hand-over median "
                f"{statistics.median(delays) * 1000:.1f} ms, mean "
                f"{statistics.fmean(delays) * 1000:.1f} ms, max {max(delays) * 1000:.1f} ms"
            )
        print(f"load average {os.getloadavg()[0]:.2f}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
