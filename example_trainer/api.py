"""The trainer's side of the trajectory API: register, then pull batches.

Both calls keep retrying while ``run-api`` is starting or restarting (connection refused, 5xx),
so the trainer may be started before the API.

Batches are acknowledged: each ``GET /batch`` carries ``ack=<step of the last batch received>``,
so a batch whose response was lost (run-api died or the connection broke mid-response) is handed
out again by a run-api with a durable store instead of being lost (at-least-once delivery; an
upstream run-api ignores the parameter).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx

logger = logging.getLogger(__name__)


class TrajectoryAPIError(RuntimeError):
    """run-api could not be reached in time, or answered with an error."""


class TrainerAPIClient:
    """A small synchronous client for ``run-api``'s trainer endpoints."""

    def __init__(self, url: str, *, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout)
        #: step of the last batch received (``X-Atropos-Step``), acknowledged on the next /batch
        self.last_step: int | None = None

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._http.close()

    def __enter__(self) -> TrainerAPIClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, deadline: float | None, **kwargs: Any) -> Any:
        """One call, retried on connection errors and 5xx until ``deadline`` (None: forever);
        the decoded JSON body."""
        return self._response(method, path, deadline, **kwargs).json()

    def _response(
        self, method: str, path: str, deadline: float | None, **kwargs: Any
    ) -> httpx.Response:
        """One call, retried on connection errors and 5xx until ``deadline`` (None: forever)."""
        delay = 0.2
        while True:
            try:
                response = self._http.request(method, path, **kwargs)
                if response.status_code < 500:
                    if response.status_code >= 400:
                        raise TrajectoryAPIError(
                            f"{method} {self.url}{path}: HTTP {response.status_code} "
                            f"{response.text[:500]}"
                        )
                    return response
                problem = f"HTTP {response.status_code}"
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if deadline is not None and time.monotonic() > deadline:
                raise TrajectoryAPIError(
                    f"{method} {self.url}{path} failed until the deadline ({problem}); "
                    "is run-api running at this address?"
                )
            logger.debug("%s %s: %s; retrying in %.1f s", method, path, problem, delay)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    def register(
        self,
        *,
        batch_size: int,
        max_token_len: int,
        checkpoint_dir: str,
        save_checkpoint_interval: int,
        starting_step: int,
        num_steps: int,
        wandb_group: str = "",
        wandb_project: str = "",
        timeout: float = 120.0,
    ) -> int:
        """``POST /register``, retrying until run-api answers; returns the trainer's uuid."""
        deadline = time.monotonic() + timeout
        body = {
            "wandb_group": wandb_group,
            "wandb_project": wandb_project,
            "batch_size": batch_size,
            "max_token_len": max_token_len,
            "checkpoint_dir": checkpoint_dir,
            "save_checkpoint_interval": save_checkpoint_interval,
            "starting_step": starting_step,
            "num_steps": num_steps,
        }
        reply = self._request("POST", "/register", deadline, json=body)
        if "uuid" not in reply:
            raise TrajectoryAPIError(f"/register answered without a uuid: {reply}")
        if self.last_step is None:
            # batches up to the step we start from are done; any later one is handed out again
            self.last_step = starting_step
        return int(reply["uuid"])

    def get_batch(self, *, timeout: float | None = None, poll: float = 1.0) -> list[dict]:
        """``GET /batch`` until a batch comes (polling every ``poll`` s); returns its groups.

        Raises ``TrajectoryAPIError`` if the API reports an error (e.g. not registered) or no
        batch arrives within ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            params = {} if self.last_step is None else {"ack": self.last_step}
            # a response cut short is a transport error, retried by _response: with the same
            # ack, run-api hands the same batch out again
            response = self._response("GET", "/batch", deadline, params=params)
            reply = response.json()
            if reply.get("status") == "error":
                raise TrajectoryAPIError(f"/batch: {reply.get('message', reply)}")
            if reply.get("batch"):
                step = response.headers.get("X-Atropos-Step")
                if step is not None:
                    self.last_step = int(step)
                if response.headers.get("X-Atropos-Redelivered"):
                    logger.warning(
                        "/batch: run-api handed out the batch of step %s again (the previous "
                        "response was lost)",
                        step,
                    )
                return reply["batch"]
            if deadline is not None and time.monotonic() > deadline:
                raise TrajectoryAPIError(
                    f"no batch from {self.url}/batch within {timeout:.0f} s; are environments "
                    "running and sending data?"
                )
            time.sleep(poll)

    def status(self) -> dict[str, Any]:
        """``GET /status``: current step and queue size."""
        return self._request("GET", "/status", time.monotonic() + 10)
