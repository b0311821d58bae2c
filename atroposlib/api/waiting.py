"""Long-polled ``GET /batch?wait=SECONDS``: trainers that wait for a batch are woken when the
queue changes, not by a timer.

:class:`BatchWaiters` lives in the application's event loop. The queue calls
:meth:`BatchWaiters.notify` (from any thread: the ingest fast lane and the routes call the queue
on the loop, a durable store's calls run in worker threads) after every change that can let a
batch form (groups queued, an env gone, a registration, a reset); each waiting request then
tries :meth:`~atroposlib.api.queue.TrajectoryQueue.take_batch` again. Nothing polls: between
changes a waiting request costs one suspended coroutine.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

__all__ = ["MAX_WAIT_S", "BatchWaiters"]

#: Longest ``GET /batch?wait=`` accepted, in seconds (a longer one is a 422). Short enough that a
#: proxy or a client's read timeout does not cut the request, long enough to make polling rare.
MAX_WAIT_S = 30.0


class BatchWaiters:
    """The ``/batch`` requests waiting for a batch, and the signal that wakes them.

    ``version`` counts the changes seen; a waiter reads it before it tries the queue and
    sleeps only while it is unchanged, so a change between its try and its sleep is not
    missed. ``version`` and the event are only touched on the loop's thread."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None
        self._event: asyncio.Event | None = None
        #: requests waiting now (read by :meth:`notify` from any thread)
        self.waiting = 0
        self.version = 0
        #: the server is shutting down: waiters answer at once
        self.closing = False

    def enter(self) -> int:
        """A request starts waiting (on the loop); returns the version to wait past."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.get_ident()
            self._event = asyncio.Event()
        self.waiting += 1
        return self.version

    def leave(self) -> None:
        """A request stops waiting."""
        self.waiting -= 1

    def notify(self) -> None:
        """The queue changed (any thread): wake the waiting requests."""
        loop = self._loop
        if loop is None or not self.waiting:
            return
        if threading.get_ident() == self._thread:
            self._wake()
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        assert self._event is not None
        self.version += 1
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, seen: int, timeout: float) -> None:
        """Sleep until the version moves past ``seen``, the server closes, or ``timeout`` s."""
        if self.version != seen or self.closing or timeout <= 0:
            return
        assert self._event is not None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)

    def close(self) -> None:
        """The server is shutting down (any thread): every waiter answers now, and later
        requests do not wait."""
        self.closing = True
        loop = self._loop
        if loop is None:
            return
        if threading.get_ident() == self._thread:
            self._wake()
        else:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._wake)
