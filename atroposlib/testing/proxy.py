"""A loopback HTTP proxy between a trainer and run-api that records the trainer's calls and
loses one ``/batch`` response on the way.

The trainer talks to the proxy as if it were run-api. Every request is forwarded unchanged
(except ``Accept-Encoding: identity``, so the proxy can read the batches), and every answer
is passed back, except one: the ``cut_nth`` non-empty ``/batch`` response gets its status line,
its headers (with the full ``Content-Length``) and half of its body, then the connection is
closed. To the trainer this is a response lost mid-way (run-api died, the network broke): an
acknowledging client (``GET /batch?ack=N``) asks again with the same ``ack`` and run-api hands
the same batch out again with ``X-Atropos-Redelivered: 1``.

Standard library and httpx only.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx

__all__ = ["BatchProxy", "ProxyCall"]

#: Headers that belong to one connection, never forwarded.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "accept-encoding",
        "content-encoding",
    }
)


@dataclass
class ProxyCall:
    """One request the trainer made, and what came back."""

    time: float
    method: str
    path: str
    query: dict[str, str]
    status: int = 0
    #: the JSON body of ``POST /register``
    register: dict[str, Any] | None = None
    #: ``/batch``: the groups of the batch (None: no batch), its step and redelivery flag
    batch: list[dict[str, Any]] | None = None
    step: int | None = None
    redelivered: bool = False
    #: this response was cut short on purpose: the trainer never received it
    cut: bool = False
    error: str = ""

    @property
    def ack(self) -> int | None:
        value = self.query.get("ack")
        try:
            return None if value is None else int(value)
        except ValueError:
            return None


@dataclass
class _State:
    upstream: httpx.Client
    cut_nth: int
    calls: list[ProxyCall] = field(default_factory=list)
    batches_seen: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - BaseHTTPRequestHandler's name
        """Quiet: every call is recorded in :attr:`BatchProxy.calls` instead."""

    def _forward(self) -> None:
        state = self.server.state
        parts = urlsplit(self.path)
        call = ProxyCall(
            time=time.monotonic(),
            method=self.command,
            path=parts.path,
            query={k: v[-1] for k, v in parse_qs(parts.query).items()},
        )
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        headers["Accept-Encoding"] = "identity"
        encoding = self.headers.get("Content-Encoding")
        if encoding:
            headers["Content-Encoding"] = encoding
        try:
            reply = state.upstream.request(self.command, self.path, content=body, headers=headers)
        except httpx.HTTPError as exc:
            call.error = f"{type(exc).__name__}: {exc}"
            call.status = 502
            with state.lock:
                state.calls.append(call)
            self._answer(502, {}, f"proxy: run-api unreachable: {exc}".encode())
            return
        content = reply.content
        call.status = reply.status_code
        cut = False
        if call.path == "/register" and self.command == "POST" and reply.status_code == 200:
            try:
                call.register = json.loads(body or b"{}")
            except ValueError:
                call.register = {}
        if call.path == "/batch" and reply.status_code == 200:
            try:
                batch = json.loads(content).get("batch")
            except (ValueError, AttributeError):
                batch = None
            if batch:
                call.batch = batch
                step = reply.headers.get("X-Atropos-Step")
                call.step = None if step is None else int(step)
                call.redelivered = bool(reply.headers.get("X-Atropos-Redelivered"))
                with state.lock:
                    state.batches_seen += 1
                    cut = state.batches_seen == state.cut_nth
                call.cut = cut
        with state.lock:
            state.calls.append(call)
        self._answer(reply.status_code, reply.headers, content, cut=cut)

    def _answer(self, status: int, headers: Any, content: bytes, *, cut: bool = False) -> None:
        self.send_response(status)
        for key, value in headers.items():
            if key.lower() not in _HOP_BY_HOP and key.lower() not in ("date", "server"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        if not cut:
            self.wfile.write(content)
            return
        self.wfile.write(content[: len(content) // 2])
        self.wfile.flush()
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _forward


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: _State


class BatchProxy:
    """The proxy, on ``127.0.0.1`` and a free port, forwarding to ``upstream_url``.

    Args:
        upstream_url: run-api's base URL.
        cut_nth: which non-empty ``/batch`` response (1-based) to cut short; 0: none.
    """

    def __init__(self, upstream_url: str, *, cut_nth: int = 2) -> None:
        self._state = _State(httpx.Client(base_url=upstream_url, timeout=120.0), cut_nth)
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.state = self._state
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="atropos-check-proxy", daemon=True
        )

    def start(self) -> BatchProxy:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._state.upstream.close()

    @property
    def calls(self) -> list[ProxyCall]:
        """Every request so far, in the order they completed."""
        with self._state.lock:
            return list(self._state.calls)

    def __enter__(self) -> BatchProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
