"""Fixtures: tiny real models on disk and ``atropos-serve`` running them as child processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch", reason="the inference extra (torch) is not installed")
pytest.importorskip("transformers")

from atroposlib.inference.models import build_tiny_model  # noqa: E402

SERVED_NAME = "tiny"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServeProcess:
    """``python -m atroposlib.inference.cli`` on a free loopback port; always killed on stop."""

    def __init__(self, model: Path | str, *args: str, log_path: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model)
        self.args = args
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> ServeProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "atroposlib.inference.cli",
                "--model",
                self.model,
                "--port",
                str(self.port),
                "--log-level",
                "warning",
                *self.args,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"atropos-serve exited early:\n{self.log()}")
                try:
                    if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            raise RuntimeError(f"atropos-serve not healthy after {timeout}s:\n{self.log()}")
        except BaseException:
            self.stop()
            raise

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if hasattr(self, "_log") and not self._log.closed:
            self._log.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the real SmolLM2 tokenizer (seed 0)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "seed0", seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture, different weights (seed 1): the target of reload tests."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "seed1", seed=1)


@pytest.fixture(scope="session")
def reference_model(tiny_model_dir: Path):
    """The tiny model loaded in-process, to check the server's log-probs against."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model.eval()


def start_server(
    tmp_path_factory: pytest.TempPathFactory,
    model: Path | str,
    *args: str,
    timeout: float = 120.0,
) -> ServeProcess:
    """Start a server; the caller stops it (fixtures below do so in a finally)."""
    log = tmp_path_factory.mktemp("serve") / "atropos-serve.log"
    return ServeProcess(model, *args, log_path=log).start(timeout)


@pytest.fixture(scope="module")
def tiny_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[ServeProcess]:
    """``atropos-serve`` with the tiny model in float32, served as ``tiny``."""
    server = start_server(
        tmp_path_factory,
        tiny_model_dir,
        "--dtype",
        "float32",
        "--served-model-name",
        SERVED_NAME,
        "tiny-alias",
        "--max-concurrency",
        "48",
    )
    try:
        yield server
    finally:
        server.stop()


def reference_logprobs(model, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    """Log-probs of ``output_ids`` after ``prompt_ids`` from one plain forward pass."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logprobs = model(ids).logits[0].float().log_softmax(-1)
    start = len(prompt_ids) - 1
    return [logprobs[start + i, t].item() for i, t in enumerate(output_ids)]
