"""The trainer's side of the trajectory API (``run-api``): register, pull batches, read status.

One synchronous client used by every program that stands in for a trainer: the example GRPO
trainer (``example_trainer``), the data tools (``atropos-sft-gen``, ``atropos-dpo-gen``) and the
viewer (``view-run``).

* **Waiting**: every call is retried on connection errors and 5xx answers, with exponential
  backoff (0.2 s doubling to 2 s), until its deadline: run-api may start after the trainer, or
  restart under it. 4xx answers are errors at once.
* **At-least-once delivery**: each ``GET /batch`` carries ``ack=<step of the last batch
  received>`` (after ``/register``, its starting step). A batch's step comes back in the
  ``X-Atropos-Step`` header; a batch whose response was lost (run-api died or the connection
  broke mid-response) is handed out again by a run-api with a durable store, marked
  ``X-Atropos-Redelivered: 1``. An upstream run-api ignores ``ack`` (at-most-once, as before).
* **API key**: every request carries the key of ``run-api --api-key``, by default from the
  ``ATROPOS_API_KEY`` environment variable (``Authorization: Bearer KEY``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx

from atroposlib.utils.api_key import API_KEY_ENV, api_key_headers, resolve_api_key

logger = logging.getLogger(__name__)

__all__ = ["TrainerClient", "TrajectoryAPIError"]

#: Header carrying a batch's step (read to acknowledge it on the next ``/batch``).
STEP_HEADER = "X-Atropos-Step"
#: Header set on a batch handed out a second time.
REDELIVERED_HEADER = "X-Atropos-Redelivered"


class TrajectoryAPIError(RuntimeError):
    """run-api could not be reached in time, or answered with an error."""


class TrainerClient:
    """A small synchronous client for ``run-api``'s trainer endpoints.

    Args:
        url: run-api's base URL (``http://localhost:8000``).
        timeout: Seconds one HTTP request may take.
        ack: Acknowledge batches (``GET /batch?ack=N``; at-least-once delivery).
        api_key: The key of ``run-api --api-key``, sent with every request. None (default):
            the ``ATROPOS_API_KEY`` environment variable; ``""``: no key.
    """

    def __init__(
        self, url: str, *, timeout: float = 30.0, ack: bool = True, api_key: str | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self.ack = ack
        self._http = httpx.Client(
            base_url=self.url, timeout=timeout, headers=api_key_headers(resolve_api_key(api_key))
        )
        #: step of the last batch received (``X-Atropos-Step``), acknowledged on the next /batch
        self.last_step: int | None = None

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._http.close()

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------- transport

    def _response(
        self, method: str, path: str, deadline: float | None, **kwargs: Any
    ) -> httpx.Response:
        """One call, retried on connection errors and 5xx until ``deadline`` (None: forever;
        a deadline already past: one attempt)."""
        delay = 0.2
        while True:
            try:
                response = self._http.request(method, path, **kwargs)
                if response.status_code < 500:
                    if response.status_code == 401:
                        raise TrajectoryAPIError(
                            f"{method} {self.url}{path}: HTTP 401 {response.text[:300]}: set "
                            f"{API_KEY_ENV} (or api_key=) to run-api's --api-key"
                        )
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

    def _json(self, method: str, path: str, deadline: float | None, **kwargs: Any) -> Any:
        return self._response(method, path, deadline, **kwargs).json()

    @staticmethod
    def _deadline(timeout: float | None) -> float | None:
        return None if timeout is None else time.monotonic() + timeout

    # ------------------------------------------------------------------------- endpoints

    def reset(self, *, timeout: float | None = 10.0) -> None:
        """``GET /reset_data``: forget the registration, envs, queue and step."""
        self._response("GET", "/reset_data", self._deadline(timeout))
        self.last_step = None

    def register(
        self,
        *,
        batch_size: int,
        max_token_len: int,
        num_steps: int,
        checkpoint_dir: str = "",
        save_checkpoint_interval: int = 0,
        starting_step: int = 0,
        wandb_group: str = "",
        wandb_project: str = "",
        timeout: float | None = 120.0,
    ) -> int:
        """``POST /register``, retrying until run-api answers; returns the trainer's uuid.

        ``batch_size``: sequences per batch; ``max_token_len``: longest sequence accepted (run-api
        refuses longer ones); ``num_steps``: steps of the run; ``starting_step``: the step a
        resumed trainer continues from (batches up to it count as acknowledged);
        ``checkpoint_dir`` and ``save_checkpoint_interval`` are passed on to environments.
        """
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
        reply = self._json("POST", "/register", self._deadline(timeout), json=body)
        if "uuid" not in reply:
            raise TrajectoryAPIError(f"/register answered without a uuid: {reply}")
        if self.last_step is None:
            # batches up to the step we start from are done; any later one is handed out again
            self.last_step = starting_step
        return int(reply["uuid"])

    def try_batch(self, *, timeout: float | None = 10.0) -> list[dict[str, Any]] | None:
        """One ``GET /batch`` (acknowledging the last batch received): the groups of the next
        batch, or None when none is ready.

        Raises ``TrajectoryAPIError`` if the API reports an error (e.g. not registered).
        """
        params = {} if (self.last_step is None or not self.ack) else {"ack": self.last_step}
        # a response cut short is a transport error, retried by _response: with the same ack,
        # run-api hands the same batch out again
        response = self._response("GET", "/batch", self._deadline(timeout), params=params)
        reply = response.json()
        if reply.get("status") == "error":
            raise TrajectoryAPIError(f"/batch: {reply.get('message', reply)}")
        if not reply.get("batch"):
            return None
        step = response.headers.get(STEP_HEADER)
        if step is not None:
            self.last_step = int(step)
        if response.headers.get(REDELIVERED_HEADER):
            logger.warning(
                "/batch: run-api handed out the batch of step %s again (the previous response "
                "was lost)",
                step,
            )
        return reply["batch"]

    def get_batch(self, *, timeout: float | None = None, poll: float = 1.0) -> list[dict]:
        """``GET /batch`` until a batch comes (polling every ``poll`` s); returns its groups.

        Raises ``TrajectoryAPIError`` if the API reports an error (e.g. not registered) or no
        batch arrives within ``timeout`` seconds.
        """
        deadline = self._deadline(timeout)
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            batch = self.try_batch(timeout=remaining)
            if batch:
                return batch
            if deadline is not None and time.monotonic() > deadline:
                raise TrajectoryAPIError(
                    f"no batch from {self.url}/batch within {timeout:.0f} s; are environments "
                    "running and sending data?"
                )
            time.sleep(poll)

    def status(self, *, timeout: float | None = 10.0) -> dict[str, Any]:
        """``GET /status``: ``{"current_step", "queue_size"}``."""
        return self._json("GET", "/status", self._deadline(timeout))
