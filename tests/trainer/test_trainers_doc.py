"""The 40-line trainer of docs/trainers.md runs, and learns, as written.

The page's first ``python`` block (under "A complete trainer in 40 lines") is run unchanged
against a real ``run-api``, a real ``atropos-serve`` (tiny random model) and the token-share
environment (``token_env.py``), with its settings given through the environment variables it
reads. It must take every step, push every step's weights to the server, and raise the reward a
correct trainer raises (see tests/trainer/test_learning.py for why this reward catches sign,
mask and sync errors).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, ApiProcess, ServeProcess

TOKEN_ENV = Path(__file__).with_name("token_env.py")
STEPS = 15


def doc_loop() -> str:
    """The code block under "A complete trainer in 40 lines"."""
    text = (REPO / "docs" / "trainers.md").read_text()
    section = text.split("## A complete trainer in 40 lines", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "no python block in the section"
    return match.group(1)


def test_the_loop_is_about_forty_lines() -> None:
    code = [line for line in doc_loop().splitlines() if line.strip()]
    assert len(code) <= 45, len(code)
    # written only against the library's trainer module (client, rows, tensors, weight sync)
    imports = [line for line in code if line.startswith(("import ", "from "))]
    assert all("atroposlib.trainer" in line or "atroposlib" not in line for line in imports)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_documented_loop_trains(tmp_path: Path, tiny_model_dir: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(doc_loop())
    # on-policy data only (staleness 0: made by the weights being trained), so the loop's
    # PPO clip never freezes a step on replies of older weights at this test's large LR
    api = ApiProcess("--max-staleness", "0", log_path=tmp_path / "run-api.log").start()
    server = ServeProcess(
        tiny_model_dir, "--dtype", "float32", "--served-model-name", "tiny",
        "--logprobs-mode", "processed_logprobs", log_path=tmp_path / "serve.log",
    ).start()  # fmt: skip
    base = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    env_proc = subprocess.Popen(
        [
            sys.executable,
            str(TOKEN_ENV),
            "serve",
            "--env.rollout_server_url",
            api.url,
            "--env.group_size",
            "8",
            "--env.batch_size",
            "32",
            "--env.total_steps",
            str(STEPS + 5),
            "--env.tokenizer_name",
            str(tiny_model_dir),
            "--env.use_wandb",
            "false",
            "--env.max_answer_tokens",
            "12",
            "--env.max_batches_offpolicy",
            "1",
            "--openai.base_url",
            f"{server.url}/v1",
            "--openai.model_name",
            "tiny",
            "--openai.server_type",
            "atropos-serve",
            "--openai.api_key",
            "x",
            "--openai.tokenizer_name",
            str(tiny_model_dir),
        ],  # fmt: skip
        stdout=open(tmp_path / "env.log", "wb"),  # noqa: SIM115 - closed with the process
        stderr=subprocess.STDOUT,
        env=base,
        cwd=REPO,
    )
    loop = None
    try:
        loop = subprocess.Popen(
            [sys.executable, str(script)],
            stdout=open(tmp_path / "loop.out", "wb"),  # noqa: SIM115 - closed with the process
            stderr=open(tmp_path / "loop.err", "wb"),  # noqa: SIM115
            cwd=tmp_path,
            env={
                **base,
                "MODEL": str(tiny_model_dir),
                "API_URL": api.url,
                "SERVER_URL": server.url,
                "STEPS": str(STEPS),
                "LR": "5e-3",
                "OUT": str(tmp_path / "out"),
            },
        )
        deadline = time.monotonic() + 600
        while loop.poll() is None:
            # the loop waits for batches as long as it takes: fail at once if the env died
            assert env_proc.poll() is None, (tmp_path / "env.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the loop did not finish in 600 s"
            time.sleep(1)
        out, err = (tmp_path / "loop.out").read_text(), (tmp_path / "loop.err").read_text()
        assert loop.returncode == 0, err[-4000:] + (tmp_path / "env.log").read_text()[-2000:]
        steps = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
        assert httpx.get(server.url + "/policy_version").json()["policy_version"] == STEPS
        rewards = [s["reward"] for s in steps]
        first, last = statistics.mean(rewards[:2]), statistics.mean(rewards[-3:])
        assert 0.03 < first < 0.3, rewards
        assert last > first + 0.2, rewards
    finally:
        if loop is not None and loop.poll() is None:
            loop.kill()
            loop.wait(10)
        env_proc.terminate()
        env_proc.wait(20)
        server.stop()
        api.stop()
