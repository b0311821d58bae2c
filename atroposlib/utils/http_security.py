"""Keep web pages from driving a local HTTP service: one small pure-ASGI middleware.

A service on 127.0.0.1 without authentication can still be reached by any page open in the
user's browser: the page can send requests to it (CSRF: ``<img src=".../reset_data">``, a form
POST) and, with DNS rebinding (``evil.example`` resolving to 127.0.0.1), even read the answers.
:class:`HttpSecurityMiddleware` closes both:

* **Host check** (when ``allowed_hosts`` is given; meant for services bound to loopback): the
  ``Host`` header must name ``localhost``, ``127.0.0.1`` or ``[::1]`` (any port) or one of
  ``allowed_hosts``; otherwise ``421 Misdirected Request``. A rebinding page's requests carry
  its own name, so they are refused.
* **No cross-origin writes**: a request that changes state (any method but GET, HEAD and
  OPTIONS, plus GETs to ``state_changing_gets``) is refused with ``403`` when a browser says it
  comes from another origin: ``Sec-Fetch-Site`` other than ``same-origin``/``none``, or an
  ``Origin`` that differs from the request's own and is not in ``allowed_origins``. Clients that
  send neither header (``requests``, ``aiohttp``, ``curl``: trainers and environments) are not
  affected.

CORS response headers are not its business: pair it with Starlette's ``CORSMiddleware`` when
cross-origin reads are wanted. Usage::

    app.add_middleware(HttpSecurityMiddleware, allowed_hosts=loopback_hosts(host, extra),
                       state_changing_gets={"/reset_data"})   # added last: runs first
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: Host names that always mean this machine.
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_SAME_SITE_FETCH = frozenset({b"same-origin", b"none"})


def split_names(text: str) -> list[str]:
    """The non-empty items of a comma-separated flag value (``--allowed-hosts``,
    ``--cors-allow-origin``), stripped."""
    return [part.strip() for part in text.split(",") if part.strip()]


def replay_body(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` for the app behind a middleware that read the whole body first: it gives
    ``body`` once, then whatever the server sends next (the client's disconnect)."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replay


def is_loopback(bind_host: str) -> bool:
    """Whether a server bound to ``bind_host`` is reachable from this machine only."""
    host = bind_host.strip().strip("[]").lower()
    return host in LOOPBACK_NAMES or host.startswith("127.")


def loopback_hosts(bind_host: str, extra: Iterable[str] = ()) -> frozenset[str] | None:
    """``allowed_hosts`` for a server bound to ``bind_host``: the loopback names plus ``extra``
    when it is bound to loopback (or ``extra`` is given), else ``None`` (no Host check: a server
    on 0.0.0.0 is reached under names it cannot know)."""
    names = {split_host(h.encode("latin-1")) for h in extra if h.strip()}
    if not is_loopback(bind_host) and not names:
        return None
    return frozenset(LOOPBACK_NAMES | names)


def split_host(host: bytes) -> str:
    """The name in a ``Host`` header value, without port or brackets, lower case."""
    text = host.decode("latin-1").strip().lower()
    if text.startswith("["):  # [::1]:8000
        return text[1 : text.find("]")] if "]" in text else text[1:]
    name = text.rsplit(":", 1)[0] if text.count(":") == 1 else text
    return name.rstrip(".")


class HttpSecurityMiddleware:
    """Host check and refusal of cross-origin state-changing requests (see the module doc)."""

    def __init__(
        self,
        app: ASGIApp,
        allowed_hosts: Iterable[str] | None = None,
        allowed_origins: Iterable[str] = (),
        state_changing_gets: Iterable[str] = (),
        host_flag: str = "--allowed-hosts",
    ) -> None:
        self.app = app
        self.allowed_hosts = None if allowed_hosts is None else frozenset(allowed_hosts)
        origins = {o.strip().rstrip("/").lower() for o in allowed_origins if o.strip()}
        self.any_origin = "*" in origins
        self.allowed_origins = frozenset(o.encode("latin-1") for o in origins - {"*"})
        self.state_changing_gets = frozenset(state_changing_gets)
        self.host_flag = host_flag

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = origin = fetch_site = None
        for name, value in scope["headers"]:
            if name == b"host":
                host = value
            elif name == b"origin":
                origin = value
            elif name == b"sec-fetch-site":
                fetch_site = value
        if (
            self.allowed_hosts is not None
            and host is not None
            and split_host(host) not in self.allowed_hosts
        ):
            await _refuse(
                scope,
                send,
                421,
                f"Host {host.decode('latin-1')!r} is not served here (allowed: "
                f"{', '.join(sorted(self.allowed_hosts))}; add names with {self.host_flag})",
            )
            return
        if origin is None and fetch_site is None:  # not a browser, or a same-origin GET
            await self.app(scope, receive, send)
            return
        changes_state = scope["type"] == "websocket" or (
            scope["method"] not in _SAFE_METHODS or scope["path"] in self.state_changing_gets
        )
        if changes_state and not self._same_or_allowed(origin, fetch_site, host, scope):
            await _refuse(
                scope,
                send,
                403,
                "cross-origin request refused: this endpoint changes state and a web page "
                "from another origin may not call it (allow an origin with --cors-allow-origin)",
            )
            return
        await self.app(scope, receive, send)

    def _same_or_allowed(
        self, origin: bytes | None, fetch_site: bytes | None, host: bytes | None, scope: Scope
    ) -> bool:
        if origin is not None:
            origin = origin.lower().rstrip(b"/")
            if self.any_origin or origin in self.allowed_origins:
                return True
        if fetch_site is not None:
            return fetch_site.lower() in _SAME_SITE_FETCH
        # Origin only (browsers without Fetch Metadata): same origin means same host and port
        if origin is None or host is None or origin == b"null":
            return False
        scheme = b"https" if scope.get("scheme") in ("https", "wss") else b"http"
        return origin == scheme + b"://" + host.lower()


async def _refuse(scope: Scope, send: Send, status: int, message: str) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
        return
    body = json.dumps({"detail": message}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
