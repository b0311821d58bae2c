"""Wire interop with upstream atroposlib 0.4.0 (its own virtualenv: ``ATROPOS_UPSTREAM_PYTHON``,
default /tmp/upstream-venv/bin/python; `.ci/run` creates it): the same env file runs with
upstream's library against our run-api, and with ours against upstream's run-api; every group
arrives, none twice."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.envs.helpers import COUNTING_ENV, Trainer, env_environ, start_env, stop

UPSTREAM_PY = Path(os.environ.get("ATROPOS_UPSTREAM_PYTHON", "/tmp/upstream-venv/bin/python"))
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not UPSTREAM_PY.exists(),
        reason=f"upstream atroposlib 0.4.0 virtualenv not found at {UPSTREAM_PY} (see .ci/run)",
    ),
]
N_ITEMS = 12  # groups of 2, batches of 4: 6 batches


def _run_env(python: str, api_url: str, tokenizer: Path, log: Path, cwd: Path | None):
    extra = {"PYTHONPATH": ""} if python == str(UPSTREAM_PY) else None
    return start_env(
        COUNTING_ENV,
        "serve",
        "--env.rollout_server_url",
        api_url,
        "--env.tokenizer_name",
        str(tokenizer),
        "--env.num_items",
        str(N_ITEMS),
        "--env.total_steps",
        "1000",
        log=log,
        python=python,
        cwd=cwd,
        extra_env=extra,
    )


def _collect(trainer: Trainer, proc: subprocess.Popen, log: Path) -> list[int]:
    try:
        trainer.pull(N_ITEMS // 2, timeout=120)
        time.sleep(1.0)
        trainer.drain()
    except AssertionError:
        raise AssertionError(log.read_text()[-3000:]) from None
    finally:
        stop(proc)
        trainer.close()
    return sorted(g["tokens"][0][0] - 1000 for g in trainer.groups())


def test_upstream_env_library_against_our_api(start_api, tiny_model_dir, tmp_path: Path):
    api = start_api()
    trainer = Trainer(api.url, batch_size=4)
    trainer.register()
    proc = _run_env(str(UPSTREAM_PY), api.url, tiny_model_dir, tmp_path / "env.log", Path("/"))
    assert _collect(trainer, proc, tmp_path / "env.log") == list(range(N_ITEMS))


def test_our_env_library_against_upstream_api(tiny_model_dir, tmp_path: Path):
    port = free_port()
    api_log = open(tmp_path / "api.log", "wb")  # noqa: SIM115
    api = subprocess.Popen(
        [
            str(UPSTREAM_PY),
            "-m",
            "atroposlib.cli.run_api",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        cwd="/",
        env={**env_environ(), "PYTHONPATH": ""},
        stdout=api_log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url + "/status", timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "upstream run-api did not start"
                time.sleep(0.2)
        trainer = Trainer(url, batch_size=4)
        trainer.register()
        proc = _run_env(
            __import__("sys").executable, url, tiny_model_dir, tmp_path / "env.log", None
        )
        assert _collect(trainer, proc, tmp_path / "env.log") == list(range(N_ITEMS))
    finally:
        api.terminate()
        api.wait(10)
        api_log.close()
