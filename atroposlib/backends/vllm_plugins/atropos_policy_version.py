"""``GET /policy_version`` on vLLM's OpenAI server, as an ASGI middleware (``--middleware``).

Standard library only: it is imported by vLLM, in vLLM's own virtualenv, from this folder put on
``PYTHONPATH``::

    python -m vllm.entrypoints.openai.api_server ... \\
        --middleware atropos_policy_version.PolicyVersionMiddleware

Answers ``GET /policy_version`` with ``{"policy_version": <int>}``: the trainer step whose
weights the server serves (the Atropos contract every inference server follows). The version
lives in vLLM's engine, as its native *weight version* (``POST /update_weight_version
{"new_version": "N"}``, or ``weight_version`` of ``/finish_weight_update``; both need
``VLLM_SERVER_DEV_MODE=1``), so every API-server process reports the same value and the
value changes together with the weights. Until the engine holds an integer version (a fresh
launch reports ``"default"``), the answer is ``$ATROPOS_POLICY_VERSION`` (the trainer sets it
when it launches vLLM on a checkpoint: the restart path), else 0. Every other request passes
through untouched.
"""

from __future__ import annotations

import json
import os

PATH = "/policy_version"
ENV = "ATROPOS_POLICY_VERSION"


def launch_version() -> int:
    """The version given at launch (``$ATROPOS_POLICY_VERSION``), 0 when unset or invalid."""
    try:
        return int(os.environ.get(ENV, "0") or 0)
    except ValueError:
        return 0


async def engine_version(app) -> int | None:
    """The engine's weight version as an int, or None when it holds none (or no engine)."""
    state = getattr(app, "state", None)
    engine = getattr(state, "engine_client", None) if state is not None else None
    getter = getattr(engine, "get_weight_version", None)
    if getter is None:
        return None
    try:
        value = await getter()
        return int(value)
    except Exception:  # noqa: BLE001 - "default", an engine error: fall back
        return None


class PolicyVersionMiddleware:
    """Pure ASGI middleware: serves ``GET /policy_version``, passes everything else on."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope.get("type") != "http" or scope.get("path") != PATH:
            await self.app(scope, receive, send)
            return
        if scope.get("method") not in ("GET", "HEAD"):
            await _respond(send, 405, {"error": "use GET /policy_version"}, allow="GET")
            return
        version = await engine_version(scope.get("app"))
        await _respond(
            send, 200, {"policy_version": launch_version() if version is None else version}
        )


async def _respond(send, status: int, body: dict, allow: str | None = None) -> None:
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    if allow:
        headers.append((b"allow", allow.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
