"""The state every route shares, and the dependencies that hand it to them.

:class:`ApiState` is built once per application by :func:`ApiState.open` (the store opened and
locked, the queue restored from it) and closed by the application's lifespan. Routes never
reach for globals: they declare ``state: State`` or ``queue: Queue`` and FastAPI passes them in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from atroposlib.api.evals import EvalBoard
from atroposlib.api.ingest import GroupParser
from atroposlib.api.queue import QueueLimits, TrajectoryQueue
from atroposlib.api.settings import ApiSettings
from atroposlib.api.store import MemoryStore, Recording, SqliteStore
from atroposlib.api.waiting import BatchWaiters
from atroposlib.utils.http_guard import BodyBudget

__all__ = ["ApiState", "Queue", "State", "get_queue", "get_state"]


@dataclass
class ApiState:
    """One trajectory API's state: its settings, queue, body parser and ingest byte budget."""

    settings: ApiSettings
    queue: TrajectoryQueue
    parser: GroupParser
    #: bytes of request bodies held at once, over all requests (``--ingest-budget-bytes``)
    budget: BodyBudget
    #: evaluations pinned to a policy version (in memory; a restart forgets them)
    evals: EvalBoard
    #: ``GET /batch?wait=`` requests waiting for a batch (woken by the queue's changes)
    waiters: BatchWaiters

    @classmethod
    def open(cls, settings: ApiSettings) -> ApiState:
        """Open the store (``--store``; in memory without one) and restore the queue from it,
        or the recording of ``--replay``. Raises what opening them raises (a file that cannot
        be opened, :class:`~atroposlib.api.store.StoreInUse`, a store that recorded nothing)."""
        store = (
            SqliteStore(settings.store, synchronous=settings.store_sync, record=settings.record)
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
        if settings.replay:
            queue.replay(Recording(settings.replay), repack=settings.replay_mode == "repack")
        waiters = BatchWaiters()
        queue.on_change = waiters.notify
        return cls(
            settings=settings,
            queue=queue,
            parser=GroupParser(settings.ingest_threads),
            budget=BodyBudget(max(settings.ingest_budget_bytes, settings.max_request_bytes)),
            evals=EvalBoard(),
            waiters=waiters,
        )

    def close(self) -> None:
        """Stop the parser process and close the store (and a replayed recording)."""
        self.waiters.close()
        self.parser.close()
        self.queue.close()


# async on purpose: FastAPI runs a plain ``def`` dependency in a worker thread, a thread hop
# per request for a dictionary lookup


async def get_state(request: Request) -> ApiState:
    """The application's :class:`ApiState` (set by :func:`~atroposlib.api.server.create_app`)."""
    return request.app.state.api


async def get_queue(request: Request) -> TrajectoryQueue:
    """The application's queue."""
    return request.app.state.api.queue


#: A route parameter that receives the :class:`ApiState`.
State = Annotated[ApiState, Depends(get_state)]
#: A route parameter that receives the :class:`~atroposlib.api.queue.TrajectoryQueue`.
Queue = Annotated[TrajectoryQueue, Depends(get_queue)]
