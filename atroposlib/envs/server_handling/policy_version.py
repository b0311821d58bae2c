"""Which policy version (trainer step) made a rollout's samples.

Inference servers that know it answer ``GET /policy_version`` with ``{"policy_version": N}``
(``atropos-serve``; the trainer's vLLM launcher). Each ``APIServer`` keeps a
:class:`PolicyVersionTracker` that learns its server's version without costing a round trip per
request: a request waits for one ``GET /policy_version`` only when the cached value is older
than :attr:`PolicyVersionTracker.ttl` seconds (or there is none yet); the requests that start
meanwhile share that one ``GET``, and every other request uses the cached value. A server without the route (any 4xx, e.g. 404 from a plain
OpenAI endpoint) or with an answer of another shape is asked once and then never again: its
version is None. A failed request (down, 5xx) keeps the last value and is tried again after
the TTL.

A rollout (``ServeLoop.handle_env``) opens a collector with :func:`start_rollout`; every request
an ``APIServer`` makes inside it records the version its server had when the request started
(:func:`record`). :func:`rollout_policy_version` is then the lowest of them, the version the
runtime stamps on the rollout's groups. Servers report a new version only once its weights
serve requests, and the value recorded was read before the request was sent, so a stamp is
never newer than the weights that made the samples (it can be older by up to the TTL after a
sync: such groups look staler than they are, never fresher).

Servers that say per response which weights generated it (``atropos-serve``'s
``X-Policy-Version`` header, :data:`~atroposlib.schema.POLICY_VERSION_HEADER`) are exact: the
HTTP clients pass each response's headers to :func:`note_response`, and the version recorded
for the request is that of its final (not aborted) attempt. Without it, a generation aborted
by the trainer's pause and re-sent while the server was paused ran on the new weights but kept
the version read before its first attempt: one or two steps staler than true, enough for
``run-api --max-staleness`` to drop it. Before, a request past the TTL
used the cached value and refreshed in the background; an env idle for a while (waiting for
the trainer) then stamped its first groups after a sync with a version several steps old,
and ``run-api --max-staleness`` dropped them.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Mapping
from typing import Any

import httpx

from atroposlib.schema import POLICY_VERSION_HEADER

logger = logging.getLogger(__name__)

__all__ = [
    "PolicyVersionTracker",
    "collecting",
    "end_rollout",
    "note_response",
    "record",
    "rollout_policy_version",
    "start_rollout",
    "watch_responses",
]

#: The versions recorded by the requests of the current rollout (None outside a rollout).
_ROLLOUT: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "atropos_rollout_policy_versions", default=None
)


#: The versions named by the responses of the request being made (None: nobody watches).
_RESPONSES: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "atropos_response_policy_versions", default=None
)


def watch_responses() -> list[int]:
    """Collect, in this context, the policy versions that responses name from now on
    (:func:`note_response`); returns the list they are appended to."""
    seen: list[int] = []
    _RESPONSES.set(seen)
    return seen


def note_response(headers: Mapping[str, str]) -> None:
    """Record the policy version a response's headers name (``X-Policy-Version``), if any,
    for the request being made in this context (see :func:`watch_responses`). HTTP clients
    of inference servers call it with every response's headers."""
    seen = _RESPONSES.get()
    if seen is None:
        return
    value = headers.get(POLICY_VERSION_HEADER)
    if value is None:
        return
    try:
        version = int(value)
    except (TypeError, ValueError):
        return
    if version >= 0:
        seen.append(version)


def start_rollout() -> contextvars.Token:
    """Open a collector for the current task (and the tasks it starts); returns the token
    :func:`end_rollout` takes."""
    return _ROLLOUT.set([])


def end_rollout(token: contextvars.Token) -> None:
    """Close the collector opened by :func:`start_rollout`."""
    _ROLLOUT.reset(token)


def collecting() -> bool:
    """Whether a rollout collector is open in this context."""
    return _ROLLOUT.get() is not None


def record(version: int | None) -> None:
    """Note that a request of the current rollout ran on weights of ``version`` (ignored
    outside a rollout and for None)."""
    versions = _ROLLOUT.get()
    if versions is not None and version is not None:
        versions.append(version)


def rollout_policy_version() -> int | None:
    """The lowest version recorded in the current rollout, or None when none was."""
    versions = _ROLLOUT.get()
    return min(versions) if versions else None


class PolicyVersionTracker:
    """The last known policy version of one server, refreshed at most every :attr:`ttl`
    seconds in the background (see the module docstring).

    Args:
        root: The server's root URL (``http://host:port``, no ``/v1``); None: no version.
        api_key: Sent as ``Authorization: Bearer`` when set.
    """

    #: Seconds a known version is used before a background refresh is started.
    ttl: float = 1.0
    #: Timeout of one ``GET /policy_version``.
    timeout: float = 2.0

    def __init__(self, root: str | None, api_key: str | None = None) -> None:
        self.url = f"{root.rstrip('/')}/policy_version" if root else None
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.value: int | None = None
        #: None until the first answer; False once the server showed it has no such route.
        self.supported: bool | None = None if self.url else False
        self.fetches = 0
        self._checked_at: float | None = None
        self._task: asyncio.Task | None = None
        self._client: httpx.AsyncClient | None = None

    async def current(self) -> int | None:
        """The version to record for a request starting now (waits only for the very first
        fetch)."""
        if self.supported is False:
            return None
        if self._checked_at is None or time.monotonic() - self._checked_at > self.ttl:
            # Past the TTL the request waits for the fresh answer (one GET, shared by every
            # request starting meanwhile): a cached value may be from long ago when the env
            # was idle, e.g. waiting for the trainer while it synced new weights.
            if self._task is None or self._task.done():
                self._task = asyncio.create_task(self._fetch())
            await asyncio.shield(self._task)
        return self.value

    async def _fetch(self) -> None:
        assert self.url is not None
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout, headers=self.headers)
        self.fetches += 1
        try:
            response = await self._client.get(self.url)
        except (httpx.TransportError, OSError) as exc:  # down or unreachable: try again later
            logger.debug("GET %s failed: %r", self.url, exc)
            return
        except Exception as exc:  # noqa: BLE001 - never let the version break a rollout
            logger.info("GET %s failed (%r); not asking again", self.url, exc)
            self.supported = False
            self.value = None
            return
        finally:
            self._checked_at = time.monotonic()
        if response.status_code >= 500:
            return
        value: Any = None
        if response.status_code < 400:
            try:
                value = response.json().get("policy_version")
            except (ValueError, AttributeError):
                value = None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            if self.supported:  # it answered before: a passing problem, keep the last value
                logger.debug("%s answered HTTP %d", self.url, response.status_code)
                return
            logger.info(
                "%s does not report a policy version (HTTP %d); groups made with it are "
                "not stamped with one",
                self.url,
                response.status_code,
            )
            self.supported = False
            self.value = None
            return
        if self.value is not None and value != self.value:
            logger.debug("%s: policy version %d -> %d", self.url, self.value, value)
        self.supported = True
        self.value = value

    async def aclose(self) -> None:
        """Stop a refresh in progress and close the HTTP client."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
        if self._client is not None:
            try:
                await self._client.aclose()
            except RuntimeError:  # its event loop is gone: nothing left to close
                pass
            self._client = None
