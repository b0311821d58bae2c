"""A core install (``pip install -e .``, no extras: no torch) runs ``run-api`` and a bundled
text environment against a remote OpenAI-compatible server, with the default tokenizer name.

The core install lives in its own virtualenv (``ATROPOS_CORE_PYTHON``, default
/tmp/atropos-core-venv/bin/python; `.ci/run` creates it). The "remote" server is atropos-serve
from the test's own environment (the tiny model, which has SmolLM2's tokenizer).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, ApiProcess
from tests.envs.helpers import start_env, stop

CORE_PY = Path(os.environ.get("ATROPOS_CORE_PYTHON", "/tmp/atropos-core-venv/bin/python"))
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not CORE_PY.exists(),
        reason=f"no core-only atroposlib virtualenv at {CORE_PY} (see .ci/run)",
    ),
]


def test_core_install_has_no_torch_and_resolves_the_default_tokenizer() -> None:
    probe = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('torch') is None, 'torch is installed'\n"
        "from transformers import AutoTokenizer\n"
        "from atroposlib.envs.base import BaseEnv\n"
        "tok = AutoTokenizer.from_pretrained(BaseEnv._resolve_tokenizer_name("
        "'SmolLM2-135M-Instruct'))\n"
        "print(len(tok), tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], "
        "tokenize=False).count('<|im_start|>'))\n"
        "assert 'torch' not in sys.modules\n"
    )
    out = subprocess.run(
        [str(CORE_PY), "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["49152", "2"]


def test_core_install_runs_api_and_env_against_a_remote_server(tiny_serve, tmp_path: Path) -> None:
    api = ApiProcess(log_path=tmp_path / "api.log", python=str(CORE_PY)).start(timeout=60)
    env = None
    try:
        with httpx.Client(base_url=api.url, timeout=10) as trainer:
            reg = {
                "wandb_group": "g",
                "wandb_project": "p",
                "batch_size": 8,
                "max_token_len": 512,
                "checkpoint_dir": str(tmp_path),
                "save_checkpoint_interval": 10,
                "starting_step": 0,
                "num_steps": 10,
            }
            assert trainer.post("/register", json=reg).status_code == 200
            assert trainer.get("/batch").json() == {"batch": None}
            env = start_env(
                REPO / "environments" / "arithmetic_server.py",
                "serve",
                "--env.rollout_server_url", api.url,
                "--openai.base_url", f"{tiny_serve.url}/v1",
                "--openai.model_name", "tiny",
                "--env.group_size", "4",
                "--env.max_answer_tokens", "16",
                "--env.use_wandb", "false",
                log=tmp_path / "env.log",
                python=str(CORE_PY),
            )  # fmt: skip
            deadline = time.monotonic() + 180
            batch = None
            while batch is None:
                assert env.poll() is None, (tmp_path / "env.log").read_text()[-3000:]
                assert time.monotonic() < deadline, (tmp_path / "env.log").read_text()[-3000:]
                batch = trainer.get("/batch").json()["batch"]
                time.sleep(0.5)
        assert sum(len(g["tokens"]) for g in batch) == 8
        for group in batch:
            assert len(group["tokens"]) == len(group["masks"]) == len(group["scores"]) == 4
            assert all(-100 in masks for masks in group["masks"])  # prompt masked
    finally:
        if env is not None:
            stop(env)
        api.stop()
    assert "PyTorch was not found" in (tmp_path / "env.log").read_text()  # it really ran without
