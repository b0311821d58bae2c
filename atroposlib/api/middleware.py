"""What runs around every route of the trajectory API, in this order (outermost first; the
stack is built in one place, :func:`install`):

1. :class:`~atroposlib.utils.http_security.HttpSecurityMiddleware`: Host check and refusal of
   cross-origin state-changing requests (before anything else, before a body is read).
2. ``CORSMiddleware``, only with ``--cors-allow-origin`` (outside the key check, so a browser
   can read its 401 and send preflights).
3. :class:`ApiKeyMiddleware`, only with ``--api-key`` (a refused request's body is never read).
4. :class:`RequestBodyMiddleware`: the one place a body is read, capped, inflated and charged
   to the ingest budget (:func:`atroposlib.utils.http_guard.read_body`, shared with
   atropos-serve).
5. :class:`IngestFastLane`: **the one place a request leaves the normal path**. An env's
   ``POST /scored_data`` or ``/scored_data_list`` goes straight to
   :func:`atroposlib.api.routers.env.ingest` here, the function those routes call, skipping
   routing, dependency resolution and FastAPI's request handling (about a third of the
   server's CPU per request). Requests from browsers (with an ``Origin`` header) take the
   normal path.
6. :class:`SkipPrecompressedGZip`: Starlette's response gzip, except for ``/batch`` (which
   compresses itself off the event loop) and the ingest replies (a few bytes).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.datastructures import MutableHeaders
from starlette.middleware.gzip import GZipMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from atroposlib.api.dependencies import ApiState
from atroposlib.api.errors import Refused
from atroposlib.api.responses import GZIP_MINIMUM, refusal_response
from atroposlib.api.routers.env import ingest
from atroposlib.utils.api_key import API_KEY_ENV
from atroposlib.utils.http_guard import (
    ApiKeyCheck,
    BodyBudget,
    BodyTooLarge,
    ClientGone,
    IngestBusy,
    InvalidGzip,
    body_chunks,
    declared_too_large,
    read_body,
)
from atroposlib.utils.http_security import (
    HttpSecurityMiddleware,
    loopback_hosts,
    replay_body,
    split_names,
)

__all__ = [
    "INGEST_PATHS",
    "OPEN_PATHS",
    "SMALL_BODY_BYTES",
    "STATE_CHANGING_GETS",
    "ApiKeyMiddleware",
    "IngestFastLane",
    "RequestBodyMiddleware",
    "SkipPrecompressedGZip",
    "install",
]

#: GET endpoints that change state (upstream's trainers call them with GET): refused to web pages
#: of other origins.
STATE_CHANGING_GETS = frozenset({"/batch", "/reset_data"})
#: Endpoints that take scored groups.
INGEST_PATHS = frozenset({"/scored_data", "/scored_data_list"})
#: Endpoints open without the API key (``run-api --api-key``): liveness probes, GET/HEAD only.
OPEN_PATHS = frozenset({"/", "/health"})
#: Most bytes accepted in the body of a request that does not carry scored groups.
SMALL_BODY_BYTES = 1 << 20

_SELF_ENCODED_PATHS = INGEST_PATHS | {"/batch"}


class RequestBodyMiddleware:
    """The one place a request body is read (:func:`~atroposlib.utils.http_guard.read_body`).

    Caps the body (``--max-request-bytes`` for scored data, :data:`SMALL_BODY_BYTES` for every
    other endpoint) before and after gzip decompression, charges it to the ingest byte budget
    while it is held, and answers 413, ``400 Invalid gzip payload`` or ``503`` + ``Retry-After``
    itself. A gzip body is handed on decompressed without the header (as upstream's middleware
    does).
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        budget: BodyBudget,
        retry_after_s: int,
        on_refused: Callable[[str], None],
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.budget = budget
        self.retry_after_s = retry_after_s
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        encoding = ""
        declared = None
        chunked = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                declared = value
            elif name == b"content-encoding":
                encoding = value.decode("latin-1").lower()
            elif name == b"transfer-encoding":
                chunked = True
        if not chunked and declared in (None, b"0"):
            await self.app(scope, receive, send)  # no body to read
            return
        ingest_path = scope["method"] == "POST" and scope["path"] in INGEST_PATHS
        cap = self.max_bytes if ingest_path else min(self.max_bytes, SMALL_BODY_BYTES)
        refused: Refused | None = None
        try:
            if declared_too_large(scope, cap):
                raise BodyTooLarge
            body = await read_body(body_chunks(receive), cap, "gzip" in encoding, self.budget)
        except BodyTooLarge:
            why = "(run-api --max-request-bytes)" if ingest_path else "for this endpoint"
            refused = Refused(
                "body_too_large",
                f"request body exceeds the limit of {cap} bytes {why}",
                kind="too_large",
            )
        except InvalidGzip:
            self.on_refused("bad_gzip")
            await PlainTextResponse("Invalid gzip payload", status_code=400)(scope, receive, send)
            return
        except IngestBusy:
            refused = Refused(
                "busy",
                "request bodies being read and parsed already hold the server's ingest budget "
                f"of {self.budget.limit} bytes (run-api --ingest-budget-bytes): retry later",
                retry_after=max(1, self.retry_after_s),
            )
        except ClientGone:
            return
        if refused is not None:
            self.on_refused(refused.reason)
            await refusal_response(refused)(scope, receive, send)
            return
        try:
            if encoding:
                headers = MutableHeaders(scope=scope)
                headers["content-length"] = str(len(body.data))
                del headers["content-encoding"]
                del headers["transfer-encoding"]
            await self.app(scope, replay_body(body.data, receive), send)
        finally:
            body.release()


