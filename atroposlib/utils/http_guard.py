"""What every HTTP service of atroposlib checks before a route sees a request: the shared API key
and the size of the body. One implementation, used by ``run-api`` (:mod:`atroposlib.api`) and
``atropos-serve`` (:mod:`atroposlib.inference.server`); each service writes the refusal in its
own error shape (run-api: ``{"detail": ...}``; atropos-serve: OpenAI's ``{"error": ...}``).

**API key** (:class:`ApiKeyCheck`). A request carries the key as ``Authorization: Bearer KEY``
(the scheme in any case) or ``X-API-Key: KEY``. Every key offered is compared, each in constant
time (SHA-256 digests of equal length, :func:`hmac.compare_digest`), so neither the timing nor
an early exit tells how much of a guess was right. Open without a key: ``GET``/``HEAD`` of the
service's liveness paths, and CORS preflights (``OPTIONS`` with ``Origin`` and
``Access-Control-Request-Method``: browsers never put credentials on those).

**Body cap** (:func:`read_body`). A body is read chunk by chunk and refused
(:class:`BodyTooLarge`) as soon as the bytes on the wire, or after gzip inflation the bytes it
inflates to, pass the cap, whatever ``Content-Length`` says; a ``Content-Length`` past the cap is
refused before anything is read (:func:`declared_too_large`). gzip is inflated as it arrives,
in slices, so a gzip bomb costs at most the cap and the event loop keeps turning. Bytes held
can be charged to a :class:`BodyBudget` shared by all requests in flight (run-api's
``--ingest-budget-bytes``): past it, :class:`IngestBusy` at once.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from dataclasses import dataclass

import anyio
from starlette.types import Receive, Scope

try:  # Intel ISA-L: 2x faster gunzip than zlib, same format
    from isal import isal_zlib as _zlib
except ImportError:  # pragma: no cover - platforms without isal wheels
    import zlib as _zlib  # type: ignore[no-redef]

__all__ = [
    "ApiKeyCheck",
    "Body",
    "BodyBudget",
    "BodyTooLarge",
    "ClientGone",
    "IngestBusy",
    "InvalidGzip",
    "body_chunks",
    "declared_too_large",
    "read_body",
]

#: Most decompressed bytes produced per step before the event loop gets a turn.
_INFLATE_STEP = 1 << 20


# ----------------------------------------------------------------------------- API key


def _digest(value: bytes) -> bytes:
    # compare fixed-length digests so the comparison time does not depend on the key's length
    return hashlib.sha256(value).digest()


class ApiKeyCheck:
    """The shared-key rule of every atroposlib service (see the module doc).

    Args:
        key: The key requests must carry.
        open_paths: Paths whose ``GET`` and ``HEAD`` need no key (liveness probes).
    """

    def __init__(self, key: str, open_paths: Iterable[str] = ("/health",)) -> None:
        self._key_digest = _digest(key.encode("utf-8"))
        self.open_paths = frozenset(open_paths)

    def is_open(self, scope: Scope) -> bool:
        """Whether this request needs no key: a liveness probe, a CORS preflight, or not
        HTTP/WebSocket at all (lifespan)."""
        if scope["type"] not in ("http", "websocket"):
            return True
        if scope["type"] == "websocket":
            return False
        method = scope["method"]
        if method in ("GET", "HEAD") and scope["path"] in self.open_paths:
            return True
        if method == "OPTIONS":
            names = {name for name, _ in scope["headers"]}
            return b"origin" in names and b"access-control-request-method" in names
        return False

    @staticmethod
    def offered(scope: Scope) -> list[bytes]:
        """The keys a request offers (``Authorization: Bearer``, ``X-API-Key``)."""
        keys: list[bytes] = []
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                if scheme.lower() == b"bearer":
                    keys.append(token.strip())
            elif name == b"x-api-key":
                keys.append(value.strip())
        return keys

    def refusal(self, scope: Scope) -> str | None:
        """None when the request may pass; else why not: ``"missing"`` (no key offered) or
        ``"invalid"`` (none of the keys offered matches)."""
        if self.is_open(scope):
            return None
        offered = self.offered(scope)
        matched = False
        for token in offered:  # every offered key is compared: no early exit
            matched |= hmac.compare_digest(_digest(token), self._key_digest)
        if matched:
            return None
        return "invalid" if offered else "missing"


# ---------------------------------------------------------------------------- body cap


class BodyTooLarge(Exception):
    """The body (after decompression) passed the cap."""


class InvalidGzip(Exception):
    """A body sent with ``Content-Encoding: gzip`` that is not gzip."""


class IngestBusy(Exception):
    """The bodies already being read and parsed hold the whole budget."""


class ClientGone(Exception):
    """The client disconnected before its body arrived."""


class BodyBudget:
    """Bytes of request bodies held right now (being read, or waiting to be parsed), bounded.

    Used from the event loop only, so it needs no lock. A request that would pass the budget
    is refused at once rather than made to wait: requests that wait while holding part of the
    budget could wait on each other forever.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0

    def reserve(self, n: int) -> None:
        """Take ``n`` bytes of the budget, or raise :class:`IngestBusy`."""
        if self.in_use + n > self.limit:
            raise IngestBusy
        self.in_use += n

    def release(self, n: int) -> None:
        """Give back ``n`` bytes."""
        self.in_use -= n


