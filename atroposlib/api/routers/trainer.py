"""Routes trainers call: ``/register``, ``/batch`` and the run's settings and step
(``/info``, ``/wandb_info``, ``/status``; environments read the last two as well)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from atroposlib.api.dependencies import ApiState, Queue, State
from atroposlib.api.models import Registration
from atroposlib.api.queue import Batch
from atroposlib.api.responses import (
    GZIP_MINIMUM,
    MAX_GZIP_LEVEL,
    accepts_gzip,
    bad_param,
    framed,
    join_and_gzip,
    json_response,
)
from atroposlib.api.waiting import MAX_WAIT_S

router = APIRouter(tags=["trainers"])


@router.post("/register")
async def register(registration: Registration, queue: Queue) -> dict[str, int]:
    """Trainer registration. The first call configures the run; later calls add a uuid."""
    if registration.batch_size <= 0:
        raise bad_param("batch_size must be a positive number of sequences", "batch_size")
    return await run_in_threadpool(queue.register_trainer, registration)


#: Header of a long-polled ``/batch`` answer: the wait run-api honoured, in seconds (a client
#: that asked for ``wait`` and finds no such header talks to a run-api that does not long-poll).
WAIT_HEADER = "X-Atropos-Wait"
#: Headers of a long poll answered ``{"batch": null}``: sequences queued, and held as parts of
#: groups, when it gave up (what the trainer waits for, against its ``batch_size``).
QUEUED_HEADER = "X-Atropos-Queued-Sequences"
HELD_HEADER = "X-Atropos-Held-Sequences"
#: Header of every long-polled ``/batch`` answer: the groups the envs dropped before sending,
#: by reason, as JSON (``{"same_scores": 312}``; the envs' running totals from ``/status-env``),
#: so that a trainer waiting on envs that send nothing can say why.
ENV_DROPPED_HEADER = "X-Atropos-Env-Dropped-Groups"


def parse_wait(raw: str | None) -> float | None:
    """``?wait=SECONDS``: a finite number from 0 to :data:`MAX_WAIT_S`; 422 naming ``wait``."""
    if raw is None:
        return None
    try:
        wait = float(raw)
    except ValueError:
        wait = math.nan
    if not 0.0 <= wait <= MAX_WAIT_S:  # NaN fails too
        raise bad_param(
            f"wait must be a number of seconds from 0 to {MAX_WAIT_S:g} (how long /batch may "
            f"hold the request until a batch is ready), got {raw!r}",
            "wait",
            "value_error",
        )
    return wait


@router.get("/batch")
async def batch(
    request: Request,
    state: State,
    ack: Annotated[int | None, Query(ge=0, lt=2**62)] = None,
    rank: Annotated[int, Query(ge=0, lt=2**31)] = 0,
    consumer: Annotated[int | None, Query(ge=0, lt=2**128)] = None,
    wait: Annotated[str | None, Query(description="seconds to wait for a batch (0-30)")] = None,
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

    ``?wait=SECONDS`` (0 to 30; a long poll): when no batch is ready, hold the request until
    one is (woken when groups are queued, no polling) or the time is up, then answer as
    without it (``{"batch": null}``). The answer carries ``X-Atropos-Wait``.
    """
    waited = parse_wait(wait)
    queue = state.queue

    async def take(release: bool) -> Batch | dict[str, Any]:
        call = partial(queue.take_batch, ack, rank, consumer, release)
        return await run_in_threadpool(call) if queue.store.durable else call()

    if not waited:
        result = await take(True)
    else:
        result = await _long_poll(request, state, take, waited)
        if result is None:  # the client left while it waited: nothing handed out
            return Response(status_code=204)
    extra = {}
    if waited is not None:
        extra[WAIT_HEADER] = f"{waited:g}"
        # ASCII JSON (reason names come from envs): a header value must be Latin-1
        extra[ENV_DROPPED_HEADER] = json.dumps(dict(queue.env_dropped()), separators=(",", ":"))
    if isinstance(result, dict):
        if waited and result.get("batch", False) is None:
            queued, held, _ = queue.fill()
            extra.update({QUEUED_HEADER: str(queued), HELD_HEADER: str(held)})
        response = json_response(result)
        response.headers.update(extra)
        return response
    headers = {"X-Atropos-Step": str(result.step), **extra}
    if result.redelivered:
        headers["X-Atropos-Redelivered"] = "1"
    pieces = framed(result)
    if accepts_gzip(request) and sum(map(len, pieces)) >= GZIP_MINIMUM:
        level = min(state.settings.gzip_level, MAX_GZIP_LEVEL)
        body = await run_in_threadpool(join_and_gzip, pieces, level)
        headers.update({"Content-Encoding": "gzip", "Vary": "Accept-Encoding"})
        return Response(body, media_type="application/json", headers=headers)
    return Response(b"".join(pieces), media_type="application/json", headers=headers)


async def _long_poll(
    request: Request,
    state: ApiState,
    take: Callable[[bool], Awaitable[Batch | dict[str, Any]]],
    wait: float,
) -> Batch | dict[str, Any] | None:
    """Try the queue, and again after each change, until a batch is handed out or ``wait``
    seconds pass; None when the client disconnected meanwhile (then nothing was taken).

    Held parts of groups are released as a plain ``/batch`` releases them when the wait
    begins and when it ends; in between only when releasing them fills a batch, so parts
    that arrive while the trainer waits can still complete their group."""
    waiters = state.waiters
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    seen = waiters.enter()
    try:
        result = await take(True)
        while _no_batch(result):
            remaining = deadline - loop.time()
            if remaining <= 0 or waiters.closing:
                break
            await waiters.wait(seen, remaining)
            seen = waiters.version
            if await request.is_disconnected():
                return None
            timed_out = loop.time() >= deadline or waiters.closing
            result = await take(timed_out)
            if timed_out:
                break
        return result
    finally:
        waiters.leave()


def _no_batch(result: Batch | dict[str, Any]) -> bool:
    """``{"batch": null}``: nothing to hand out yet (an error dict is answered at once)."""
    return isinstance(result, dict) and result.get("batch", False) is None


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
