#!/usr/bin/env python
"""Scale figures for one ``run-api``: N real environment processes posting through it.

For each N in ``--workers`` (default 1, 8, 32, 64) the bench starts, fresh, on free loopback
ports:

* a stand-in inference server that answers every chat request at once with ``n`` fixed
  choices (the stub of ``bench/env_overhead.py``: raw asyncio HTTP, pre-encoded replies);
* one ``run-api`` (``python -m atroposlib.cli.run_api``);
* a trainer process pulling ``/batch`` with no pause through
  :class:`atroposlib.api.client.TrainerClient` (acknowledging each batch), so the queue drains;
* N env processes, ``python bench/scale_env.py serve --env.rollout_server_url ...
  --openai.base_url ...``: real ``BaseEnv`` runtimes with the real group sender (coalescing,
  gzip, retries), each with ``--env-workers`` rollouts in flight, sending groups of
  ``--group-size`` sequences of ``--seq-len`` tokens.

Once every env has had a group accepted, it waits ``--warmup`` seconds and measures a window of
``--seconds``: groups/s accepted and batches/s served (``/metrics`` counters), the latency of
each ``POST /scored_data(_list)`` as the env's HTTP client saw it (p50/p99/max, from hooks in
``scale_env.py``; ``/metrics`` has no latency histograms), refusals and drops by reason (API
``/metrics`` and the envs' own counters), CPU (user+system seconds per second of wall time, from
``/proc``) of the API (with any children), of all envs together, of the trainer and of the
stub, the machine's busy cores (``/proc/stat``, other users included), and the API's RSS peak.

``--pin`` runs the API alone on CPU 0 and everything else on CPU 1 (``sched_setaffinity``), so
that the API's figures are those of one core it does not share with the bench's own processes
(other users of the machine are not kept off it). Without it every process floats over all
cores and at large N the envs take most of them.

    python bench/api_scale.py                       # N = 1, 8, 32, 64
    python bench/api_scale.py --workers 1,8 --seconds 10 --pin --json /tmp/scale.json

Each env process takes ~100-150 MiB resident; the bench refuses an N whose envs would not fit
in the available memory (``MemAvailable``) with a margin.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
ENV_FILE = HERE.parent / "scale_env.py"
STUB_FILE = HERE.parent / "env_overhead.py"
#: Memory budgeted per env process when checking that N of them fit, by ``--spawn``.
ENV_MEMORY = {"fork": 150 << 20, "exec": 350 << 20}
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------- /proc readings


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _children(pid: int) -> list[int]:
    """All descendants of ``pid``."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds of each of ``pids`` that still exists."""
    out = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def rss_bytes(pids: list[int]) -> int:
    """Summed resident memory of ``pids``."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def pss_bytes(pids: list[int]) -> int:
    """Summed proportional set size of ``pids`` (shared pages split among their users)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def busy_jiffies() -> tuple[int, int]:
    """``(busy, total)`` jiffies of all CPUs since boot (``/proc/stat``)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def mem_available() -> int:
    """``MemAvailable`` in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (nearest rank) of ``values``, or None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


# ---------------------------------------------------------------------------- the trainer


