"""What the trajectory API refuses, as exceptions that carry a reason (no HTTP here): the queue,
the registry and the ingest pipeline raise them; :mod:`atroposlib.api.responses` turns a reason
into a status code in one table (:data:`~atroposlib.api.responses.REFUSAL_STATUS`)."""

from __future__ import annotations

from typing import Any

__all__ = ["QueueFull", "Refused", "UnknownEnv"]


class Refused(Exception):
    """Input the queue (or the ingest pipeline) will not take, and why.

    ``reason`` is the metric label (``refused_groups_total{reason=...}``) and what the HTTP
    layer maps to a status code; ``loc`` is the path of the offending value inside the request's
    input (``(1, "env_id")``: the second group's ``env_id``), ``kind`` the error type reported
    beside it (default: the reason). ``errors`` holds several ``{"loc", "msg", "type"}`` entries
    (``loc`` relative, like ``loc``) when validation found more than one thing; ``retry_after``
    is set when retrying after that many seconds can succeed.
    """

    def __init__(
        self,
        reason: str,
        message: str,
        loc: tuple[Any, ...] = (),
        kind: str | None = None,
        errors: list[dict[str, Any]] | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.loc = loc
        self.kind = kind or reason
        self.errors = errors or [{"loc": list(loc), "msg": message, "type": self.kind}]
        self.retry_after = retry_after

    def __reduce__(self) -> tuple[Any, ...]:  # crosses the parser's process boundary intact
        args = (self.reason, self.message, self.loc, self.kind, self.errors, self.retry_after)
        return (Refused, args)


class QueueFull(Refused):
    """The queue is at its bound; the client should retry after ``retry_after`` seconds."""

    retry_after: int

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__("queue_full", message, retry_after=retry_after)


class UnknownEnv(LookupError):
    """An ``env_id`` that no ``/register-env`` handed out."""
