"""The trajectory API: a thin HTTP layer over :class:`~atroposlib.api.queue.TrajectoryQueue`.

Same endpoints, methods, request fields and response shapes as upstream Atropos
(``atroposlib.api.server:app``), so upstream environments, trainers and scripts work unchanged.
What differs is documented in ``docs/compat.md``: bad input gets a 4xx that names the field
instead of a 500, batches go out FIFO, the queue is bounded (429 + ``Retry-After``) and can be
made durable (``run-api --store PATH``).

Performance notes: each group is validated and serialised once when it arrives (in a worker
thread, off the event loop); ``GET /batch`` concatenates stored payloads, and compresses the
answer in a worker thread when the client accepts gzip.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
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
    ClientGone,
    GroupParser,
    HTTPProblem,
    IngestBudget,
    IngestBusy,
    InvalidGzip,
    ParserGone,
    read_body,
)
from atroposlib.api.models import EnvIdentifier, RegisterEnv, Registration, ScoredData
from atroposlib.api.queue import (
    QueueFull,
    QueueLimits,
    Refused,
    TrajectoryQueue,
    UnknownEnv,
)
from atroposlib.api.settings import ApiSettings
from atroposlib.api.store import MemoryStore, SqliteStore
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
        try:
            if declared is not None and (not declared.isdigit() or int(declared) > cap):
                raise BodyTooLarge
            body = await read_body(receive, cap, "gzip" in encoding, self.budget)
        except BodyTooLarge:
            self.on_refused("body_too_large")
            await _too_large_response(cap, ingest_path)(scope, receive, send)
            return
        except InvalidGzip:
            self.on_refused("bad_gzip")
            await PlainTextResponse("Invalid gzip payload", status_code=400)(scope, receive, send)
            return
        except IngestBusy:
            self.on_refused("busy")
            await _busy_response(self.budget.limit, self.retry_after_s)(scope, receive, send)
            return
        except ClientGone:
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


class SkipPrecompressedGZip(GZipMiddleware):
    """Starlette's response gzip, leaving alone responses that already set Content-Encoding."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") in _SELF_ENCODED_PATHS:
            # /batch compresses itself off the event loop; ingest replies are a few bytes
            await self.app(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def _join_and_gzip(pieces: list[bytes], level: int) -> bytes:
    """One batch body, gzip-compressed (runs in a worker thread; ISA-L/zlib release the GIL)."""
    return _gzip.compress(b"".join(pieces), level)


def _accepts_gzip(request: Request) -> bool:
    return "gzip" in request.headers.get("accept-encoding", "").lower()


def _json_bytes(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        # Python's json module (what `requests` uses) writes NaN/Infinity, which orjson refuses;
        # parse them so the checks can name the field instead of failing the whole body.
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise HTTPProblem(
            400, f"request body is not valid JSON: {exc}", kind="json_invalid"
        ) from None
    except RecursionError:
        raise HTTPProblem(
            400, "request body is not valid JSON: nested too deeply", kind="json_invalid"
        ) from None


def _too_large_response(limit: int, scored_data: bool = True) -> JSONResponse:
    why = "(run-api --max-request-bytes)" if scored_data else "for this endpoint"
    return _problem_response(
        HTTPProblem(413, f"request body exceeds the limit of {limit} bytes {why}", kind="too_large")
    )


def _busy_response(budget: int, retry_after_s: int) -> JSONResponse:
    return _problem_response(
        HTTPProblem(
            503,
            "request bodies being read and parsed already hold the server's ingest budget of "
            f"{budget} bytes (run-api --ingest-budget-bytes): retry later",
            kind="busy",
            headers={"Retry-After": str(max(1, retry_after_s))},
        )
    )


def _json(data: Any) -> Response:
    """A JSON response serialised with orjson (skips FastAPI's response encoding).

    Text that is not valid Unicode (a lone surrogate, left in a store written before such
    input was refused) falls back to Python's json module, which writes it as an escape.
    """
    try:
        body = orjson.dumps(data)
    except orjson.JSONEncodeError:
        body = json.dumps(data).encode()
    return Response(body, media_type="application/json")


def _problem_response(problem: HTTPProblem) -> JSONResponse:
    return JSONResponse({"detail": problem.detail}, problem.status, headers=problem.headers)


def _label(value: Any) -> str:
    """A Prometheus label value: backslash, double quote and newline escaped as the text format
    requires, and text that is not valid Unicode (a lone surrogate) written as escapes."""
    text = str(value).encode("utf-8", "backslashreplace").decode("utf-8")
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _prometheus(m: dict[str, Any]) -> str:
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP atropos_{name} {help_}")
        lines.append(f"# TYPE atropos_{name} {kind}")
        for labels, value in samples:
            lines.append(f"atropos_{name}{labels} {value}")

    metric("step", "gauge", "Trainer step (batches handed out).", [("", m["step"])])
    metric("queue_groups", "gauge", "Groups waiting in the queue.", [("", m["queue_groups"])])
    metric("queue_sequences", "gauge", "Sequences in the queue.", [("", m["queue_sequences"])])
    metric("queue_bytes", "gauge", "Serialised bytes in the queue.", [("", m["queue_bytes"])])
    metric(
        "buffered_sequences",
        "gauge",
        "Sequences in partial groups waiting to be merged.",
        [("", m["buffered_sequences"])],
    )
    metric("limit_bytes", "gauge", "Queue byte limit.", [("", m["limit_bytes"])])
    metric("limit_sequences", "gauge", "Queue sequence limit.", [("", m["limit_sequences"])])
    metric("accepted_groups_total", "counter", "Groups accepted.", [("", m["accepted_groups"])])
    metric(
        "accepted_sequences_total",
        "counter",
        "Sequences accepted.",
        [("", m["accepted_sequences"])],
    )
    metric(
        "refused_groups_total",
        "counter",
        "Groups (or requests) refused, by reason.",
        [(f'{{reason="{_label(k)}"}}', v) for k, v in sorted(m["refused"].items())],
    )
    metric(
        "dropped_groups_total",
        "counter",
        "Accepted groups dropped later, by reason.",
        [(f'{{reason="{_label(k)}"}}', v) for k, v in sorted(m["dropped"].items())],
    )
    metric("batches_served_total", "counter", "Batches handed out.", [("", m["batches_served"])])
    metric(
        "sequences_served_total",
        "counter",
        "Sequences handed out.",
        [("", m["sequences_served"])],
    )
    metric(
        "unacknowledged_batches",
        "gauge",
        "Batches handed out to an acknowledging trainer (GET /batch?ack=) and not yet acknowledged.",
        [("", m["unacknowledged_batches"])],
    )
    metric(
        "redelivered_batches_total",
        "counter",
        "Unacknowledged batches handed out again (a lost response, a restarted trainer).",
        [("", m["redelivered_batches"])],
    )
    env_samples = [
        (f'{{env_id="{_label(e["env_id"])}",name="{_label(e["name"])}"}}', e) for e in m["envs"]
    ]
    metric(
        "env_queued_sequences",
        "gauge",
        "Queued sequences per env.",
        [(lbl, e["queued_sequences"]) for lbl, e in env_samples],
    )
    metric(
        "env_accepted_groups_total",
        "counter",
        "Accepted groups per env.",
        [(lbl, e["accepted_groups"]) for lbl, e in env_samples],
    )
    metric(
        "env_served_groups_total",
        "counter",
        "Groups handed out per env.",
        [(lbl, e["served_groups"]) for lbl, e in env_samples],
    )
    return "\n".join(lines) + "\n"


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
    )

    app = FastAPI(
        title="AtroposLib API",
        description="Trajectory API: environments POST scored groups, trainers GET batches.",
    )
    app.state.queue = queue
    app.state.settings = settings

    app.add_middleware(SkipPrecompressedGZip, minimum_size=_GZIP_MINIMUM)
    origins = split_names(settings.cors_allow_origin)
    if origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_credentials=settings.cors_credentials,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    budget = IngestBudget(max(settings.ingest_budget_bytes, settings.max_request_bytes))
    app.state.ingest_budget = budget
    app.add_middleware(
        RequestBodyMiddleware,
        max_bytes=settings.max_request_bytes,
        budget=budget,
        retry_after_s=settings.retry_after_s,
        on_refused=queue.count_refused,
    )

    app.add_middleware(  # outermost: refuses before a body is read
        HttpSecurityMiddleware,
        allowed_hosts=loopback_hosts(settings.host, split_names(settings.allowed_hosts)),
        allowed_origins=origins,
        state_changing_gets=STATE_CHANGING_GETS,
    )

    @app.exception_handler(HTTPProblem)
    async def _problem(_: Request, exc: HTTPProblem) -> JSONResponse:
        return _problem_response(exc)

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
        return {"message": "AtroposLib API"}

    @app.post("/register")
    async def register(registration: Registration) -> dict[str, int]:
        """Trainer registration. The first call configures the run; later calls add a uuid."""
        if registration.batch_size <= 0:
            raise HTTPProblem(
                422, "batch_size must be a positive number of sequences", ("body", "batch_size")
            )
        return await run_in_threadpool(queue.register_trainer, registration)

    @app.post("/register-env")
    async def register_env(register_env: RegisterEnv) -> dict[str, Any]:
        """Env registration; answers ``wait for trainer to start`` until the first ``/batch``."""
        if register_env.group_size <= 0:
            raise HTTPProblem(422, "group_size must be at least 1", ("body", "group_size"))
        fraction = register_env.min_batch_allocation
        if fraction is not None and not 0.0 <= fraction <= 1.0:
            raise HTTPProblem(
                422,
                "min_batch_allocation must be between 0 and 1",
                ("body", "min_batch_allocation"),
            )
        try:
            return await run_in_threadpool(queue.register_env, register_env)
        except Refused as exc:
            queue.count_refused(exc.reason)
            raise HTTPProblem(exc.status, exc.message, ("body",), exc.reason) from None

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
                raise HTTPProblem(
                    422, "env_id is required (JSON body or ?env_id=)", ("body", "env_id"), "missing"
                )
            data = _json_bytes(raw)
            if not isinstance(data, dict) or "env_id" not in data:
                raise HTTPProblem(422, "env_id is required", ("body", "env_id"), "missing")
            env_id = data["env_id"]
            loc: tuple[Any, ...] = ("body", "env_id")
        else:
            loc = ("query", "env_id")
        try:
            env_id = EnvIdentifier.model_validate({"env_id": env_id}).env_id
        except ValidationError:
            raise HTTPProblem(422, "env_id must be an integer", loc, "int_parsing") from None
        try:
            return queue.status_env(env_id)
        except UnknownEnv as exc:
            raise HTTPProblem(404, str(exc), loc, "unknown_env") from None

    async def ingest(raw: bytes, many: bool) -> Response:
        """Queue the scored group(s) in ``raw`` (decompressed); every outcome is a response."""
        try:
            groups = await parser(raw, many)
            if queue.store.durable:
                results = await run_in_threadpool(queue.add_groups, groups)
            else:
                results = queue.add_groups(groups)
        except ParserGone:
            queue.count_refused("parser_died")
            return _problem_response(
                HTTPProblem(
                    503,
                    "the body parser process died (out of memory?) while parsing this request: "
                    "retry later, or send smaller requests",
                    kind="parser_died",
                    headers={"Retry-After": str(max(1, settings.retry_after_s))},
                )
            )
        except HTTPProblem as exc:
            queue.count_refused("invalid" if exc.status == 422 else "bad_json")
            return _problem_response(exc)
        except QueueFull as exc:
            return _problem_response(
                HTTPProblem(
                    429,
                    exc.message,
                    ("body",),
                    "queue_full",
                    headers={"Retry-After": str(exc.retry_after)},
                )
            )
        except Refused as exc:
            return _problem_response(
                HTTPProblem(exc.status, exc.message, ("body", *exc.loc), exc.reason)
            )
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
        try:
            result = await run_in_threadpool(take) if queue.store.durable else take()
        except Refused as exc:
            return _problem_response(HTTPProblem(exc.status, exc.message, exc.loc))
        if isinstance(result, dict):
            return _json(result)
        headers = {"X-Atropos-Step": str(result.step)}
        if result.redelivered:
            headers["X-Atropos-Redelivered"] = "1"
        if _accepts_gzip(request) and sum(map(len, result)) >= _GZIP_MINIMUM:
            level = min(settings.gzip_level, _MAX_GZIP_LEVEL)
            body = await run_in_threadpool(_join_and_gzip, result, level)
            headers.update({"Content-Encoding": "gzip", "Vary": "Accept-Encoding"})
            return Response(body, media_type="application/json", headers=headers)
        return Response(b"".join(result), media_type="application/json", headers=headers)

    @app.get("/latest_example")
    async def latest_example() -> Response:
        return Response(queue.latest_example(), media_type="application/json")

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
            raise HTTPProblem(422, "format must be prometheus or json", ("query", "format"))
        return PlainTextResponse(_prometheus(snapshot), media_type="text/plain; version=0.0.4")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """Liveness probe (not in upstream)."""
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
