"""HTTP response helpers shared by environments and servers."""

from __future__ import annotations

import inspect
import logging
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["parse_http_response"]


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def parse_http_response(resp: Any, logger: logging.Logger | None = None) -> Any:
    """The JSON body of an HTTP response, after checking its status.

    Works with ``aiohttp`` responses (async ``json()``/``text()``) and ``httpx``/``requests``
    ones (sync ``json()``, ``text`` attribute).

    Args:
        resp: The response; must have ``raise_for_status()`` and ``json()``.
        logger: Where to log a failure; defaults to this module's logger.

    Returns:
        The parsed JSON body.

    Raises:
        Exception: Whatever ``raise_for_status()`` or JSON parsing raised (logged first with the
            status and body, then re-raised so retry decorators see it).
    """
    log = logger if logger is not None else logging.getLogger(__name__)
    try:
        resp.raise_for_status()
        return await _maybe_await(resp.json())
    except Exception as exc:
        try:
            text = getattr(resp, "text", "")
            body = await _maybe_await(text() if callable(text) else text)
        except Exception as read_exc:  # noqa: BLE001 - the original error matters more
            body = f"<unreadable body: {read_exc}>"
        status = getattr(exc, "status", None) or getattr(resp, "status", None)
        status = status or getattr(resp, "status_code", "unknown")
        log.error(
            "Error fetching from server. Status: %s, Message: %s. Response: %s",
            status,
            getattr(exc, "message", str(exc)),
            body,
        )
        raise
