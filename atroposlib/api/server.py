"""The trajectory API: a thin HTTP layer over :class:`~atroposlib.api.queue.TrajectoryQueue`.

Same endpoints, methods, request fields and response shapes as upstream Atropos
(``atroposlib.api.server:app``), so upstream environments, trainers and scripts work unchanged.
What differs is documented in ``docs/compat.md``: bad input gets a 4xx that names the field
instead of a 500, batches go out FIFO, the queue is bounded (429 + ``Retry-After``) and can be
made durable (``run-api --store PATH``), and ``run-api --api-key`` makes every endpoint but
``GET /health`` and ``GET /`` require a shared key.

Where things live (FastAPI's "bigger applications" layout):

* :func:`create_app` (here): opens the state, installs the middleware, includes the routers,
  maps exceptions to responses; the application's lifespan closes the state on shutdown.
* :mod:`atroposlib.api.routers`: the routes, one router per concern (``env``, ``trainer``,
  ``ops``); they get the state through :mod:`atroposlib.api.dependencies`.
* :mod:`atroposlib.api.middleware`: what runs around every route, in order, including the one
  place a request skips the routes (the ingest fast lane).
* :mod:`atroposlib.api.responses`: refusal reasons to status codes (one table), batch framing.
* Below HTTP: :mod:`~atroposlib.api.ingest` (parse, validate, serialise bodies),
  :mod:`~atroposlib.api.queue`, :mod:`~atroposlib.api.registry`,
  :mod:`~atroposlib.api.partials`, :mod:`~atroposlib.api.packing`,
  :mod:`~atroposlib.api.metrics`, :mod:`~atroposlib.api.store`.

Performance notes: each group is validated and serialised once when it arrives (in a worker
thread, off the event loop); ``GET /batch`` concatenates stored payloads, and compresses the
answer in a worker thread when the client accepts gzip.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from atroposlib.api import middleware
from atroposlib.api.dependencies import ApiState
from atroposlib.api.errors import Refused
from atroposlib.api.responses import REFUSAL_STATUS, refusal_response
from atroposlib.api.routers import env, evals, ops, trainer
from atroposlib.api.settings import ApiSettings

__all__ = ["REFUSAL_STATUS", "create_app", "create_app_from_env"]

logger = logging.getLogger("atroposlib.api")


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    # the state is opened by create_app, before any server binds a port, so that a store that
    # cannot be opened is an error at start-up; shutdown closes it
    yield
    app.state.api.close()


def create_app(settings: ApiSettings | None = None) -> FastAPI:
    """Build the trajectory API application: open its state (the store, ``--store``, and the
    queue restored from it), install the middleware and include the routers. Raises what
    opening the store raises."""
    state = ApiState.open(settings or ApiSettings.from_env())
    app = FastAPI(
        title="AtroposLib API",
        description="Trajectory API: environments POST scored groups, trainers GET batches.",
        lifespan=_lifespan,
    )
    app.state.api = state
    middleware.install(app, state)

    @app.exception_handler(Refused)
    async def _refused(request: Request, exc: Refused) -> JSONResponse:
        # a refusal that names a parameter of the query string (/batch's ack, /metrics' format)
        # is located there; anything else is about the body
        in_query = bool(exc.loc) and exc.loc[0] in request.query_params
        return refusal_response(exc, "query" if in_query else "body")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        state.queue.count_refused("invalid")
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in exc.errors()
        ]
        return JSONResponse({"detail": errors}, 422)

    for router in (env.router, trainer.router, evals.router, ops.router):
        app.include_router(router)
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
