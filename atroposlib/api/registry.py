"""The environments of a run: what ``/register-env`` records, ``/disconnect-env`` changes, and
the shares ``/status-env`` reports. A plain object (no HTTP, no storage, no lock): the queue
(:class:`~atroposlib.api.queue.TrajectoryQueue`) owns one, guards it with its lock and persists
each record it changes.

Env ids are positions in the run's list and are never reused: a disconnected env keeps its
record (and its id counts against ``--max-envs``) until ``/reset_data`` starts a new run.
"""

from __future__ import annotations

import time
from typing import Any

from atroposlib.api.errors import Refused, UnknownEnv
from atroposlib.api.models import RegisterEnv

__all__ = ["MIN_ENV_WEIGHT", "EnvRegistry"]

#: Floor of an env's share in ``/status-env`` so no env is starved completely (upstream's value).
MIN_ENV_WEIGHT = 0.01


class EnvRegistry:
    """The env records of one run, in registration order (upstream's field names)."""

    def __init__(self, max_envs: int, records: list[dict[str, Any]] | None = None) -> None:
        self.max_envs = max_envs
        #: one record per env id: ``max_context_len``, ``weight``, ``desired_name``,
        #: ``real_name``, ``registered_id``, ``last_update``, ``connected``,
        #: ``min_batch_allocation``, ``group_size``, ``eval_requests``
        self.records: list[dict[str, Any]] = list(records or [])

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self):  # noqa: ANN204 - an iterator of records
        return iter(self.records)

    def add(self, req: RegisterEnv) -> dict[str, Any]:
        """Record a new env and return its record. Raises :class:`Refused`
        (``too_many_envs``) past ``max_envs``."""
        if len(self.records) >= self.max_envs:
            raise Refused(
                "too_many_envs",
                f"{len(self.records)} envs registered in this run, the limit (run-api "
                "--max-envs; disconnected envs count too, as env ids are never reused): "
                "/reset_data starts a new run",
            )
        same_name = sum(1 for e in self.records if e["desired_name"] == req.desired_name)
        record = {
            "max_context_len": req.max_token_length,
            "weight": req.weight,
            "desired_name": req.desired_name,
            "real_name": f"{req.desired_name}_{same_name}",
            "registered_id": len(self.records),
            "last_update": time.time(),
            "connected": True,
            "min_batch_allocation": req.min_batch_allocation,
            "group_size": req.group_size,
            "eval_requests": req.eval_requests,
        }
        self.records.append(record)
        return record

    def get(self, env_id: int) -> dict[str, Any]:
        """The record of ``env_id``; :class:`UnknownEnv` when no such env was registered."""
        if not 0 <= env_id < len(self.records):
            raise UnknownEnv(
                f"unknown env_id {env_id}: {len(self.records)} env(s) registered"
                " (register with /register-env; the API may have been reset)"
            )
        return self.records[env_id]

    def connected_record(self, env_id: int | None) -> dict[str, Any] | None:
        """The record of ``env_id`` while that env is connected, else None."""
        if env_id is None or not 0 <= env_id < len(self.records):
            return None
        record = self.records[env_id]
        return record if record["connected"] else None

    def disconnect(self, env_id: int) -> dict[str, Any]:
        """Mark ``env_id`` disconnected; returns its record (:class:`UnknownEnv` if none)."""
        record = self.get(env_id)
        record["connected"] = False
        record["last_update"] = time.time()
        return record

    def connected(self) -> list[dict[str, Any]]:
        """Records of the connected envs."""
        return [e for e in self.records if e["connected"]]

    def evaluators(self) -> dict[int, str]:
        """Env id -> name of the connected envs that take pinned evaluations."""
        return {
            e["registered_id"]: e["real_name"]
            for e in self.records
            if e["connected"] and e.get("eval_requests")
        }

    def min_allocations(self) -> dict[int, float]:
        """``min_batch_allocation`` of each connected env that set one."""
        return {
            e["registered_id"]: e["min_batch_allocation"]
            for e in self.records
            if e["connected"] and e.get("min_batch_allocation") is not None
        }

    def env_weight(self, env_id: int) -> float:
        """The env's share of inference capacity (``/status-env``'s ``env_weight``): its
        ``max_context_len * weight`` over the connected envs' total, at least
        :data:`MIN_ENV_WEIGHT` (also when no connected env has a positive weight)."""
        record = self.get(env_id)
        total = sum(e["max_context_len"] * max(0.0, e["weight"]) for e in self.connected())
        share = record["max_context_len"] * record["weight"] / total if total > 0 else 0.0
        return max(MIN_ENV_WEIGHT, share)

    def unallocated_fraction(self) -> float:
        """The fraction of each batch no connected env's ``min_batch_allocation`` reserves."""
        minimum_total = sum(m for m in self.min_allocations().values())
        return 1.0 - min(minimum_total, 1.0)

    def minimum_sequences(self, batch_size: int) -> dict[int, int]:
        """Sequences of each batch reserved for each connected env with a minimum."""
        return {env: int(batch_size * f) for env, f in self.min_allocations().items()}
