"""Where a recipe's waiting goes: atropos-serve's state every 50 ms during a quickstart run.

Runs ``atropos-quickstart`` with the arguments given after ``--`` (default: 20 steps of
arithmetic-learn without evaluations), polls the inference server's ``GET /health`` (paused or
not, rows running, requests waiting, decode steps, requests prefilled, weights version) and
prints, per stretch between two pauses of the trainer, how long the server generated and what
it did, then every **stall**: a stretch of at least ``--stall`` seconds in which the server was
not paused and had work (rows running or requests waiting) but neither decoded a step nor
prefilled a request. Stalls are time the engine lost to something else: another process
holding the cores (its two OpenMP threads then crawl), or the engine busy outside its steps.

    python bench/serve_timeline.py --output /tmp/timeline -- --steps 20 --no-eval

Run it with nothing else on the machine; it adds ~1% of a core itself.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

DEFAULT_QUICKSTART = ["--recipe", "arithmetic-learn", "--steps", "20", "--no-eval"]


def _server_port(
    log: Path, offset: int, quickstart: subprocess.Popen, stop: threading.Event
) -> str | None:
    """The port of the atropos-serve this run started: from the command line quickstart
    writes into its log (what the log held before this run, ``offset`` bytes, is skipped), so
    that no other server on the machine is taken for it."""
    while not stop.is_set() and quickstart.poll() is None:
        if log.is_file():
            with open(log, "rb") as handle:
                handle.seek(offset)
                found = re.search(rb"^\$ .*--port (\d+)", handle.read(), re.MULTILINE)
            if found:
                return found.group(1).decode()
        time.sleep(0.5)
    return None


def poll(
    quickstart: subprocess.Popen,
    server_log: tuple[Path, int],
    samples: list[dict],
    stop: threading.Event,
) -> None:
    port = _server_port(*server_log, quickstart, stop)
    if port is None:
        return
    seen = False
    with httpx.Client(timeout=2.0) as client:
        while not stop.is_set():
            try:
                body = client.get(f"http://127.0.0.1:{port}/health").json()
            except httpx.HTTPError:
                if seen:
                    return  # the server is gone: the run ended
                time.sleep(0.2)
                continue
            seen = True
            stats = body.get("stats", {})
            samples.append(
                {
                    "t": time.time(),
                    "paused": bool(body.get("paused")),
                    "running": body.get("running", 0),
                    "waiting": body.get("waiting", 0),
                    "steps": stats.get("steps", 0),
                    "requests": stats.get("requests", 0),
                    "weights": body.get("weights_version"),
                }
            )
            time.sleep(0.05)


def report(samples: list[dict], stall: float) -> None:
    if not samples:
        print("no samples: the server never answered /health")
        return
    t0 = samples[0]["t"]
    stretches, current = [], None
    for sample in samples:
        if sample["paused"]:
            if current:
                stretches.append(current)
            current = None
        elif current is None:
            current = [sample, sample]
        else:
            current[1] = sample
    print("generating between two pauses (the first is start-up):")
    print(" start s | seconds | decode steps | requests")
    for first, last in stretches[1:]:
        print(
            f"{first['t'] - t0:8.1f} | {last['t'] - first['t']:7.2f} | "
            f"{last['steps'] - first['steps']:12d} | {last['requests'] - first['requests']:8d}"
        )
    stalls = []
    i = 0
    while i < len(samples):
        first = samples[i]
        j = i
        while (
            j + 1 < len(samples)
            and not samples[j + 1]["paused"]
            and samples[j + 1]["steps"] == first["steps"]
            and samples[j + 1]["requests"] == first["requests"]
        ):
            j += 1
        busy = first["running"] or first["waiting"]
        if not first["paused"] and busy and samples[j]["t"] - first["t"] >= stall:
            stalls.append((first, samples[j]["t"] - first["t"]))
        i = j + 1
    print(f"\nstalls (>= {stall} s not paused, work queued, no step and no prefill):")
    for first, seconds in stalls:
        print(
            f"  at {first['t'] - t0:6.1f} s: {seconds:.2f} s with {first['running']} rows "
            f"running, {first['waiting']} requests waiting"
        )
    print(f"total {sum(s for _, s in stalls):.1f} s in {len(stalls)} stalls")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="/tmp/serve-timeline", help="quickstart --output")
    parser.add_argument("--stall", type=float, default=0.25, help="shortest stall reported (s)")
    parser.add_argument("--json", help="also write the samples here")
    args, rest = parser.parse_known_args()
    extra = rest[1:] if rest[:1] == ["--"] else rest
    command = ["atropos-quickstart", *(extra or DEFAULT_QUICKSTART), "--output", args.output]
    log = Path(args.output + ".log")
    print("$", " ".join(command), f"> {log}", flush=True)
    server_log = Path(args.output) / "logs" / "atropos-serve.log"
    offset = server_log.stat().st_size if server_log.is_file() else 0
    with open(log, "w") as handle:
        quickstart = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT)
        samples: list[dict] = []
        stop = threading.Event()
        poller = threading.Thread(
            target=poll, args=(quickstart, (server_log, offset), samples, stop), daemon=True
        )
        poller.start()
        code = quickstart.wait()
        stop.set()
        poller.join(timeout=5)
    if args.json:
        Path(args.json).write_text("\n".join(json.dumps(s) for s in samples) + "\n")
    report(samples, args.stall)
    if code:
        print(f"atropos-quickstart exited with {code}; see {log}", file=sys.stderr)
        raise SystemExit(code)


if __name__ == "__main__":
    main()
