"""Helpers for env tests: a trainer-like client of the trajectory API and env subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
COUNTING_ENV = HERE / "counting_env.py"
ARITHMETIC_ENV = REPO / "environments" / "arithmetic_server.py"


class Trainer:
    """Registers like a trainer and pulls ``/batch``."""

    def __init__(self, url: str, batch_size: int, max_token_len: int = 512, num_steps: int = 1000):
        self.url = url
        self.batch_size = batch_size
        self.max_token_len = max_token_len
        self.num_steps = num_steps
        self.client = httpx.Client(base_url=url, timeout=10.0)
        self.batches: list[list[dict[str, Any]]] = []

    def register(self) -> None:
        reply = self.client.post(
            "/register",
            json={
                "wandb_group": "test",
                "wandb_project": "test",
                "batch_size": self.batch_size,
                "max_token_len": self.max_token_len,
                "checkpoint_dir": "",
                "save_checkpoint_interval": -1,
                "starting_step": 0,
                "num_steps": self.num_steps,
            },
        )
        reply.raise_for_status()
        # the first /batch flips "started" so envs may register
        reply = self.client.get("/batch")
        reply.raise_for_status()
        if reply.json().get("batch"):
            self.batches.append(reply.json()["batch"])

    def pull(self, n_batches: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
        """Pull until ``n_batches`` more batches arrived (fails after ``timeout`` seconds)."""
        target = len(self.batches) + n_batches
        deadline = time.monotonic() + timeout
        while len(self.batches) < target:
            assert time.monotonic() < deadline, f"only {len(self.batches)} of {target} batches"
            if proc is not None and proc.poll() is not None and n_batches > 0:
                # the env may exit once everything is queued; keep draining
                pass
            batch = self.client.get("/batch").json().get("batch")
            if batch:
                self.batches.append(batch)
            else:
                time.sleep(0.05)

    def drain(self) -> None:
        while True:
            batch = self.client.get("/batch").json().get("batch")
            if not batch:
                return
            self.batches.append(batch)

    def groups(self) -> list[dict[str, Any]]:
        return [g for b in self.batches for g in b]

    def close(self) -> None:
        self.client.close()


def env_environ(**extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "PYTHONPATH": str(REPO),
    }
    env.update(extra)
    return env


def start_env(
    script: Path,
    command: str,
    *flags: str,
    log: Path,
    python: str = sys.executable,
    cwd: Path | None = None,
    extra_env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """Start ``python script command flags...`` with its output in ``log``."""
    out = open(log, "ab")  # noqa: SIM115 - the child holds it; closed by the OS at exit
    return subprocess.Popen(
        [python, str(script), command, *flags],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env_environ(**(extra_env or {})),
        cwd=str(cwd or REPO),
    )


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def wandb_offline_history(wandb_dir: Path) -> list[dict[str, Any]]:
    """The rows an offline W&B run logged (``wandb.log`` calls, in order), read from the one
    ``offline-run-*/run-*.wandb`` file under ``wandb_dir``: W&B's record log (LevelDB log
    framing: 32 KiB blocks of chunks with a 7-byte header) of ``wandb_internal_pb2.Record``."""
    import json
    import struct

    from wandb.proto import wandb_internal_pb2

    files = list(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    data = files[0].read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    rows: list[dict[str, Any]] = []
    pos, block, record = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:  # padding
            continue
        record = chunk if kind in (1, 2) else record + chunk  # full/first, middle/last
        if kind in (1, 4):
            parsed = wandb_internal_pb2.Record()
            parsed.ParseFromString(record)
            if parsed.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        item.key or "/".join(item.nested_key): json.loads(item.value_json)
                        for item in parsed.history.item
                    }
                )
    return rows