@dataclass
class Body:
    """A request body read by :func:`read_body`; :meth:`release` returns its budget share."""

    data: bytes
    budget: BodyBudget | None = None
    reserved: int = 0

    def release(self) -> None:
        """Give the body's bytes back to the budget (idempotent)."""
        if self.budget is not None and self.reserved:
            self.budget.release(self.reserved)
            self.reserved = 0


def declared_too_large(scope: Scope, cap: int) -> bool:
    """Whether the request's ``Content-Length`` is past ``cap`` (or not a number)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return not value.isdigit() or int(value) > cap
    return False


async def body_chunks(receive: Receive) -> AsyncIterator[bytes]:
    """The request body's chunks as they arrive; :class:`ClientGone` if the client hangs up."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return


class _Inflater:
    """Streaming gunzip of one or more concatenated members, refusing to grow past a cap.

    :meth:`step` produces at most ``_INFLATE_STEP`` bytes per call, so a 1000:1 chunk is
    inflated in slices with the event loop getting a turn between them.
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.size = 0
        self.pending = b""
        self._d = _zlib.decompressobj(16 + 15)
        self._fresh = True  # the current member has not started yet

    def step(self) -> bytes:
        """Decompress the next slice of :attr:`pending`."""
        piece = self._d.decompress(self.pending, min(self.cap - self.size, _INFLATE_STEP) + 1)
        self._fresh = False
        self.size += len(piece)
        if self.size > self.cap:
            raise BodyTooLarge
        if self._d.eof:  # concatenated gzip members
            self.pending = self._d.unused_data
            self._d = _zlib.decompressobj(16 + 15)
            self._fresh = True
        else:
            self.pending = self._d.unconsumed_tail
        return piece

    def finish(self) -> None:
        """Raise :class:`EOFError` if the stream stopped in the middle of a member."""
        if not self._fresh and not self._d.eof:
            raise EOFError("truncated gzip stream")


async def read_body(
    stream: AsyncIterable[bytes],
    cap: int,
    gzipped: bool = False,
    budget: BodyBudget | None = None,
) -> Body:
    """Read the whole body from ``stream`` (its chunks as they arrive, e.g. :func:`body_chunks`),
    inflating gzip on the fly when ``gzipped``.

    Raises :class:`BodyTooLarge` as soon as the wire size or the decompressed size passes
    ``cap``, :class:`InvalidGzip`, and :class:`IngestBusy` when ``budget`` has no room left for
    the bytes held; what ``stream`` raises (:class:`ClientGone`) passes through. Nothing stays
    charged to ``budget`` when it raises.
    """
    body = Body(b"", budget)
    chunks: list[bytes] = []
    inflater = _Inflater(cap) if gzipped else None
    wire = 0
    try:
        async for chunk in stream:
            wire += len(chunk)
            if wire > cap:
                raise BodyTooLarge
            if inflater is None:
                _keep(chunk, chunks, body)
                continue
            inflater.pending = chunk
            while inflater.pending:
                try:
                    _keep(inflater.step(), chunks, body)
                except (OSError, _zlib.error) as exc:
                    raise InvalidGzip from exc
                if inflater.pending:
                    await anyio.sleep(0)  # a 1000:1 chunk: let the event loop breathe
        if inflater is not None:
            try:
                inflater.finish()
            except EOFError as exc:
                raise InvalidGzip from exc
    except BaseException:
        body.release()
        raise
    body.data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    return body


def _keep(piece: bytes, chunks: list[bytes], body: Body) -> None:
    if body.budget is not None:
        body.budget.reserve(len(piece))
        body.reserved += len(piece)
    chunks.append(piece)
