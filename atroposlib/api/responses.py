"""How the trajectory API answers: refusals to status codes (one table), JSON written with
orjson, and batch bodies framed around the groups' stored payloads."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from atroposlib.api.errors import Refused
from atroposlib.api.metrics import json_bytes

try:  # Intel ISA-L: 4x faster gzip than zlib, same format
    from isal import igzip as _gzip

    MAX_GZIP_LEVEL = 3
except ImportError:  # pragma: no cover - platforms without isal wheels
    import gzip as _gzip  # type: ignore[no-redef]

    MAX_GZIP_LEVEL = 9

__all__ = [
    "GZIP_MINIMUM",
    "REFUSAL_STATUS",
    "accepts_gzip",
    "bad_param",
    "framed",
    "join_and_gzip",
    "json_response",
    "refusal_response",
]

#: Responses smaller than this are never gzipped (upstream's GZipMiddleware minimum_size).
GZIP_MINIMUM = 1000

#: The status code of each refusal reason (:class:`~atroposlib.api.errors.Refused`); any other
#: reason is a 422. The one place reasons become status codes.
REFUSAL_STATUS: dict[str, int] = {
    "bad_json": 400,  # the body is not JSON
    "too_many_envs": 409,  # run-api --max-envs
    "replay": 409,  # run-api --replay takes no envs and no groups
    "unknown_consumer": 409,  # /batch?consumer= not registered in this run (restarted? reset?)
    "superseded": 409,  # /batch?rank= taken over by a trainer registered later
    "body_too_large": 413,  # run-api --max-request-bytes (1 MiB for other endpoints)
    "group_too_large": 413,  # one group is past the queue's byte bound
    "queue_full": 429,  # with Retry-After
    "busy": 503,  # the ingest budget is taken (with Retry-After)
    "parser_died": 503,  # the body parser process died (with Retry-After)
}


def refusal_response(refused: Refused, where: str = "body") -> JSONResponse:
    """The answer to a refusal: its status from :data:`REFUSAL_STATUS`, its fields located in
    ``where`` (``body`` or ``query``), ``Retry-After`` when retrying can help."""
    detail = [{**error, "loc": [where, *error["loc"]]} for error in refused.errors]
    headers = None if refused.retry_after is None else {"Retry-After": str(refused.retry_after)}
    status = REFUSAL_STATUS.get(refused.reason, 422)
    return JSONResponse({"detail": detail}, status, headers=headers)


def bad_param(msg: str, field: str, kind: str = "value_error") -> Refused:
    """A request parameter an endpoint refuses itself (422)."""
    return Refused("invalid", msg, (field,), kind)


def json_response(data: Any) -> Response:
    """A JSON response serialised with orjson (skips FastAPI's response encoding)."""
    return Response(json_bytes(data), media_type="application/json")


def accepts_gzip(request: Request) -> bool:
    """Whether the client accepts a gzip-encoded response."""
    return "gzip" in request.headers.get("accept-encoding", "").lower()


def framed(payloads: list[bytes]) -> list[bytes]:
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


def join_and_gzip(pieces: list[bytes], level: int) -> bytes:
    """One batch body, gzip-compressed (runs in a worker thread; ISA-L/zlib release the GIL)."""
    return _gzip.compress(b"".join(pieces), level)