class IngestFastLane:
    """``POST /scored_data(_list)`` from an env (no ``Origin`` header) goes straight to
    :func:`atroposlib.api.routers.env.ingest`; everything else goes on to the routes. See the
    module doc: this is the only place a request skips the normal path."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    @staticmethod
    def takes(scope: Scope) -> bool:
        """Whether this request takes the fast lane."""
        return (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in INGEST_PATHS
            and all(name != b"origin" for name, _ in scope["headers"])
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.takes(scope):
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:  # the body, already read and capped by RequestBodyMiddleware
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        state: ApiState = scope["app"].state.api  # Starlette puts the application in "app"
        response = await ingest(state, b"".join(chunks), scope["path"] == "/scored_data_list")
        await response(scope, receive, send)


class ApiKeyMiddleware:
    """``run-api --api-key``: the shared key rule (:class:`~atroposlib.utils.http_guard.
    ApiKeyCheck`; open without it: ``GET``/``HEAD`` of :data:`OPEN_PATHS` and CORS
    preflights), answered with ``401`` and a JSON ``detail`` that says how to send the key,
    counted in ``/metrics`` as ``refused_groups_total{reason="unauthorized"}``. The key is
    never logged."""

    def __init__(self, app: ASGIApp, key: str, on_refused: Callable[[str], None]) -> None:
        self.app = app
        self.check = ApiKeyCheck(key, OPEN_PATHS)
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self.check.refusal(scope)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        self.on_refused("unauthorized")
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "unauthorized"})
            return
        if refusal == "invalid":
            message = (
                "invalid API key: the key sent does not match run-api's --api-key "
                f"(clients send the {API_KEY_ENV} environment variable)"
            )
        else:
            message = (
                "this API requires a key (run-api --api-key): send 'Authorization: Bearer "
                f"<key>' or 'X-API-Key: <key>' (clients send the {API_KEY_ENV} environment "
                "variable)"
            )
        await JSONResponse(
            {"detail": message}, 401, headers={"WWW-Authenticate": 'Bearer realm="atropos"'}
        )(scope, receive, send)


class SkipPrecompressedGZip(GZipMiddleware):
    """Starlette's response gzip, leaving alone ``/batch`` and the ingest replies."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") in _SELF_ENCODED_PATHS:
            # /batch compresses itself off the event loop; ingest replies are a few bytes
            await self.app(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def install(app: FastAPI, state: ApiState) -> None:
    """Build the middleware stack of the module doc around ``app`` (Starlette runs the last
    one added first, so they are added innermost first)."""
    settings = state.settings
    on_refused = state.queue.count_refused
    app.add_middleware(SkipPrecompressedGZip, minimum_size=GZIP_MINIMUM)
    app.add_middleware(IngestFastLane)
    app.add_middleware(
        RequestBodyMiddleware,
        max_bytes=settings.max_request_bytes,
        budget=state.budget,
        retry_after_s=settings.retry_after_s,
        on_refused=on_refused,
    )
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, key=settings.api_key, on_refused=on_refused)
    origins = split_names(settings.cors_allow_origin)
    if origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_credentials=settings.cors_credentials,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    app.add_middleware(
        HttpSecurityMiddleware,
        allowed_hosts=loopback_hosts(settings.host, split_names(settings.allowed_hosts)),
        allowed_origins=origins,
        state_changing_gets=STATE_CHANGING_GETS,
    )
