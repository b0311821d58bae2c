"""Bounded concurrency for many awaitables (evaluations), with an optional progress bar."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Sequence
from typing import TypeVar

__all__ = ["gather_bounded"]

T = TypeVar("T")


async def gather_bounded(
    coros: Sequence[Awaitable[T]], limit: int, *, desc: str | None = None
) -> list[T]:
    """``asyncio.gather`` with at most ``limit`` awaitables running at once; results in order.

    With ``desc`` a tqdm bar (``desc: done/total [elapsed<remaining]``) goes to stderr while
    they run; it refreshes every second on a terminal and every 10 s into a log file, so a
    long evaluation shows how far it is and when it will end.
    """
    semaphore = asyncio.Semaphore(max(1, limit))
    bar = None
    if desc is not None:
        from tqdm import tqdm

        interactive = sys.stderr.isatty()
        bar = tqdm(
            total=len(coros),
            desc=desc,
            unit="item",
            mininterval=1.0 if interactive else 10.0,
            dynamic_ncols=interactive,
            ncols=None if interactive else 80,
        )

    async def run(coro: Awaitable[T]) -> T:
        async with semaphore:
            result = await coro
        if bar is not None:
            bar.update(1)
        return result

    try:
        return await asyncio.gather(*(run(c) for c in coros))
    finally:
        if bar is not None:
            bar.close()