def _trainer_main(url: str, batch_size: int) -> None:
    """Register as the trainer and pull batches as fast as they come, until killed."""
    from atroposlib.api.client import TrainerClient

    client = TrainerClient(url)
    client.reset()
    client.register(
        batch_size=batch_size,
        max_token_len=1 << 20,
        checkpoint_dir="",
        save_checkpoint_interval=-1,
        starting_step=0,
        num_steps=10**9,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        if not client.try_batch():
            time.sleep(0.005)


# ---------------------------------------------------------------------------- one run


class Run:
    """The processes of one N: stub, run-api, trainer, envs; stopped by :meth:`stop`."""

    def __init__(self, args: argparse.Namespace, n_envs: int, workdir: Path) -> None:
        self.args, self.n, self.workdir = args, n_envs, workdir
        self.procs: list[subprocess.Popen] = []
        self.env_procs: list[subprocess.Popen] = []  # --spawn exec
        self.envs: list[int] = []  # the env processes' pids, once all are up
        self.logs: list[Path] = []
        self.stub_port, self.api_port = _free_port(), _free_port()
        self.api_url = f"http://127.0.0.1:{self.api_port}"
        self.http = httpx.Client(base_url=self.api_url, timeout=10)
        # every setting comes from the bench's flags, none from ATROPOS_* in the caller's env
        self.base_env = {k: v for k, v in os.environ.items() if not k.startswith("ATROPOS_")}
        self.base_env.update(PYTHONPATH=str(REPO), WANDB_MODE="disabled", HF_HUB_OFFLINE="1")

    def _spawn(self, argv: list[str], cpu: int | None, log: Path, env: dict | None = None):
        def pin() -> None:
            if cpu is not None:
                os.sched_setaffinity(0, {cpu})

        out = open(log, "wb")  # noqa: SIM115 - the child keeps it; closed when we exit
        proc = subprocess.Popen(
            argv,
            cwd=str(REPO),
            env={**self.base_env, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=pin,
            start_new_session=True,
        )
        out.close()
        return proc

    def start(self) -> None:
        """Start everything; return once every env has had a group accepted."""
        args, wd = self.args, self.workdir
        api_cpu = 0 if args.pin else None
        rest_cpu = 1 if args.pin else None
        py = sys.executable
        self.stub = self._spawn(
            [py, str(STUB_FILE), "_stub", str(self.stub_port)], rest_cpu, wd / "stub.log"
        )
        self.api = self._spawn(
            [
                py,
                "-m",
                "atroposlib.cli.run_api",
                "--port",
                str(self.api_port),
                "--log-level",
                "warning",
                *args.api_flag,
            ],
            api_cpu,
            wd / "api.log",
        )
        self.procs += [self.stub, self.api]
        self._wait_http(self.api_url + "/health", self.api, wd / "api.log")
        self.trainer = self._spawn(
            [py, str(HERE), "_trainer", self.api_url, str(args.batch_size)],
            rest_cpu,
            wd / "trainer.log",
        )
        self.procs.append(self.trainer)
        deadline = time.monotonic() + 60
        while not self.http.get("/health").json().get("registered"):
            if time.monotonic() > deadline or self.trainer.poll() is not None:
                raise RuntimeError("the trainer did not register:\n" + _tail(wd / "trainer.log"))
            time.sleep(0.1)
        env_argv = [
            py, str(ENV_FILE), "serve",
            "--env.rollout_server_url", self.api_url,
            "--openai.base_url", f"http://127.0.0.1:{self.stub_port}/v1",
            "--env.group_size", str(args.group_size),
            "--env.seq_len", str(args.seq_len),
            "--env.max_num_workers", str(args.env_workers),
            "--env.batch_size", str(args.batch_size),
            "--env.max_batches_offpolicy", str(args.offpolicy),
        ]  # fmt: skip
        self.logs = [wd / f"env{i}.lat" for i in range(self.n)]
        if args.spawn == "fork":
            self.launcher = self._spawn(
                [py, str(ENV_FILE), "fork", str(self.n), *env_argv[2:]],
                rest_cpu,
                wd / "envs.log",
                {"SCALE_BENCH_LOG": str(wd / "env{i}.lat")},
            )
            self.procs.append(self.launcher)
            env_logs = [wd / "envs.log"]
        else:
            for i in range(self.n):
                self.env_procs.append(
                    self._spawn(
                        env_argv,
                        rest_cpu,
                        wd / f"env{i}.log",
                        {"SCALE_BENCH_LOG": str(self.logs[i])},
                    )
                )
            self.procs += self.env_procs
            env_logs = [wd / f"env{i}.log" for i in range(self.n)]
        deadline = time.monotonic() + args.startup_timeout
        while True:
            envs = self.metrics()["envs"]
            if len(envs) >= self.n and all(e["accepted_groups"] > 0 for e in envs):
                break
            for proc, log in zip(self.procs[3:], env_logs, strict=True):
                if proc.poll() is not None:
                    raise RuntimeError(f"an env exited with {proc.returncode}:\n" + _tail(log))
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"only {sum(e['accepted_groups'] > 0 for e in envs)} of {self.n} envs had a "
                    f"group accepted after {args.startup_timeout:.0f} s"
                )
            time.sleep(0.5)
        if args.spawn == "fork":
            self.envs = _children(self.launcher.pid)
        else:
            self.envs = [p.pid for p in self.env_procs]
        if len(self.envs) != self.n:
            raise RuntimeError(f"{len(self.envs)} env processes running, {self.n} expected")

    def _wait_http(self, url: str, proc: subprocess.Popen, log: Path) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{url}: process exited:\n" + _tail(log))
            try:
                httpx.get(url, timeout=1)
                return
            except httpx.TransportError:
                time.sleep(0.1)
        raise RuntimeError(f"{url} did not answer in 60 s")

    def metrics(self) -> dict[str, Any]:
        """``GET /metrics?format=json``."""
        return self.http.get("/metrics", params={"format": "json"}).json()

    def snapshot(self) -> dict[str, Any]:
        """Counters and CPU times at one instant."""
        api_pids = [self.api.pid, *_children(self.api.pid)]
        env_pids = self.envs
        return {
            "t": time.monotonic(),
            "wall": time.time(),
            "metrics": self.metrics(),
            "api_cpu": cpu_seconds(api_pids),
            "env_cpu": cpu_seconds(env_pids),
            "trainer_cpu": cpu_seconds([self.trainer.pid]),
            "stub_cpu": cpu_seconds([self.stub.pid]),
            "busy": busy_jiffies(),
            "api_pids": api_pids,
        }

    def measure(self) -> dict[str, Any]:
        """Warm up, then measure one window; the row for this N."""
        args = self.args
        time.sleep(args.warmup)
        a = self.snapshot()
        rss_peak = 0
        while time.monotonic() - a["t"] < args.seconds:
            rss_peak = max(rss_peak, rss_bytes([self.api.pid, *_children(self.api.pid)]))
            time.sleep(0.25)
        b = self.snapshot()
        env_rss = rss_bytes(self.envs)
        env_pss = pss_bytes(self.envs)
        dt = b["t"] - a["t"]

        def cores(key: str) -> float:
            return sum(b[key][p] - a[key].get(p, 0.0) for p in b[key]) / dt

        ma, mb = a["metrics"], b["metrics"]
        groups = mb["accepted_groups"] - ma["accepted_groups"]
        latencies, statuses, posts_by_path = [], {}, {}
        env_drops: dict[str, int] = {}
        for log in self.logs:
            last_drops = None
            for line in log.read_text().splitlines() if log.exists() else []:
                if line.startswith("# drops"):
                    last_drops = line
                    continue
                wall, seconds, status, path = line.split()
                if a["wall"] <= float(wall) < b["wall"]:
                    latencies.append(float(seconds))
                    statuses[status] = statuses.get(status, 0) + 1
                    posts_by_path[path] = posts_by_path.get(path, 0) + 1
            if last_drops:
                for reason, count in json.loads(
                    last_drops.split(" ", 2)[2].rsplit(" ", 1)[0]
                ).items():
                    env_drops[reason] = env_drops.get(reason, 0) + count

        def delta(kind: str) -> dict[str, int]:
            return {
                k: v - ma[kind].get(k, 0) for k, v in mb[kind].items() if v - ma[kind].get(k, 0)
            }

        busy = (b["busy"][0] - a["busy"][0]) / max(1, b["busy"][1] - a["busy"][1])
        posts = len(latencies)
        api_cores = cores("api_cpu")
        return {
            "workers": self.n,
            "seconds": round(dt, 2),
            "groups_per_s": groups / dt,
            "sequences_per_s": (mb["accepted_sequences"] - ma["accepted_sequences"]) / dt,
            "batches_per_s": (mb["batches_served"] - ma["batches_served"]) / dt,
            "posts_per_s": posts / dt,
            "groups_per_post": groups / posts if posts else None,
            "post_p50_ms": _ms(percentile(latencies, 50)),
            "post_p99_ms": _ms(percentile(latencies, 99)),
            "post_max_ms": _ms(max(latencies) if latencies else None),
            "post_statuses": statuses,
            "posts_by_path": posts_by_path,
            "api_cores": api_cores,
            "api_cpu_ms_per_group": 1000 * api_cores / (groups / dt) if groups else None,
            "api_rss_mib": rss_peak / 2**20,
            "api_processes": len(b["api_pids"]),
            "env_cores": cores("env_cpu"),
            "env_rss_mib_each": env_rss / 2**20 / max(1, len(self.envs)),
            "env_pss_mib_each": env_pss / 2**20 / max(1, len(self.envs)),
            "trainer_cores": cores("trainer_cpu"),
            "stub_cores": cores("stub_cpu"),
            "machine_busy_cores": busy * (os.cpu_count() or 1),
            "queue_groups_end": mb["queue_groups"],
            "refused": delta("refused"),
            "dropped": delta("dropped"),
            "env_drops": env_drops,
            "load_average": os.getloadavg()[0],
        }

    def stop(self) -> None:
        """SIGTERM everything this run started (envs first), then SIGKILL what is left."""
        for proc in reversed(self.procs):  # envs first, stub last
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.http.close()


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ---------------------------------------------------------------------------- report


def _fmt(value: Any, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _reasons(counts: dict[str, int]) -> str:
    return ",".join(f"{k}:{v}" for k, v in sorted(counts.items())) or "0"


def print_table(rows: list[dict[str, Any]]) -> None:
    """The rows as a Markdown table."""
    head = (
        "| envs | groups/s | batches/s | posts/s | POST p50 ms | POST p99 ms | API cores "
        "| API ms/group | API RSS MiB | env cores | trainer+stub cores | machine busy "
        "| refused | dropped | env drops |"
    )
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        print(
            f"| {r['workers']} | {r['groups_per_s']:.1f} | {r['batches_per_s']:.2f} "
            f"| {r['posts_per_s']:.1f} | {_fmt(r['post_p50_ms'])} | {_fmt(r['post_p99_ms'])} "
            f"| {r['api_cores']:.2f} | {_fmt(r['api_cpu_ms_per_group'], '.2f')} "
            f"| {r['api_rss_mib']:.0f} | {r['env_cores']:.2f} "
            f"| {r['trainer_cores'] + r['stub_cores']:.2f} | {r['machine_busy_cores']:.2f} "
            f"| {_reasons(r['refused'])} | {_reasons(r['dropped'])} | {_reasons(r['env_drops'])} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="1,8,32,64", help="Env process counts, e.g. 1,8")
    parser.add_argument("--seconds", type=float, default=20.0, help="Measured window per N")
    parser.add_argument("--warmup", type=float, default=5.0, help="Seconds before the window")
    parser.add_argument("--group-size", type=int, default=8, help="Sequences per group")
    parser.add_argument("--seq-len", type=int, default=1024, help="Tokens per sequence")
    parser.add_argument("--env-workers", type=int, default=4, help="Rollouts in flight per env")
    parser.add_argument("--batch-size", type=int, default=64, help="Trainer batch (sequences)")
    parser.add_argument(
        "--offpolicy",
        type=int,
        default=16,
        help="Envs' max_batches_offpolicy: they stop starting rollouts while the queue holds "
        "this many batches, so a trainer slower than the envs sets the pace (0: no limit)",
    )
    parser.add_argument(
        "--spawn",
        choices=["fork", "exec"],
        default="fork",
        help="fork: the envs are forked from one process after the imports, sharing their "
        "memory (~330 MiB each otherwise); exec: each env is its own `python scale_env.py serve`",
    )
    parser.add_argument("--pin", action="store_true", help="API on CPU 0, the rest on CPU 1")
    parser.add_argument(
        "--api-flag",
        action="append",
        default=[],
        help="Extra run-api argument (repeat; e.g. --api-flag=--gzip-level --api-flag=3)",
    )
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--json", metavar="PATH", help="Also write the rows (and setup) as JSON")
    parser.add_argument("--keep-logs", action="store_true", help="Keep the logs folder")
    args = parser.parse_args()
    try:
        counts = [int(n) for n in args.workers.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--workers must be comma-separated integers, got {args.workers!r}")
    if not counts or min(counts) < 1:
        parser.error("--workers needs at least one count, each >= 1")
    if args.pin and (os.cpu_count() or 1) < 2:
        parser.error("--pin needs at least 2 CPUs")

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    setup = {
        "date": datetime.date.today().isoformat(),
        "commit": commit or None,
        "cpus": os.cpu_count(),
        "pinned": args.pin,
        "spawn": args.spawn,
        "group_size": args.group_size,
        "seq_len": args.seq_len,
        "env_workers": args.env_workers,
        "batch_size": args.batch_size,
        "offpolicy": args.offpolicy,
        "seconds": args.seconds,
        "warmup": args.warmup,
        "api_flags": args.api_flag,
    }
    print(
        f"# {setup['date']} commit {commit}, {os.cpu_count()} CPUs, "
        f"{'API pinned to CPU 0, the rest to CPU 1' if args.pin else 'no pinning'}; groups of "
        f"{args.group_size} x {args.seq_len} tokens, {args.env_workers} rollouts in flight per "
        f"env, batches of {args.batch_size}; {args.seconds:g} s window after {args.warmup:g} s",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    workdir = Path(tempfile.mkdtemp(prefix="api-scale-"))
    try:
        for n in counts:
            budget = ENV_MEMORY[args.spawn]
            need, have = n * budget + (1 << 30), mem_available()
            if need > have:
                print(f"skipping {n} envs: ~{need >> 20} MiB needed, {have >> 20} MiB available")
                continue
            rundir = workdir / f"n{n}"
            rundir.mkdir()
            run = Run(args, n, rundir)
            started = time.monotonic()
            try:
                run.start()
                print(f"{n} envs up in {time.monotonic() - started:.1f} s", flush=True)
                row = run.measure()
            finally:
                run.stop()
            rows.append(row)
            print(
                f"{n} envs: {row['groups_per_s']:.1f} groups/s, POST p99 "
                f"{_fmt(row['post_p99_ms'])} ms, API {row['api_cores']:.2f} cores",
                flush=True,
            )
    finally:
        if args.keep_logs:
            print(f"logs in {workdir}")
        else:
            subprocess.run(["rm", "-rf", str(workdir)], check=False)
    print()
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"setup": setup, "rows": rows}, indent=2) + "\n")
    if len(rows) < len(counts):
        sys.exit(1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_trainer":
        _trainer_main(sys.argv[2], int(sys.argv[3]))
    else:
        main()
