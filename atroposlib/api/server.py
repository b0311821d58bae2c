"""The trajectory API: a thin HTTP layer over :class:`~atroposlib.api.queue.TrajectoryQueue`.

Same endpoints, methods, request fields and response shapes as upstream Atropos
(``atroposlib.api.server:app``), so upstream environments, trainers and scripts work unchanged.
What differs is documented in ``docs/compat.md``: bad input gets a 4xx that names the field
instead of a 500, batches go out FIFO, the queue is bounded (429 + ``Retry-After``) and can be
made durable (``run-api --store PATH``), and ``run-api --api-key`` (:class:`ApiKeyMiddleware`)
makes every endpoint but ``GET /health`` and ``GET /`` require a shared key.

What lives where: request bodies are decompressed, capped, validated and serialised by
:mod:`atroposlib.api.ingest` (no HTTP there); the queue (:mod:`atroposlib.api.queue`) raises
:class:`~atroposlib.api.queue.Refused` with a reason, and :data:`REFUSAL_STATUS` here is the one
table from reasons to status codes; ``/metrics`` is rendered by :mod:`atroposlib.api.metrics`.

Performance notes: each group is validated and serialised once when it arrives (in a worker
thread, off the event loop); ``GET /batch`` concatenates stored payloads, and compresses the
answer in a worker thread when the client accepts gzip.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Annotated, Any

import orjson
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import MutableHeaders
from starlette.middleware.gzip import GZipMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from atroposlib.api.ingest import (
    BodyTooLarge,
    GroupParser,
    IngestBudget,
    IngestBusy,
    InvalidGzip,
    ParserGone,
    parse_json,
    read_body,
)
from atroposlib.api.metrics import PROMETHEUS_CONTENT_TYPE, json_bytes, prometheus_text
from atroposlib.api.models import EnvIdentifier, RegisterEnv, Registration, ScoredData
from atroposlib.api.queue import QueueLimits, Refused, TrajectoryQueue, UnknownEnv
from atroposlib.api.settings import ApiSettings
from atroposlib.api.store import MemoryStore, SqliteStore
from atroposlib.schema import EMPTY_EXAMPLE
from atroposlib.utils.api_key import API_KEY_ENV
from atroposlib.utils.http_security import (
    HttpSecurityMiddleware,
    loopback_hosts,
    replay_body,
    split_names,
)

try:  # Intel ISA-L: 4x faster gzip than zlib, same format
    from isal import igzip as _gzip

    _MAX_GZIP_LEVEL = 3
except ImportError:  # pragma: no cover - platforms without isal wheels
    import gzip as _gzip  # type: ignore[no-redef]

    _MAX_GZIP_LEVEL = 9

logger = logging.getLogger("atroposlib.api")

#: Responses smaller than this are never gzipped (upstream's GZipMiddleware minimum_size).
_GZIP_MINIMUM = 1000

#: GET endpoints that change state (upstream's trainers call them with GET): refused to web pages
#: of other origins.
STATE_CHANGING_GETS = frozenset({"/batch", "/reset_data"})
#: Endpoints that take scored groups.
INGEST_PATHS = frozenset({"/scored_data", "/scored_data_list"})
_SELF_ENCODED_PATHS = INGEST_PATHS | {"/batch"}


#: Most bytes accepted in the body of a request that does not carry scored groups.
SMALL_BODY_BYTES = 1 << 20

#: The status code of each refusal reason (:class:`~atroposlib.api.queue.Refused`); any other
#: reason is a 422. The one place reasons become status codes.
REFUSAL_STATUS: dict[str, int] = {
    "bad_json": 400,  # the body is not JSON
    "too_many_envs": 409,  # run-api --max-envs
    "body_too_large": 413,  # run-api --max-request-bytes (1 MiB for other endpoints)
    "group_too_large": 413,  # one group is past the queue's byte bound
    "queue_full": 429,  # with Retry-After
    "busy": 503,  # the ingest budget is taken (with Retry-After)
    "parser_died": 503,  # the body parser process died (with Retry-After)
}


def _refusal_response(refused: Refused, where: str = "body") -> JSONResponse:
    """The answer to a refusal: its status from :data:`REFUSAL_STATUS`, its fields located in
    ``where`` (``body`` or ``query``), ``Retry-After`` when retrying can help."""
    detail = [{**error, "loc": [where, *error["loc"]]} for error in refused.errors]
    headers = None if refused.retry_after is None else {"Retry-After": str(refused.retry_after)}
    status = REFUSAL_STATUS.get(refused.reason, 422)
    return JSONResponse({"detail": detail}, status, headers=headers)


def _bad_param(msg: str, field: str, kind: str = "value_error") -> Refused:
    """A request parameter an endpoint refuses itself (422)."""
    return Refused("invalid", msg, (field,), kind)


class ClientGone(Exception):
    """The client disconnected before its body arrived."""


async def _body_chunks(receive: Receive) -> AsyncIterator[bytes]:
    """The request body's chunks as they arrive; :class:`ClientGone` if the client hangs up."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return


