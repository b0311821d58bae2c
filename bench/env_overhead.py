"""Runtime overhead of ``BaseEnv``: ours vs upstream atroposlib 0.4.0, side by side.

One env file (``BenchEnv`` below, public API only) runs under each library's ``serve`` with the
same config (``group_size=4``, ``max_num_workers=--workers``, no W&B) against the same servers:

* a stub OpenAI server (benchmark-only; raw asyncio HTTP with pre-encoded answers, about
  0.05 ms CPU per request) that answers every ``/v1/chat/completions`` instantly with ``n``
  fixed choices, and ``GET /policy_version`` with 0 (so ours stamps every group);
* our ``run-api``, drained by a trainer-like thread (the "puller") pulling ``/batch``.

A rollout is one group: one chat request with ``n=group_size``, trivial scoring, one send.
Each library gets ``--rounds`` windows of ``--seconds``, alternating ours/upstream so that
drifting machine load hits both alike, each window starting one second after the first group
reached the API. Per window: groups per second reaching the API, the env process's own CPU
time per group (user+sys of that process only, from /proc), and for context the CPU per group
of the stub, of run-api and of the harness (puller). The medians over rounds are compared with
the targets (>= 3x upstream's rollouts/s, < 1 ms env CPU per rollout).

Run from the repository root with the project venv (upstream in its own venv, run from ``/``
so it does not import this checkout)::

    python bench/env_overhead.py [--seconds 15] [--rounds 2] [--workers 64]
        [--upstream-python /tmp/upstream-venv/bin/python] [--profile DIR]

``--profile DIR`` also records each env process with py-spy (collapsed stacks in
``DIR/<library>.txt``). Env logs go to ``/tmp/env_overhead_<library>.log``.

``--baseline-repo DIR`` adds a third library, ``baseline``: our package as found in ``DIR``
(e.g. an older revision: ``git archive REV atroposlib | tar -x -C DIR``), for before/after.

Notes: upstream's ``env_manager`` polls ``/status-env`` and sleeps 0.1 s per loop before
refilling workers; ours refills a worker the moment one finishes. With ``--workers 256``
upstream's rate did not change, so it is bound by its CPU per rollout, not the worker count.

Measured on the shared 2-core workstation (load average 0.8-1.7, other engineers' jobs
running), 2026-11-23, ``--seconds 10 --rounds 2 --baseline-repo`` (the revision before the lean
OpenAI request path, db00061), medians:

    ours       2694 rollouts/s   0.36 ms env CPU per rollout
    upstream    191 rollouts/s   4.30 ms               -> 14.1x upstream's rollouts/s
    baseline    301 rollouts/s   3.32 ms  (ours before: 1.6x upstream)

(stub 0.03-0.15 ms, run-api 0.1-0.65 ms, puller 0.07-0.64 ms CPU per rollout alongside.)
The profile before showed about 75% of the env's CPU in the OpenAI SDK's request pipeline
(httpx connection-pool scans, request transforms, lenient response construction at about
0.3 ms per ``ChatCompletion``) and tenacity's per-call retry machinery; see
``atroposlib/envs/server_handling/openai_server.py`` for the lean path that replaced it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]


# ---------------------------------------------------------------------------- the env


def _bench_env_main(argv: list[str]) -> None:
    from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup

    class BenchEnv(BaseEnv):
        name = "bench"

        @classmethod
        def config_init(cls):
            return BaseEnvConfig(
                tokenizer_name=os.environ["BENCH_TOKENIZER"],
                group_size=4,
                use_wandb=False,
                wandb_name="bench",
                max_token_length=64,
                total_steps=10**9,
                max_num_workers=int(os.environ.get("BENCH_WORKERS", "64")),
                max_batches_offpolicy=1000,
                ensure_scores_are_not_same=False,
            ), [
                APIServerConfig(
                    base_url=os.environ["BENCH_STUB_URL"],
                    api_key="x",
                    model_name="stub",
                    health_check=False,
                )
            ]

        async def setup(self):
            self.i = 0

        async def get_next_item(self):
            self.i += 1
            return self.i

        async def collect_trajectories(self, item):
            reply = await self.server.chat_completion(
                messages=[{"role": "user", "content": f"q{item}"}],
                n=self.config.group_size,
                max_tokens=4,
            )
            group = ScoredDataGroup()
            group["tokens"] = [[1, 2, 3, item % 1000, i] for i in range(len(reply.choices))]
            group["masks"] = [[-100, -100, 3, item % 1000, i] for i in range(len(reply.choices))]
            group["scores"] = [float(len(c.message.content or "")) for c in reply.choices]
            return group, []

        async def evaluate(self, *args, **kwargs):
            return None

    sys.argv = [sys.argv[0], *argv]
    BenchEnv.cli()


# ---------------------------------------------------------------------------- the stub server


def _stub_response(n: int) -> bytes:
    """The whole pre-encoded HTTP response for a request with ``n`` choices."""
    payload = json.dumps(
        {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": "stub",
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": "4" * (i + 1)},
                    "finish_reason": "stop",
                }
                for i in range(n)
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": 1 + n},
        }
    ).encode()
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
        + str(len(payload)).encode()
        + b"\r\n\r\n"
        + payload
    )


_VERSION_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 20\r\n\r\n"
    b'{"policy_version":0}'
)


def _stub_main(port: int) -> None:
    responses: dict[int, bytes] = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = json.loads(await reader.readexactly(length)) if length else {}
                if head.startswith(b"GET /policy_version "):  # a versioned server, as ours
                    writer.write(_VERSION_RESPONSE)
                    await writer.drain()
                    continue
                n = int(body.get("n") or 1)
                response = responses.get(n)
                if response is None:
                    response = responses[n] = _stub_response(n)
                writer.write(response)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# ---------------------------------------------------------------------------- harness


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, timeout: float = 30) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Puller(threading.Thread):
    """Registers as the trainer and pulls batches, counting sequences."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        import httpx

        self.client = httpx.Client(base_url=url, timeout=10)
        self.sequences = 0
        self.first_seen: float | None = None
        self.stop_flag = False
        self.client.get("/reset_data")
        self.client.post(
            "/register",
            json={
                "wandb_group": "bench",
                "wandb_project": "bench",
                "batch_size": 64,
                "max_token_len": 512,
                "checkpoint_dir": "",
                "save_checkpoint_interval": -1,
                "starting_step": 0,
                "num_steps": 10**9,
            },
        ).raise_for_status()
        self.client.get("/batch")

    def run(self) -> None:
        while not self.stop_flag:
            batch = self.client.get("/batch").json().get("batch")
            if batch:
                if self.first_seen is None:
                    self.first_seen = time.monotonic()
                self.sequences += sum(len(g["tokens"]) for g in batch)
            else:
                time.sleep(0.01)

    def queued_sequences(self) -> int:
        return int(self.client.get("/status").json()["queue_size"]) * 4


