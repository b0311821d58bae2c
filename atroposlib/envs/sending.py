"""The env's HTTP client for the trajectory API, and JSON encoding of scored groups.

``RolloutApiClient`` keeps one connection pool for the env's lifetime and separates failures
the env should wait out (API down or restarting, 5xx, 429 queue full) from ones it cannot fix
(other 4xx). ``send`` keeps retrying the first kind with a bounded, jittered backoff until
``give_up_after_s`` has passed, so a ``run-api`` restart mid-run loses nothing. It sends the
key of ``run-api --api-key`` from the ``ATROPOS_API_KEY`` environment variable (a 401 is
:class:`ApiKeyRejected`).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import random
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import orjson

from atroposlib.utils.api_key import API_KEY_ENV, api_key_headers, resolve_api_key

try:  # isal's gzip is several times faster than zlib's at the same ratio
    from isal import igzip as _gzip
except ImportError:  # pragma: no cover - isal is a core dependency
    import gzip as _gzip

logger = logging.getLogger(__name__)

__all__ = [
    "GZIP_MINIMUM_BYTES",
    "ApiKeyRejected",
    "ApiRefused",
    "JsonlWriter",
    "RolloutApiClient",
    "UnknownEnvError",
    "backoff_delay",
    "dumps",
    "encode_json_body",
]

#: JSON bodies at least this large are gzip-compressed (when that makes them smaller).
GZIP_MINIMUM_BYTES = 1024
_ORJSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


def _default(obj: Any) -> Any:
    if isinstance(obj, enum.Enum):
        return obj.value
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def dumps(payload: Any) -> bytes:
    """``payload`` as compact UTF-8 JSON (numpy values, enums and pydantic models allowed)."""
    try:
        return orjson.dumps(payload, default=_default, option=_ORJSON_OPTIONS)
    except TypeError:
        # orjson refuses ints beyond 64 bits and a few other exotic values; json does not
        return json.dumps(payload, default=_default).encode("utf-8")


def encode_json_body(
    payload: Any, minimum_size: int = GZIP_MINIMUM_BYTES
) -> tuple[bytes, dict[str, str]]:
    """The request body and headers for ``payload``: gzip when the JSON is at least
    ``minimum_size`` bytes and compression makes it smaller."""
    body = dumps(payload)
    headers = {"Content-Type": "application/json"}
    if len(body) >= minimum_size:
        compressed = _gzip.compress(body, 1)
        if len(compressed) < len(body):
            headers["Content-Encoding"] = "gzip"
            body = compressed
    return body, headers


def backoff_delay(attempt: int, initial: float = 0.5, maximum: float = 30.0) -> float:
    """Full-jitter exponential backoff: a random delay in ``[d/2, d]`` with
    ``d = min(maximum, initial * 2**(attempt-1))``."""
    delay = min(maximum, initial * (2 ** max(0, attempt - 1)))
    return random.uniform(delay / 2, delay)


class UnknownEnvError(Exception):
    """The API does not know this env's id (it was reset or restarted without a store)."""


