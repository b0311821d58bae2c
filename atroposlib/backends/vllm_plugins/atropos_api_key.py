"""The run's shared key on **every** route of vLLM's OpenAI server, as an ASGI middleware.

Standard library only (imported by vLLM, in vLLM's own virtualenv, from this folder put on
``PYTHONPATH``)::

    ATROPOS_API_KEY=... python -m vllm.entrypoints.openai.api_server ... \\
        --middleware atropos_api_key.ApiKeyMiddleware

vLLM's own ``--api-key`` (or ``VLLM_API_KEY``) is checked only under ``/v1``, ``/v2``,
``/inference`` and ``/cohere``; its other routes stay open, among them the dev-mode ones a
training run turns on (``/pause``, ``/collective_rpc`` which reloads weights from any folder,
``/update_weight_version``) and ``/policy_version``. This middleware applies the rule every
atroposlib service follows (``atroposlib.utils.http_guard``): the key as
``Authorization: Bearer KEY`` or ``X-API-Key: KEY``, compared in constant time; open are
``GET``/``HEAD /health`` and CORS preflights. Refusals are 401 with OpenAI's error shape.
Without ``$ATROPOS_API_KEY`` (or with it empty) every request passes through untouched.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

ENV = "ATROPOS_API_KEY"
OPEN_PATHS = frozenset({"/health"})


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class ApiKeyMiddleware:
    """Pure ASGI middleware: 401 for a request without the run's key (see the module doc)."""

    def __init__(self, app, key: str | None = None) -> None:
        self.app = app
        key = (os.environ.get(ENV, "") if key is None else key).strip()
        self.key_digest = _digest(key.encode()) if key else None

    def _allowed(self, scope) -> bool:
        method = scope.get("method", "GET")
        if method in ("GET", "HEAD") and scope.get("path") in OPEN_PATHS:
            return True
        names = {name for name, _ in scope.get("headers", [])}
        if method == "OPTIONS" and b"origin" in names and b"access-control-request-method" in names:
            return True
        matched = False
        for name, value in scope.get("headers", []):
            token = None
            if name == b"authorization":
                scheme, _, rest = value.strip().partition(b" ")
                if scheme.lower() == b"bearer":
                    token = rest.strip()
            elif name == b"x-api-key":
                token = value.strip()
            if token is not None:  # every offered key is compared: no early exit
                matched |= hmac.compare_digest(_digest(token), self.key_digest)
        return matched

    async def __call__(self, scope, receive, send) -> None:
        if self.key_digest is None or scope.get("type") not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "http" and self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            if self._allowed({**scope, "method": "WEBSOCKET"}):
                await self.app(scope, receive, send)
                return
            await send({"type": "websocket.close", "code": 1008})
            return
        payload = json.dumps(
            {
                "error": {
                    "message": "invalid or missing API key",
                    "type": "authentication_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})
