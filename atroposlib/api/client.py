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
* **Ranks**: each process of a multi-process trainer that pulls batches itself gives its own
  ``rank``; every batch goes to one of them (``GET /batch?rank=R&consumer=UUID``, with the uuid
  ``/register`` returned). Two clients that claim one rank: the one registered last gets it, the
  other stops with an error that says so (no batch is trained twice).
* **A run-api that lost the run**: when run-api answers that no trainer is registered, or does
  not know this client's uuid (it restarted without ``--store``, or ``/reset_data`` was called),
  the client registers again with what it registered before, starting from the step of the last
  batch it received, and logs a warning (the groups run-api held are gone).
* **Long poll**: :meth:`TrainerClient.get_batch` asks ``GET /batch?wait=SECONDS`` (run-api
  holds the request until a batch is ready, up to ``long_poll`` seconds), so a batch is handed
  over as soon as it forms instead of at the next poll. Whether run-api long-polls is seen on
  the first such request (its answer carries ``X-Atropos-Wait``); an upstream run-api ignores
  ``wait`` and answers at once, and the client then polls every ``poll`` seconds as before.
* **API key**: every request carries the key of ``run-api --api-key``, by default from the
  ``ATROPOS_API_KEY`` environment variable (``Authorization: Bearer KEY``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from typing import Any

import httpx

from atroposlib.utils.api_key import API_KEY_ENV, api_key_headers, resolve_api_key

logger = logging.getLogger(__name__)

__all__ = ["TrainerClient", "TrajectoryAPIError"]

#: Header carrying a batch's step (read to acknowledge it on the next ``/batch``).
STEP_HEADER = "X-Atropos-Step"
#: Header set on a batch handed out a second time.
REDELIVERED_HEADER = "X-Atropos-Redelivered"
#: Header of a long-polled ``/batch`` answer (the wait run-api honoured); absent: no long poll.
WAIT_HEADER = "X-Atropos-Wait"
#: Headers of a long poll that ended without a batch: sequences queued / held as parts.
QUEUED_HEADER = "X-Atropos-Queued-Sequences"
HELD_HEADER = "X-Atropos-Held-Sequences"
#: Header of a long-polled answer: groups the envs dropped before sending, by reason (JSON).
ENV_DROPPED_HEADER = "X-Atropos-Env-Dropped-Groups"
#: What an env's drop reason (``BaseEnv.drop_counts``) means, for the waiting message.
DROP_REASONS = {
    "same_scores": "all replies scored alike, no learning signal",
    "too_long": "a sequence over max_token_len",
    "group_size": "fewer sequences than the group size",
    "error": "the rollout raised",
    "timeout": "the rollout timed out",
    "malformed": "not a valid group",
    "refused": "run-api refused them",
    "send_failed": "sending failed",
}
#: Default seconds one long-polled ``GET /batch`` may wait (run-api accepts up to 30).
LONG_POLL_S = 10.0


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
        rank: This process's rank when several processes of one trainer each pull batches
            (each batch goes to one of them). None (default): the ``RANK`` environment
            variable that torchrun, accelerate and DeepSpeed set, else 0.
        long_poll: Seconds one ``GET /batch`` of :meth:`get_batch` asks run-api to wait for a
            batch (``?wait=``, at most 30); 0: never long-poll (poll every ``poll`` s).
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 30.0,
        ack: bool = True,
        api_key: str | None = None,
        rank: int | None = None,
        long_poll: float = LONG_POLL_S,
    ) -> None:
        if not 0 <= long_poll <= 30:
            raise ValueError(f"long_poll must be from 0 to 30 seconds, got {long_poll}")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.long_poll = long_poll
        #: whether run-api long-polls ``/batch`` (None: not known yet; found on first use)
        self.long_poll_supported: bool | None = None
        #: sequences queued and held by run-api when its last long poll ended without a batch
        self.last_fill: tuple[int, int] | None = None
        #: groups the envs dropped before sending, by reason (run-api's last long poll), and
        #: the same when the last batch came: what a wait is spent on
        self.env_dropped: Counter[str] = Counter()
        self._env_dropped_at_batch: Counter[str] = Counter()
        self.ack = ack
        self.rank = int(os.environ.get("RANK", "0") or 0) if rank is None else rank
        #: the uuid of this client's ``/register``, sent as ``consumer`` with each ``/batch``
        self.uuid: int | None = None
        self._registration: dict[str, Any] | None = None
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
        self,
        method: str,
        path: str,
        deadline: float | None,
        passed: tuple[int, ...] = (),
        **kwargs: Any,
    ) -> httpx.Response:
        """One call, retried on connection errors and 5xx until ``deadline`` (None: forever;
        a deadline already past: one attempt). 4xx answers raise, except those in ``passed``."""
        delay = 0.2
        while True:
            try:
                response = self._http.request(method, path, **kwargs)
                if response.status_code in passed:
                    return response
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
        self._registration = body
        self.uuid = int(reply["uuid"])
        return self.uuid

    def _register_again(self, why: str, timeout: float | None) -> None:
        """run-api lost this run (``why``): register again as before, from the last step."""
        assert self._registration is not None
        body = dict(self._registration)
        if self.last_step is not None:
            body["starting_step"] = self.last_step
        logger.warning(
            "run-api %s: it restarted without its store (run-api --store keeps it) or "
            "/reset_data was called; registering again at step %d. Groups it held are gone.",
            why,
            body["starting_step"],
        )
        reply = self._json("POST", "/register", self._deadline(timeout), json=body)
        if "uuid" not in reply:
            raise TrajectoryAPIError(f"/register answered without a uuid: {reply}")
        self.uuid = int(reply["uuid"])

    def try_batch(
        self, *, timeout: float | None = 10.0, wait: float = 0.0
    ) -> list[dict[str, Any]] | None:
        """One ``GET /batch`` (acknowledging the last batch received): the groups of the next
        batch, or None when none is ready.

        ``wait``: seconds run-api may hold the request until a batch is ready (a long poll,
        ``?wait=``; not sent once run-api was seen not to support it).

        Raises ``TrajectoryAPIError`` if the API reports an error (e.g. not registered).
        """
        deadline = self._deadline(timeout)
        wait = 0.0 if self.long_poll_supported is False else min(max(wait, 0.0), 30.0)
        extra: dict[str, Any] = {}
        if wait > 0:
            # the read may take the whole wait: the timeout counts from when it ends
            extra["timeout"] = httpx.Timeout(self.timeout, read=self.timeout + wait)
        for attempt in range(2):
            params: dict[str, Any] = {}
            if wait > 0:
                params["wait"] = f"{wait:.3f}".rstrip("0").rstrip(".")
            if self.ack and self.last_step is not None:
                params["ack"] = self.last_step
                if self.rank:
                    params["rank"] = self.rank
                if self.uuid is not None:
                    params["consumer"] = self.uuid
            # a response cut short is a transport error, retried by _response: with the same
            # ack, run-api hands the same batch out again
            response = self._response(
                "GET", "/batch", deadline, passed=(409,), params=params, **extra
            )
            lost = self._lost_run(response)
            if lost is None:
                break
            if self._registration is None or attempt:
                raise TrajectoryAPIError(f"/batch: {lost}")
            self._register_again(lost, timeout)
        if wait > 0 and self.long_poll_supported is None:
            self.long_poll_supported = WAIT_HEADER.lower() in response.headers
            if self.long_poll_supported:
                logger.info("run-api long-polls /batch: each request waits up to %g s", wait)
            else:
                logger.info(
                    "run-api does not long-poll /batch (an upstream server?): polling instead"
                )
        reply = response.json()
        dropped = response.headers.get(ENV_DROPPED_HEADER)
        if dropped is not None:
            try:
                self.env_dropped = Counter(
                    {str(k): int(v) for k, v in dict(json.loads(dropped)).items()}
                )
            except (ValueError, TypeError):
                logger.debug("/batch: unreadable %s header: %r", ENV_DROPPED_HEADER, dropped)
        if not reply.get("batch"):
            queued = response.headers.get(QUEUED_HEADER)
            held = response.headers.get(HELD_HEADER)
            if queued is not None and held is not None:
                self.last_fill = (int(queued), int(held))
            return None
        self._env_dropped_at_batch = Counter(self.env_dropped)
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

    def _lost_run(self, response: httpx.Response) -> str | None:
        """Why run-api cannot serve this client as registered (it lost the registration, or
        this client's uuid), or None. Other 409s (a rank taken over) raise."""
        if response.status_code == 409:
            detail = response.json().get("detail") or [{}]
            if detail[0].get("type") == "unknown_consumer":
                return "does not know this trainer's registration"
            raise TrajectoryAPIError(
                f"GET {self.url}/batch: HTTP 409 {detail[0].get('msg', response.text[:500])}"
            )
        reply = response.json()
        if reply.get("status") == "error":
            return f"answered: {reply.get('message', reply)}"
        return None

    def get_batch(self, *, timeout: float | None = None, poll: float = 1.0) -> list[dict]:
        """``GET /batch`` until a batch comes; returns its groups. Each request long-polls
        (run-api answers as soon as the batch is ready, or after ``long_poll`` s); against a
        run-api that does not long-poll, one request every ``poll`` s.

        Raises ``TrajectoryAPIError`` if the API reports an error (e.g. not registered) or no
        batch arrives within ``timeout`` seconds.
        """
        started = time.monotonic()
        deadline = self._deadline(timeout)
        reported = started
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            wait = self.long_poll if remaining is None else min(self.long_poll, remaining)
            asked = time.monotonic()
            batch = self.try_batch(timeout=remaining, wait=wait)
            now = time.monotonic()
            if batch:
                if now - started >= 1.0:
                    logger.debug("/batch: waited %.1f s for this batch", now - started)
                return batch
            if deadline is not None and now > deadline:
                raise TrajectoryAPIError(
                    f"no batch from {self.url}/batch within {timeout:.0f} s: waited for "
                    + self._waits_for()
                )
            if now - reported >= max(self.long_poll, poll, 10.0):
                reported = now
                logger.info("Waiting for a batch for %.0f s: %s", now - started, self._waits_for())
            if self.long_poll_supported and now - asked >= wait / 2:
                continue  # run-api waited: ask again at once
            time.sleep(poll)  # no long poll, or run-api answered early (shutting down)

    def _waits_for(self) -> str:
        """What a waiting :meth:`get_batch` waits for, as far as run-api said."""
        size = (self._registration or {}).get("batch_size", "?")
        dropped = self.env_dropped - self._env_dropped_at_batch
        if dropped:
            reasons = ", ".join(
                f"{count} {reason} ({DROP_REASONS[reason]})"
                if reason in DROP_REASONS
                else f"{count} {reason}"
                for reason, count in dropped.most_common()
            )
            why = (
                f"; since the last batch the envs dropped {dropped.total()} group(s) before "
                f"sending them: {reasons}"
            )
        else:
            why = " (are environments running and sending data?)"
        if self.long_poll_supported and self.last_fill is not None:
            queued, held = self.last_fill
            if isinstance(size, int) and queued >= size:
                return (
                    f"a batch of {size} sequences; run-api has {queued} queued, but no set of "
                    f"whole queued groups adds up to exactly {size} sequences yet (or an env's "
                    "minimum batch allocation holds batches back); waiting for more groups"
                    + (why if dropped else "")
                )
            return (
                f"a batch of {size} sequences; run-api has {queued} queued and {held} held as "
                f"parts of groups{why}"
            )
        return f"a batch of {size} sequences{why}"

    def status(self, *, timeout: float | None = 10.0) -> dict[str, Any]:
        """``GET /status``: ``{"current_step", "queue_size"}``."""
        return self._json("GET", "/status", self._deadline(timeout))

    # ------------------------------------------------------------ pinned evaluations

    def request_eval(self, policy_version: int, *, step: int | None = None) -> dict[str, Any]:
        """``POST /eval-request``: every env that takes such requests evaluates the weights of
        ``policy_version`` (the step the trainer just synced) and reports to run-api. Returns
        ``{"request_id", "policy_version", "step", "expected": [env ids], ...}`` (see
        :meth:`eval_results`)."""
        body = {"policy_version": policy_version, "step": step}
        return self._json("POST", "/eval-request", self._deadline(30.0), json=body)

    def eval_results(
        self, request_id: int, *, wait: bool = False, timeout: float | None = None
    ) -> dict[str, Any]:
        """``GET /eval-results``: the reports of request ``request_id`` so far (``complete``:
        every expected env answered or disconnected). ``wait``: poll until complete, or until
        ``timeout`` seconds (then the partial results, ``complete`` false)."""
        deadline = self._deadline(timeout)
        while True:
            reply = self._json(
                "GET", "/eval-results", self._deadline(30.0), params={"request_id": request_id}
            )
            if not wait or reply.get("complete"):
                return reply
            if deadline is not None and time.monotonic() > deadline:
                return reply
            time.sleep(0.5)
