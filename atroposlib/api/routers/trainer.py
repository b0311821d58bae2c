"""Routes trainers call: ``/register``, ``/batch`` and the run's settings and step
(``/info``, ``/wandb_info``, ``/status``; environments read the last two as well)."""

from __future__ import annotations

from functools import partial
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from atroposlib.api.dependencies import Queue, State
from atroposlib.api.models import Registration
from atroposlib.api.responses import (
    GZIP_MINIMUM,
    MAX_GZIP_LEVEL,
    accepts_gzip,
    bad_param,
    framed,
    join_and_gzip,
    json_response,
)

router = APIRouter(tags=["trainers"])


@router.post("/register")
async def register(registration: Registration, queue: Queue) -> dict[str, int]:
    """Trainer registration. The first call configures the run; later calls add a uuid."""
    if registration.batch_size <= 0:
        raise bad_param("batch_size must be a positive number of sequences", "batch_size")
    return await run_in_threadpool(queue.register_trainer, registration)


@router.get("/batch")
async def batch(
    request: Request,
    state: State,
    ack: Annotated[int | None, Query(ge=0, lt=2**62)] = None,
    rank: Annotated[int, Query(ge=0, lt=2**31)] = 0,
    consumer: Annotated[int | None, Query(ge=0, lt=2**128)] = None,
) -> Response:
    """Hand the trainer its next batch (FIFO), or ``{"batch": null}`` when none is ready.

    Not in upstream, all optional: ``?ack=N``: the trainer has received every batch up to
    step N. Batches are then kept until acknowledged and one whose response was lost is
    handed out again (at-least-once); without it a batch is gone once handed out
    (at-most-once, upstream's behaviour). ``?rank=R`` (default 0): which process of a
    multi-process trainer asks; each batch goes to one rank, and acknowledgements and
    redelivery are per rank. ``?consumer=UUID``: the uuid ``/register`` returned, so that a
    rank is served to one trainer only (the one registered last; 409 for an earlier one). The
    batch's step is in the ``X-Atropos-Step`` header.
    """
    queue = state.queue
    take = partial(queue.take_batch, ack, rank, consumer)
    result = await run_in_threadpool(take) if queue.store.durable else take()
    if isinstance(result, dict):
        return json_response(result)
    headers = {"X-Atropos-Step": str(result.step)}
    if result.redelivered:
        headers["X-Atropos-Redelivered"] = "1"
    pieces = framed(result)
    if accepts_gzip(request) and sum(map(len, pieces)) >= GZIP_MINIMUM:
        level = min(state.settings.gzip_level, MAX_GZIP_LEVEL)
        body = await run_in_threadpool(join_and_gzip, pieces, level)
        headers.update({"Content-Encoding": "gzip", "Vary": "Accept-Encoding"})
        return Response(body, media_type="application/json", headers=headers)
    return Response(b"".join(pieces), media_type="application/json", headers=headers)


@router.get("/info")
async def info(queue: Queue) -> dict[str, int]:
    """The registered batch size and longest sequence (``-1`` each before ``/register``)."""
    return queue.info()


@router.get("/wandb_info")
async def wandb_info(queue: Queue) -> Response:
    """The W&B group and project the trainer registered."""
    return json_response(queue.wandb_info())


@router.get("/status")
async def status(queue: Queue) -> dict[str, int]:
    """The step (batches handed out) and the number of queued groups."""
    return queue.status()
