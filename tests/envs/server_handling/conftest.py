"""Fixtures: configs for the shared ``atropos-serve`` and small real HTTP apps on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from tests.conftest import free_port


@contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """Run an ASGI ``app`` with uvicorn on a free 127.0.0.1 port; yields its base URL."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("loopback app did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def engine_requests(base_url: str) -> int:
    """How many generation requests ``atropos-serve`` has run (from ``GET /health``)."""
    return httpx.get(f"{base_url}/health", timeout=10).json()["stats"]["requests"]


def server_config(serve: Any, model_dir: Path, server_type: str = "vllm") -> APIServerConfig:
    """An ``APIServerConfig`` for a tiny ``atropos-serve`` process ``serve`` (served as
    ``tiny``), with the client ``server_type``."""
    return APIServerConfig(
        base_url=f"{serve.url}/v1",
        api_key="",
        model_name="tiny",
        tokenizer_name=str(model_dir),
        server_type=server_type,
        timeout=120,
    )


@pytest.fixture()
def tiny_config(tiny_serve: Any, tiny_model_dir: Path) -> APIServerConfig:
    """An ``APIServerConfig`` for the shared tiny ``atropos-serve`` (served as ``tiny``)."""
    return server_config(tiny_serve, tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> Any:
    """The real SmolLM2 tokenizer of the tiny model."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))
