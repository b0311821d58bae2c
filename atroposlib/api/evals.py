"""Evaluations pinned to a policy version: the board run-api keeps between trainer and envs.

A trainer asks for an evaluation of the weights of version ``v`` (the step it just synced):
:meth:`EvalBoard.request` records which envs are expected to report (the connected envs that
said, at ``/register-env``, that they take such requests). Each env sees the oldest request it
has not answered in its ``/status-env`` reply, makes sure its inference servers serve version
``v`` (waiting while they are behind, refusing when they are ahead), runs its ``evaluate`` and
reports with :meth:`EvalBoard.report`. A result is never attached to a version it was not
measured on: a report whose ``policy_version`` differs from the request's is refused. The
trainer reads :meth:`EvalBoard.results` (``complete`` once every expected env reported, or
disconnected); with a barrier it waits for that before training on.

Plain object, no HTTP; the routes are in :mod:`atroposlib.api.routers.evals`. Kept in memory: a
restarted run-api forgets pending requests (the trainer asks again; documented).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["EvalBoard", "EvalBoardError", "EvalReport", "EvalRequest"]

Status = Literal["done", "refused", "failed"]


class EvalBoardError(ValueError):
    """A request or report the board refuses; ``field`` names the offending field."""

    def __init__(self, field: str, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.field = field
        self.status_code = status_code


@dataclass
class EvalReport:
    """One env's answer to one request."""

    env_id: int
    env_name: str
    status: Status
    policy_version: int
    metrics: dict[str, float] = field(default_factory=dict)
    reason: str = ""
    seconds: float = 0.0
    reported_at: float = field(default_factory=time.time)

    def wire(self) -> dict[str, Any]:
        return {
            "env_id": self.env_id,
            "env_name": self.env_name,
            "status": self.status,
            "policy_version": self.policy_version,
            "metrics": self.metrics,
            "reason": self.reason,
            "seconds": self.seconds,
        }


@dataclass
class EvalRequest:
    """One trainer request: evaluate the weights of ``policy_version``."""

    request_id: int
    policy_version: int
    step: int | None
    expected: dict[int, str]
    """env id -> env name, of the envs that must answer."""
    created_at: float = field(default_factory=time.time)
    reports: dict[int, EvalReport] = field(default_factory=dict)
    gone: dict[int, str] = field(default_factory=dict)
    """Expected envs that disconnected before answering: env id -> name."""

    @property
    def complete(self) -> bool:
        """Every expected env reported or left."""
        return all(e in self.reports or e in self.gone for e in self.expected)

    def wire(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "policy_version": self.policy_version,
            "step": self.step,
            "expected": sorted(self.expected),
            "reports": [self.reports[e].wire() for e in sorted(self.reports)],
            "disconnected": sorted(self.gone),
            "complete": self.complete,
        }


class EvalBoard:
    """Pending and answered evaluation requests (see the module docstring). Thread-safe."""

    def __init__(self, keep: int = 64) -> None:
        self._lock = threading.Lock()
        self._requests: dict[int, EvalRequest] = {}
        self._next_id = 1
        self._keep = keep

    def reset(self) -> None:
        """Forget every request (``/reset_data``)."""
        with self._lock:
            self._requests.clear()

    def request(self, policy_version: int, step: int | None, envs: dict[int, str]) -> EvalRequest:
        """Record a request for ``envs`` (env id -> name). A request no env takes is answered at
        once (``complete``, no reports): the trainer is told rather than left waiting."""
        if policy_version < 0:
            raise EvalBoardError("policy_version", "policy_version must be >= 0")
        with self._lock:
            req = EvalRequest(self._next_id, policy_version, step, dict(envs))
            self._requests[req.request_id] = req
            self._next_id += 1
            for old in sorted(self._requests)[: max(0, len(self._requests) - self._keep)]:
                if self._requests[old].complete:
                    del self._requests[old]
            return req

    def pending_for(self, env_id: int) -> EvalRequest | None:
        """The oldest request ``env_id`` must still answer."""
        with self._lock:
            for rid in sorted(self._requests):
                req = self._requests[rid]
                if env_id in req.expected and env_id not in req.reports and env_id not in req.gone:
                    return req
        return None

    def report(self, request_id: int, report: EvalReport) -> EvalRequest:
        """Record ``report``; refuses an unknown request, an env not asked, a second answer, a
        version other than the request's, and non-finite metrics."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                raise EvalBoardError("request_id", f"no evaluation request {request_id}", 404)
            if report.env_id not in req.expected:
                raise EvalBoardError(
                    "env_id", f"env {report.env_id} was not asked by request {request_id}", 409
                )
            if report.env_id in req.reports:
                raise EvalBoardError(
                    "env_id", f"env {report.env_id} already answered request {request_id}", 409
                )
            if report.policy_version != req.policy_version:
                raise EvalBoardError(
                    "policy_version",
                    f"request {request_id} is for policy version {req.policy_version}, not "
                    f"{report.policy_version}: a result is only recorded for the version it "
                    "was measured on (report status 'refused' with the reason instead)",
                    409,
                )
            for name, value in report.metrics.items():
                if not math.isfinite(value):
                    raise EvalBoardError(f"metrics.{name}", f"metrics.{name} is not finite")
            report.env_name = req.expected[report.env_id]
            req.reports[report.env_id] = report
            return req

    def env_left(self, env_id: int) -> None:
        """``env_id`` disconnected: requests waiting for it stop waiting."""
        with self._lock:
            for req in self._requests.values():
                if env_id in req.expected and env_id not in req.reports:
                    req.gone[env_id] = req.expected[env_id]

    def results(self, request_id: int) -> EvalRequest:
        """The request and its reports so far."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                raise EvalBoardError("request_id", f"no evaluation request {request_id}", 404)
            return req

    def latest(self) -> list[EvalReport]:
        """The newest ``done`` report of each env, for ``/metrics``."""
        return [report for report, _ in self.latest_with_step()]

    def latest_with_step(self) -> list[tuple[EvalReport, int | None]]:
        """The newest ``done`` report of each env with the step of its request."""
        with self._lock:
            newest: dict[int, tuple[EvalReport, int | None]] = {}
            for rid in sorted(self._requests):
                req = self._requests[rid]
                for env_id, rep in req.reports.items():
                    if rep.status == "done":
                        newest[env_id] = (rep, req.step)
            return [newest[e] for e in sorted(newest)]