class RequestBodyMiddleware:
    """Outermost layer and the one place a request body is read (see :func:`read_body`).

    Caps the body (``--max-request-bytes`` for scored data, ``SMALL_BODY_BYTES`` for every other
    endpoint) before and after gzip decompression, charges it to the ingest byte budget while it
    is held, and answers 413, ``400 Invalid gzip payload`` or ``503`` + ``Retry-After`` itself.
    A gzip body is handed on decompressed without the header (as upstream's middleware does).

    ``POST /scored_data(_list)`` from envs then skip the framework stack and go straight to the
    ingest function (about a third of the server's per-request CPU); requests with an
    ``Origin`` header (browsers, which need the CORS and origin checks) take the normal path.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        budget: IngestBudget,
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
        chunked = from_browser = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                declared = value
            elif name == b"content-encoding":
                encoding = value.decode("latin-1").lower()
            elif name == b"transfer-encoding":
                chunked = True
            elif name == b"origin":
                from_browser = True
        if not chunked and declared in (None, b"0"):
            await self.app(scope, receive, send)  # no body to read
            return
        ingest_path = scope["method"] == "POST" and scope["path"] in INGEST_PATHS
        cap = self.max_bytes if ingest_path else min(self.max_bytes, SMALL_BODY_BYTES)
        refused: Refused | None = None
        try:
            if declared is not None and (not declared.isdigit() or int(declared) > cap):
                raise BodyTooLarge
            body = await read_body(_body_chunks(receive), cap, "gzip" in encoding, self.budget)
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
            await _refusal_response(refused)(scope, receive, send)
            return
        try:
            if ingest_path and not from_browser:
                ingest = scope["app"].state.ingest  # set by create_app; Starlette fills "app"
                response = await ingest(body.data, scope["path"] == "/scored_data_list")
                await response(scope, receive, send)
                return
            if encoding:
                headers = MutableHeaders(scope=scope)
                headers["content-length"] = str(len(body.data))
                del headers["content-encoding"]
                del headers["transfer-encoding"]
            await self.app(scope, replay_body(body.data, receive), send)
        finally:
            body.release()


#: Endpoints open without the API key (``run-api --api-key``): liveness probes, GET/HEAD only.
OPEN_PATHS = frozenset({"/", "/health"})


def _digest(value: bytes) -> bytes:
    # compare fixed-length digests so the comparison time does not depend on the key's length
    return hashlib.sha256(value).digest()


class ApiKeyMiddleware:
    """``run-api --api-key``: every request must carry the key as ``Authorization: Bearer KEY``
    or ``X-API-Key: KEY``, else ``401`` with a JSON ``detail`` (counted in ``/metrics`` as
    ``refused_groups_total{reason="unauthorized"}``). Open without it: ``GET``/``HEAD`` of
    :data:`OPEN_PATHS` (liveness probes) and CORS preflights (browsers never put credentials
    on those). Keys are compared in constant time; the key is never logged.

    Sits outside :class:`RequestBodyMiddleware`, so a refused request's body is never read.
    """

    def __init__(self, app: ASGIApp, key: str, on_refused: Callable[[str], None]) -> None:
        self.app = app
        self._key_digest = _digest(key.encode("utf-8"))
        self.on_refused = on_refused

    def _is_open(self, scope: Scope) -> bool:
        method = scope["method"]
        if method in ("GET", "HEAD") and scope["path"] in OPEN_PATHS:
            return True
        if method == "OPTIONS":  # a CORS preflight: Origin + Access-Control-Request-Method
            names = {name for name, _ in scope["headers"]}
            return b"origin" in names and b"access-control-request-method" in names
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or (
            scope["type"] == "http" and self._is_open(scope)
        ):
            await self.app(scope, receive, send)
            return
        offered: list[bytes] = []
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                if scheme.lower() == b"bearer":
                    offered.append(token.strip())
            elif name == b"x-api-key":
                offered.append(value.strip())
        # every offered key is compared (no early exit), each in constant time
        matched = False
        for token in offered:
            matched |= hmac.compare_digest(_digest(token), self._key_digest)
        if matched:
            await self.app(scope, receive, send)
            return
        self.on_refused("unauthorized")
        if offered:
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
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "unauthorized"})
            return
        await JSONResponse(
            {"detail": message}, 401, headers={"WWW-Authenticate": 'Bearer realm="atropos"'}
        )(scope, receive, send)


class SkipPrecompressedGZip(GZipMiddleware):
    """Starlette's response gzip, leaving alone responses that already set Content-Encoding."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") in _SELF_ENCODED_PATHS:
            # /batch compresses itself off the event loop; ingest replies are a few bytes
            await self.app(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def _framed(payloads: list[bytes]) -> list[bytes]:
    """The pieces of a ``{"batch": [...]}`` body around the groups' stored payloads
    (``b"".join`` of them is the JSON; joined by the caller, off the event loop when it
    compresses)."""
    pieces = [b'{"batch":[']
    for i, payload in enumerate(payloads):
        if i:
            pieces.append(b",")
        pieces.append(payload)
    pieces.append(b"]}")
    return pieces


def _join_and_gzip(pieces: list[bytes], level: int) -> bytes:
    """One batch body, gzip-compressed (runs in a worker thread; ISA-L/zlib release the GIL)."""
    return _gzip.compress(b"".join(pieces), level)


def _accepts_gzip(request: Request) -> bool:
    return "gzip" in request.headers.get("accept-encoding", "").lower()


def _json(data: Any) -> Response:
    """A JSON response serialised with orjson (skips FastAPI's response encoding)."""
    return Response(json_bytes(data), media_type="application/json")


def create_app(settings: ApiSettings | None = None) -> FastAPI:
    """Build the trajectory API application around a fresh :class:`TrajectoryQueue`."""
    settings = settings or ApiSettings.from_env()
    store = (
        SqliteStore(settings.store, synchronous=settings.store_sync)
        if settings.store
        else MemoryStore()
    )
    queue = TrajectoryQueue(
        store,
        QueueLimits(
            max_sequences=settings.max_queue_sequences,
            max_bytes=settings.max_queue_bytes,
            retry_after_s=settings.retry_after_s,
            max_envs=settings.max_envs,
        ),
        max_staleness=settings.max_staleness,
    )

    app = FastAPI(
        title="AtroposLib API",
        description="Trajectory API: environments POST scored groups, trainers GET batches.",
    )
    app.state.queue = queue
    app.state.settings = settings

    # middleware run outermost first: host/origin checks, CORS, API key, body reading, gzip
    app.add_middleware(SkipPrecompressedGZip, minimum_size=_GZIP_MINIMUM)
    budget = IngestBudget(max(settings.ingest_budget_bytes, settings.max_request_bytes))
    app.state.ingest_budget = budget
    app.add_middleware(
        RequestBodyMiddleware,
        max_bytes=settings.max_request_bytes,
        budget=budget,
        retry_after_s=settings.retry_after_s,
        on_refused=queue.count_refused,
    )
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, key=settings.api_key, on_refused=queue.count_refused)
    origins = split_names(settings.cors_allow_origin)
    if origins:  # outside the key check, so a browser can read its 401 and send preflights
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_credentials=settings.cors_credentials,
            allow_methods=["*"],
            allow_headers=["*"],
        )

    app.add_middleware(  # outermost: refuses before a body is read
        HttpSecurityMiddleware,
        allowed_hosts=loopback_hosts(settings.host, split_names(settings.allowed_hosts)),
        allowed_origins=origins,
        state_changing_gets=STATE_CHANGING_GETS,
    )

    @app.exception_handler(Refused)
    async def _refused(request: Request, exc: Refused) -> JSONResponse:
        # a refusal that names a parameter of the query string (/batch's ack, /metrics' format)
        # is located there; anything else is about the body
        in_query = bool(exc.loc) and exc.loc[0] in request.query_params
        return _refusal_response(exc, "query" if in_query else "body")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        queue.count_refused("invalid")
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in exc.errors()
        ]
        return JSONResponse({"detail": errors}, 422)

    parser = GroupParser(settings.ingest_threads)

    @app.on_event("shutdown")
    async def _close_store() -> None:
        parser.close()
        store.close()

    @app.get("/")
    async def root() -> dict[str, str]:
        """Upstream's liveness probe (open without ``--api-key``)."""
        return {"message": "AtroposLib API"}

    @app.post("/register")
    async def register(registration: Registration) -> dict[str, int]:
        """Trainer registration. The first call configures the run; later calls add a uuid."""
        if registration.batch_size <= 0:
            raise _bad_param("batch_size must be a positive number of sequences", "batch_size")
        return await run_in_threadpool(queue.register_trainer, registration)

    @app.post("/register-env")
    async def register_env(register_env: RegisterEnv) -> dict[str, Any]:
        """Env registration; answers ``wait for trainer to start`` until the first ``/batch``."""
        if register_env.group_size <= 0:
            raise _bad_param("group_size must be at least 1", "group_size")
        fraction = register_env.min_batch_allocation
        if fraction is not None and not 0.0 <= fraction <= 1.0:
            raise _bad_param("min_batch_allocation must be between 0 and 1", "min_batch_allocation")
        return await run_in_threadpool(queue.register_env, register_env)

    @app.post("/disconnect-env")
    async def disconnect_env(body: EnvIdentifier) -> Any:
        try:
            return await run_in_threadpool(queue.disconnect_env, body.env_id)
        except UnknownEnv as exc:
            return JSONResponse({"status": "failure", "error": str(exc)}, 404)

    @app.get("/wandb_info")
    async def wandb_info() -> Response:
        return _json(queue.wandb_info())

    @app.get("/info")
    async def info() -> dict[str, int]:
        return queue.info()

    @app.get("/status")
    async def status() -> dict[str, int]:
        return queue.status()

    @app.api_route("/status-env", methods=["GET", "POST"])
    async def status_env(request: Request) -> Any:
        """Per-env queue view. ``env_id`` from ``?env_id=`` or a JSON body (GET or POST)."""
        env_id: Any = request.query_params.get("env_id")
        if env_id is None:
            raw = await request.body()
            if not raw:
                raise _bad_param("env_id is required (JSON body or ?env_id=)", "env_id", "missing")
            data = parse_json(raw)
            if not isinstance(data, dict) or "env_id" not in data:
                raise _bad_param("env_id is required", "env_id", "missing")
            env_id = data["env_id"]
        try:
            env_id = EnvIdentifier.model_validate({"env_id": env_id}).env_id
        except ValidationError:
            raise _bad_param("env_id must be an integer", "env_id", "int_parsing") from None
        try:
            return queue.status_env(env_id)
        except UnknownEnv as exc:  # the env addressed does not exist: 404, not a refusal
            where = "query" if "env_id" in request.query_params else "body"
            detail = [{"loc": [where, "env_id"], "msg": str(exc), "type": "unknown_env"}]
            return JSONResponse({"detail": detail}, 404)

    async def ingest(raw: bytes, many: bool) -> Response:
        """Queue the scored group(s) in ``raw`` (decompressed); every outcome is a response."""
        try:
            groups = await parser(raw, many)
        except ParserGone:
            refused = Refused(
                "parser_died",
                "the body parser process died (out of memory?) while parsing this request: "
                "retry later, or send smaller requests",
                retry_after=max(1, settings.retry_after_s),
            )
            queue.count_refused(refused.reason)
            return _refusal_response(refused)
        except Refused as exc:
            queue.count_refused(exc.reason)  # the queue counts what it refuses itself
            return _refusal_response(exc)
        try:
            if queue.store.durable:
                results = await run_in_threadpool(queue.add_groups, groups)
            else:
                results = queue.add_groups(groups)
        except Refused as exc:
            return _refusal_response(exc)
        if not many:
            return _json(results[0])
        reply: dict[str, Any] = {"status": "received", "groups_processed": len(results)}
        buffered = [r for r in results if r["status"] == "buffered"]
        if buffered:
            reply["buffered"] = len(buffered)
            reply["last_buffer_size"] = buffered[-1]["buffer_size"]
        return _json(reply)

    app.state.ingest = ingest

    scored_schema = {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": ScoredData.model_json_schema()}},
        }
    }
    scored_list_schema = {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": {"type": "array", "items": ScoredData.model_json_schema()}
                }
            },
        }
    }

    @app.post("/scored_data", openapi_extra=scored_schema)
    async def scored_data(request: Request) -> Response:
        """Queue one scored group (``ScoredData``)."""
        return await ingest(await request.body(), many=False)

    @app.post("/scored_data_list", openapi_extra=scored_list_schema)
    async def scored_data_list(request: Request) -> Response:
        """Queue several scored groups at once (all or none)."""
        return await ingest(await request.body(), many=True)

    @app.get("/batch")
    async def batch(
        request: Request, ack: Annotated[int | None, Query(ge=0, lt=2**62)] = None
    ) -> Response:
        """Hand the trainer its next batch (FIFO), or ``{"batch": null}`` when none is ready.

        ``?ack=N`` (optional, not in upstream): the trainer has received every batch up to step
        N. Batches are then kept until acknowledged and one whose response was lost is handed
        out again (at-least-once); without it a batch is gone once handed out (at-most-once,
        upstream's behaviour). The batch's step is in the ``X-Atropos-Step`` header.
        """
        take = partial(queue.take_batch, ack)
        result = await run_in_threadpool(take) if queue.store.durable else take()
        if isinstance(result, dict):
            return _json(result)
        headers = {"X-Atropos-Step": str(result.step)}
        if result.redelivered:
            headers["X-Atropos-Redelivered"] = "1"
        pieces = _framed(result)
        if _accepts_gzip(request) and sum(map(len, pieces)) >= _GZIP_MINIMUM:
            level = min(settings.gzip_level, _MAX_GZIP_LEVEL)
            body = await run_in_threadpool(_join_and_gzip, pieces, level)
            headers.update({"Content-Encoding": "gzip", "Vary": "Accept-Encoding"})
            return Response(body, media_type="application/json", headers=headers)
        return Response(b"".join(pieces), media_type="application/json", headers=headers)

    @app.get("/latest_example")
    async def latest_example() -> Response:
        latest = queue.latest_example()
        body = latest if latest is not None else orjson.dumps(EMPTY_EXAMPLE)
        return Response(body, media_type="application/json")

    @app.api_route("/reset_data", methods=["GET", "POST"])
    async def reset_data() -> PlainTextResponse:
        """Forget the run: registration, envs, queue (dropped groups are counted) and step."""
        await run_in_threadpool(queue.reset)
        return PlainTextResponse("Reset successful", status_code=200)

    @app.get("/metrics")
    async def metrics(format: str = "prometheus") -> Response:
        """Queue depth, accepted/refused/dropped counts by reason, batches served, per env.

        Prometheus text by default; ``?format=json`` for JSON.
        """
        snapshot = queue.metrics()
        if format == "json":
            return _json(snapshot)
        if format != "prometheus":
            raise _bad_param("format must be prometheus or json", "format")
        return PlainTextResponse(prometheus_text(snapshot), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """Liveness probe (not in upstream; open without ``--api-key``)."""
        return {"status": "ok", "registered": queue.registered, "step": queue.step}

    return app


def create_app_from_env() -> FastAPI:
    """Factory for ``uvicorn --factory`` (used by ``run-api --reload``): settings from env vars."""
    return create_app(ApiSettings.from_env())


_default_app: FastAPI | None = None


def __getattr__(name: str) -> Any:
    """Upstream's import path ``atroposlib.api.server:app``, built on first access from the
    ``ATROPOS_*`` environment variables (so importing this module opens no store)."""
    global _default_app
    if name == "app":
        if _default_app is None:
            _default_app = create_app_from_env()
        return _default_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
