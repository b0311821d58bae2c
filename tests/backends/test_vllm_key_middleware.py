"""``atropos_api_key.ApiKeyMiddleware`` (what atropos-launch adds to vLLM with --middleware),
through HTTP: a real uvicorn process serving a stand-in app with vLLM's kinds of routes, the
middleware around it, ``ATROPOS_API_KEY`` in its environment."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from atroposlib.backends import API_KEY_MIDDLEWARE, PLUGIN_DIR

APP = """
import uvicorn
from atropos_api_key import ApiKeyMiddleware

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})

uvicorn.run(ApiKeyMiddleware(app), host="127.0.0.1", port=int(__import__("sys").argv[1]),
            log_level="warning")
"""


def _serve(tmp_path: Path, key: str | None) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = tmp_path / "app.py"
    script.write_text(APP)
    env = {k: v for k, v in os.environ.items() if k != "ATROPOS_API_KEY"}
    env["PYTHONPATH"] = str(PLUGIN_DIR)
    if key is not None:
        env["ATROPOS_API_KEY"] = key
    proc = subprocess.Popen([sys.executable, str(script), str(port)], env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(url + "/health", timeout=1)
            return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("stand-in did not start")


def test_every_route_but_health_needs_the_key(tmp_path: Path) -> None:
    assert API_KEY_MIDDLEWARE == "atropos_api_key.ApiKeyMiddleware"
    proc, url = _serve(tmp_path, "s3cret")
    try:
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.head(url + "/health").status_code == 200
        assert httpx.get(url + "/policy_version").status_code == 401
        for path in ("/collective_rpc", "/pause", "/v1/completions", "/tokenize"):
            refused = httpx.post(url + path, json={})
            assert refused.status_code == 401, path
            assert refused.json()["error"]["code"] == "invalid_api_key"
            wrong = httpx.post(url + path, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
            right = httpx.post(url + path, headers={"Authorization": "bearer s3cret"})
            assert right.status_code == 200
            assert httpx.post(url + path, headers={"X-API-Key": "s3cret"}).status_code == 200
    finally:
        proc.kill()
        proc.wait()


def test_without_a_key_everything_passes(tmp_path: Path) -> None:
    proc, url = _serve(tmp_path, None)
    try:
        assert httpx.post(url + "/collective_rpc", json={}).status_code == 200
    finally:
        proc.kill()
        proc.wait()