def measure(
    label: str,
    python: str,
    api_url: str,
    stub_url: str,
    tokenizer: str,
    seconds: float,
    cwd: str,
    profile_dir: str | None = None,
    others: dict[str, int] | None = None,
    workers: int = 64,
) -> dict:
    """One library's window: rollouts/s, and CPU ms per rollout of the env process and (for
    context) of the other processes in ``others`` (label -> pid)."""
    others = {**(others or {}), "harness": os.getpid()}
    puller = Puller(api_url)
    puller.start()
    env = {
        **os.environ,
        "BENCH_STUB_URL": stub_url,
        "BENCH_TOKENIZER": tokenizer,
        "BENCH_WORKERS": str(workers),
        "WANDB_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": "" if label == "upstream" else cwd,
    }
    log = open(f"/tmp/env_overhead_{label}.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [python, str(HERE), "_env", "serve", "--env.rollout_server_url", api_url],
        env=env,
        cwd=cwd,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while puller.first_seen is None:
            if proc.poll() is not None:
                raise RuntimeError(f"{label} env exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{label}: no data after 120 s")
            time.sleep(0.05)
        time.sleep(1.0)  # warm-up
        profiler = None
        if profile_dir:
            profiler = subprocess.Popen(
                [
                    "py-spy",
                    "record",
                    "--nonblocking",
                    "-f",
                    "raw",
                    "-r",
                    "200",
                    "-d",
                    str(int(seconds)),
                    "-o",
                    f"{profile_dir}/{label}.txt",
                    "--pid",
                    str(proc.pid),
                ],
                stdout=subprocess.DEVNULL,
            )
        seq0, cpu0, t0 = (
            puller.sequences + puller.queued_sequences(),
            _cpu_seconds(proc.pid),
            time.monotonic(),
        )
        other0 = {k: _cpu_seconds(pid) for k, pid in others.items()}
        time.sleep(seconds)
        seq1, cpu1, t1 = (
            puller.sequences + puller.queued_sequences(),
            _cpu_seconds(proc.pid),
            time.monotonic(),
        )
        other1 = {k: _cpu_seconds(pid) for k, pid in others.items()}
        if profiler is not None:
            profiler.wait(30)
    finally:
        proc.kill()
        proc.wait()
        log.close()
        puller.stop_flag = True
        puller.join(5)
    groups = (seq1 - seq0) / 4
    return {
        "library": label,
        "rollouts_per_s": groups / (t1 - t0),
        "cpu_ms_per_rollout": 1000 * (cpu1 - cpu0) / max(groups, 1),
        "groups": groups,
        **{f"{k}_ms": 1000 * (other1[k] - other0[k]) / max(groups, 1) for k in others},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="Measuring window per library")
    parser.add_argument("--upstream-python", default="/tmp/upstream-venv/bin/python")
    parser.add_argument(
        "--baseline-repo",
        metavar="DIR",
        help="Also measure the atroposlib in DIR (e.g. `git archive <rev> atroposlib` unpacked)",
    )
    parser.add_argument(
        "--workers", type=int, default=64, help="max_num_workers of the env (both libraries)"
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="Alternating windows per library (median kept)"
    )
    parser.add_argument(
        "--profile", metavar="DIR", help="py-spy the env process into DIR/<library>.txt"
    )
    args = parser.parse_args()

    from atroposlib.inference.models import smollm2_tokenizer_dir

    tokenizer = str(smollm2_tokenizer_dir())
    stub_port, api_port = _free_port(), _free_port()
    children = [
        subprocess.Popen([sys.executable, str(HERE), "_stub", str(stub_port)]),
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "atroposlib.cli.run_api",
                "--port",
                str(api_port),
                "--log-level",
                "warning",
                "--max-queue-sequences",
                "10000000",
            ],
            cwd=str(REPO),
        ),
    ]
    api_url, stub_url = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{stub_port}/v1"
    others = {"stub": children[0].pid, "api": children[1].pid}
    libraries = [("ours", sys.executable, str(REPO))]
    if Path(args.upstream_python).exists():
        libraries.append(("upstream", args.upstream_python, "/"))
    else:
        print(f"no upstream python at {args.upstream_python}: measuring ours only")
    if args.baseline_repo:
        libraries.append(("baseline", sys.executable, str(Path(args.baseline_repo).resolve())))
    rows: list[dict] = []
    try:
        _wait_http(api_url + "/info")
        _wait_http(f"http://127.0.0.1:{stub_port}/")
        for _ in range(args.rounds):  # alternate, so drifting machine load hits both alike
            for label, python, cwd in libraries:
                rows.append(
                    measure(
                        label,
                        python,
                        api_url,
                        stub_url,
                        tokenizer,
                        args.seconds,
                        cwd,
                        args.profile,
                        others,
                        args.workers,
                    )
                )
    finally:
        for child in children:
            child.kill()
            child.wait()
    header = (
        f"{'library':<10} {'rollouts/s':>11} {'env CPU ms/rollout':>19} {'groups':>7}"
        f" {'stub ms':>8} {'api ms':>7} {'puller ms':>9}"
    )
    print(header)
    for row in rows:
        print(
            f"{row['library']:<10} {row['rollouts_per_s']:>11.1f} "
            f"{row['cpu_ms_per_rollout']:>19.2f} {row['groups']:>7.0f} {row['stub_ms']:>8.2f}"
            f" {row['api_ms']:>7.2f} {row['harness_ms']:>9.2f}"
        )
    medians = {
        label: (
            statistics.median(r["rollouts_per_s"] for r in rows if r["library"] == label),
            statistics.median(r["cpu_ms_per_rollout"] for r in rows if r["library"] == label),
        )
        for label, _, _ in libraries
    }
    print("median over rounds:")
    for label, (rate, cpu) in medians.items():
        print(f"  {label:<10} {rate:>8.1f} rollouts/s {cpu:>8.2f} env CPU ms/rollout")
    if "upstream" in medians:
        ratio = medians["ours"][0] / max(medians["upstream"][0], 1e-9)
        print(
            f"speed-up: {ratio:.1f}x rollouts/s (target >= 3x); "
            f"ours {medians['ours'][1]:.2f} ms CPU per rollout (target < 1 ms)"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_env":
        _bench_env_main(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "_stub":
        _stub_main(int(sys.argv[2]))
    else:
        random.seed(0)
        main()
