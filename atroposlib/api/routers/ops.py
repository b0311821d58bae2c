"""Routes for operators and tools: liveness probes (``/``, ``/health``), ``/metrics``,
``/latest_example`` and ``/reset_data``."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from atroposlib.api.dependencies import Queue, State
from atroposlib.api.metrics import PROMETHEUS_CONTENT_TYPE, prometheus_text
from atroposlib.api.responses import bad_param, json_response
from atroposlib.schema import EMPTY_EXAMPLE

router = APIRouter(tags=["operations"])


# GET and HEAD: the probes are documented open to both (load balancers often send HEAD)
@router.api_route("/", methods=["GET", "HEAD"])
async def root() -> dict[str, str]:
    """Upstream's liveness probe (open without ``--api-key``)."""
    return {"message": "AtroposLib API"}


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(queue: Queue) -> dict[str, Any]:
    """Liveness probe (not in upstream; open without ``--api-key``)."""
    return {"status": "ok", "registered": queue.registered, "step": queue.step}


@router.get("/metrics")
async def metrics(queue: Queue, state: State, format: str = "prometheus") -> Response:
    """Queue depth, accepted/refused/dropped counts by reason, batches served, per env, and
    each env's latest pinned evaluation.

    Prometheus text by default; ``?format=json`` for JSON.
    """
    snapshot = queue.metrics()
    snapshot["evals"] = [{**r.wire(), "step": step} for r, step in state.evals.latest_with_step()]
    if format == "json":
        return json_response(snapshot)
    if format != "prometheus":
        raise bad_param("format must be prometheus or json", "format")
    return PlainTextResponse(prometheus_text(snapshot), media_type=PROMETHEUS_CONTENT_TYPE)


@router.get("/latest_example")
async def latest_example(queue: Queue) -> Response:
    """The last group that entered the queue (upstream's empty example before any)."""
    latest = queue.latest_example()
    body = latest if latest is not None else orjson.dumps(EMPTY_EXAMPLE)
    return Response(body, media_type="application/json")


@router.api_route("/reset_data", methods=["GET", "POST"])
async def reset_data(queue: Queue, state: State) -> PlainTextResponse:
    """Forget the run: registration, envs, queue (dropped groups are counted), step and
    pinned evaluations."""
    await run_in_threadpool(queue.reset)
    state.evals.reset()
    return PlainTextResponse("Reset successful", status_code=200)