class ApiRefused(Exception):
    """The API refused a request for good (a 4xx other than 408/429 or an unknown env)."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


class ApiKeyRejected(ApiRefused):
    """The API answered 401: this env sent no key or the wrong one (``run-api --api-key``)."""

    def __str__(self) -> str:
        return (
            f"HTTP {self.status}: run-api refused this env's API key ({self.body[:300]}); set "
            f"{API_KEY_ENV} in the env's environment to run-api's --api-key"
        )


def _refusal(resp: httpx.Response) -> ApiRefused:
    """The exception for a 4xx reply the env cannot fix by waiting."""
    cls = ApiKeyRejected if resp.status_code == 401 else ApiRefused
    return cls(resp.status_code, resp.text)


def _is_unknown_env(resp: httpx.Response) -> bool:
    if resp.status_code not in (404, 422):
        return False
    try:
        data = resp.json()
    except ValueError:
        return False
    detail = data.get("detail") if isinstance(data, dict) else None
    if isinstance(detail, list):
        return any(isinstance(d, dict) and d.get("type") == "unknown_env" for d in detail)
    return resp.status_code == 404


def _retry_after(resp: httpx.Response) -> float | None:
    value = resp.headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


class RolloutApiClient:
    """Async client for the trajectory API (``run-api``) used by one environment.

    Args:
        base_url: The API's base URL (``http://host:port``).
        request_timeout: Seconds for one request (connecting is capped at 5 s).
        max_backoff_s: Longest wait between two attempts (``Retry-After`` is honoured up to
            twice this).
        api_key: The key of ``run-api --api-key``, sent with every request. None (default):
            the ``ATROPOS_API_KEY`` environment variable; ``""``: no key.
    """

    def __init__(
        self,
        base_url: str,
        request_timeout: float = 60.0,
        max_backoff_s: float = 30.0,
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.request_timeout = request_timeout
        self.max_backoff_s = max_backoff_s
        self._headers = api_key_headers(resolve_api_key(api_key))
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        """The shared ``httpx.AsyncClient`` (created on first use, in the running loop)."""
        if self._client is None or self._client.is_closed:
            self._client = httpx.AsyncClient(
                base_url=self.base_url,
                headers=self._headers,
                timeout=httpx.Timeout(self.request_timeout, connect=5.0),
                limits=httpx.Limits(max_connections=64, max_keepalive_connections=32),
            )
        return self._client

    async def aclose(self) -> None:
        """Close the connection pool."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def request_json(
        self, method: str, path: str, payload: Any = None, timeout: float | None = None
    ) -> Any:
        """One request; the JSON reply.

        Raises:
            UnknownEnvError: The API does not know the env id in ``payload``.
            ApiKeyRejected: The API refused the key (401).
            httpx.HTTPStatusError: Any other non-2xx reply.
            httpx.TransportError: The API could not be reached.
        """
        kwargs: dict[str, Any] = {}
        if payload is not None:
            kwargs["content"], kwargs["headers"] = encode_json_body(payload)
        if timeout is not None:
            kwargs["timeout"] = timeout
        resp = await self.client.request(method, path, **kwargs)
        if _is_unknown_env(resp):
            raise UnknownEnvError(resp.text[:300])
        if resp.status_code == 401:
            raise _refusal(resp)
        resp.raise_for_status()
        return resp.json()

    async def request_json_patiently(
        self, method: str, path: str, payload: Any = None, what: str = ""
    ) -> Any:
        """Like ``request_json`` but waits out connection errors and 5xx/429 replies forever
        (with backoff), logging once per outage. Other errors propagate."""
        attempt = 0
        while True:
            attempt += 1
            try:
                return await self.request_json(method, path, payload)
            except httpx.TransportError as exc:
                reason = f"{type(exc).__name__}: {exc}"
            except httpx.HTTPStatusError as exc:
                status = exc.response.status_code
                if status < 500 and status not in (408, 429):
                    raise
                reason = f"HTTP {status}"
            delay = backoff_delay(attempt, maximum=self.max_backoff_s)
            log = logger.warning if attempt == 1 or attempt % 10 == 0 else logger.debug
            log(
                "%s %s failed (%s); retrying in %.1fs (attempt %d)",
                what or method,
                path,
                reason,
                delay,
                attempt,
            )
            await asyncio.sleep(delay)

    async def send(self, path: str, payload: Any, give_up_after_s: float) -> None:
        """POST scored data, retrying until it is accepted or ``give_up_after_s`` passed.

        Connection errors, 5xx, 408 and 429 are retried (429's ``Retry-After`` is honoured);
        the body is encoded (and gzipped) once.

        Raises:
            UnknownEnvError: The API does not know the env id (re-register and send again).
            ApiRefused: A 4xx reply: the data itself was refused (``ApiKeyRejected`` for a
                401: the key was).
            TimeoutError: Still failing after ``give_up_after_s`` seconds.
        """
        body, headers = encode_json_body(payload)
        start = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            try:
                resp = await self.client.post(path, content=body, headers=headers)
            except httpx.TransportError as exc:
                reason = f"{type(exc).__name__}: {exc}"
                delay = backoff_delay(attempt, maximum=self.max_backoff_s)
            else:
                status = resp.status_code
                if status < 300:
                    if attempt > 1:
                        logger.info("%s accepted after %d attempts", path, attempt)
                    return
                if _is_unknown_env(resp):
                    raise UnknownEnvError(resp.text[:300])
                if status == 429:
                    reason = "HTTP 429 (queue full)"
                    hint = _retry_after(resp)
                    delay = (
                        min(hint, 2 * self.max_backoff_s) * random.uniform(1.0, 1.2)
                        if hint is not None
                        else backoff_delay(attempt, maximum=self.max_backoff_s)
                    )
                elif status >= 500 or status == 408:
                    reason = f"HTTP {status}"
                    delay = backoff_delay(attempt, maximum=self.max_backoff_s)
                else:
                    raise _refusal(resp)
            elapsed = time.monotonic() - start
            if elapsed + delay > give_up_after_s:
                raise TimeoutError(
                    f"{path} still failing after {elapsed:.0f}s and {attempt} attempts: {reason}"
                )
            log = logger.warning if attempt == 1 or attempt % 10 == 0 else logger.debug
            log("POST %s failed (%s); retrying in %.1fs", path, reason, delay)
            await asyncio.sleep(delay)


class JsonlWriter:
    """Appends one JSON object per line and flushes each, so a crash loses at most one line.

    Kept API-compatible with the ``jsonlines.Writer`` upstream exposed as ``env.jsonl_writer``.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed in close()

    @classmethod
    def at_free_path(cls, path: str | Path) -> JsonlWriter:
        """A writer at ``path``, or at the first of ``stem_1``, ``stem_2``... that does not
        exist (an existing file is never overwritten; the change is logged). Creates the
        folder."""
        wanted = candidate = Path(path)
        counter = 1
        while candidate.exists():
            candidate = wanted.with_stem(f"{wanted.stem}_{counter}")
            counter += 1
        if candidate != wanted:
            logger.info("Changed data path to %s because %s already exists.", candidate, path)
        candidate.parent.mkdir(parents=True, exist_ok=True)
        return cls(candidate)

    def write(self, obj: Mapping[str, Any] | Any) -> None:
        """Write ``obj`` as one line."""
        self._file.write(dumps(obj) + b"\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if not self._file.closed:
            self._file.close()

    @property
    def closed(self) -> bool:
        """Whether the file is closed."""
        return self._file.closed
