"""Server configs and the abstract inference-server client every backend builds on.

* ``ServerBaseline`` / ``APIServerConfig``: pydantic configs (one server, or a template for
  several generated ones).
* ``ReasoningConfig``: how "thinking" options are injected into chat requests per provider.
* ``AsyncSemWithAdaptiveWeight``: the weighted semaphore that rations one server's concurrency
  between environments.
* ``APIServer``: the abstract client. It owns the semaphores, the health loop, retries, the
  timing metrics and the server's policy version (:mod:`.policy_version`); subclasses implement
  the ``_*_wrapper`` methods that talk to a backend.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import httpx
import numpy as np
from openai.types.chat.chat_completion import ChatCompletion
from openai.types.completion import Completion
from pydantic import BaseModel, Field, model_validator
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from atroposlib.envs.server_handling import policy_version as _policy

logger = logging.getLogger(__name__)

VALID_REASONING_EFFORTS = {"none", "minimal", "low", "medium", "high", "xhigh"}


@dataclass
class ReasoningConfig:
    """Reasoning ("thinking") options injected into chat requests.

    Attributes:
        enabled: Whether reasoning is requested. Set automatically when ``effort`` or
            ``max_tokens`` is given.
        effort: One of ``none``, ``minimal``, ``low``, ``medium``, ``high``, ``xhigh``.
        max_tokens: Reasoning token budget. Not validated: provider limits differ.
    """

    enabled: bool = False
    effort: str | None = None
    max_tokens: int | None = None

    #: Effort levels as token budgets (OpenRouter's percentages of a 32k budget).
    EFFORT_TO_MAX_TOKENS: ClassVar[dict[str, int]] = {
        "none": 1024,
        "minimal": 3200,
        "low": 6400,
        "medium": 16000,
        "high": 25600,
        "xhigh": 30400,
    }

    def __post_init__(self) -> None:
        if self.effort is not None and self.effort not in VALID_REASONING_EFFORTS:
            raise ValueError(
                f"Invalid reasoning_effort: {self.effort!r}. "
                f"Must be one of: {sorted(VALID_REASONING_EFFORTS)}"
            )
        if self.effort is not None or self.max_tokens is not None:
            self.enabled = True

    def is_reasoning_kwargs_active(self) -> bool:
        """True when reasoning options should be sent."""
        return self.enabled

    def build_extra_body(
        self, base_url: str | None = None, use_max_tokens: bool = False
    ) -> dict[str, Any] | None:
        """The ``extra_body`` fragment for a request to ``base_url``, or None when off.

        The official OpenAI endpoint takes a top-level ``reasoning_effort`` (default
        ``medium``). Everyone else (OpenRouter, vLLM, ...) takes ``{"reasoning": {...}}`` with
        ``enabled`` and one of ``effort`` or ``max_tokens``; effort wins. ``use_max_tokens``
        converts the effort to a token budget for providers that only take budgets.
        """
        if not self.is_reasoning_kwargs_active():
            return None
        if base_url and "api.openai.com" in base_url:
            return {"reasoning_effort": self.effort or "medium"}
        reasoning: dict[str, Any] = {"enabled": True}
        if use_max_tokens and self.effort is not None:
            reasoning["max_tokens"] = self.EFFORT_TO_MAX_TOKENS.get(self.effort, 8192)
        elif self.effort is not None:
            reasoning["effort"] = self.effort
        elif self.max_tokens is not None:
            reasoning["max_tokens"] = self.max_tokens
        return {"reasoning": reasoning}

    @classmethod
    def from_env_config(cls, env_config: Any) -> ReasoningConfig:
        """Build from an env config's ``thinking_mode``, ``reasoning_effort`` and
        ``max_reasoning_tokens`` fields (missing fields count as unset)."""
        thinking_mode = getattr(env_config, "thinking_mode", False)
        effort = getattr(env_config, "reasoning_effort", None)
        max_tokens = getattr(env_config, "max_reasoning_tokens", None)
        return cls(
            enabled=bool(thinking_mode) or effort is not None or max_tokens is not None,
            effort=effort,
            max_tokens=max_tokens,
        )


class AsyncSemWithAdaptiveWeight:
    """An asyncio semaphore whose usable share is ``weight`` of its size.

    The counter may only be taken while ``_value > min_val()``, where
    ``min_val() = max_val * (1 - weight)``; an environment with weight ``w`` thus gets about
    ``w`` of a server's concurrency. ``_value``, ``max_val`` and ``min_val()`` are read by
    ``ServerManager`` to route requests. Waiters are woken first-in, first-out.
    """

    def __init__(self, value: int) -> None:
        if value < 0:
            raise ValueError("Semaphore initial value must be >= 0")
        self._value = value
        self.max_val = value
        self.weight = 1.0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        #: Futures resolved on the next release or weight change (see ``notify_on_release``).
        self._release_listeners: list[asyncio.Future] = []

    def update_weight(self, weight: float) -> None:
        """Set the share of this semaphore the owner may use; wakes waiters it frees."""
        self.weight = weight
        self._wake_up_waiters()
        self._notify_listeners()

    def notify_on_release(self, future: asyncio.Future) -> None:
        """Resolve ``future`` (with None) at the next ``release`` or ``update_weight``: lets
        someone who watches several semaphores sleep until a slot may have freed."""
        if len(self._release_listeners) >= 256:  # drop the ones given up on (timed out)
            self._release_listeners = [f for f in self._release_listeners if not f.done()]
        self._release_listeners.append(future)

    def _notify_listeners(self) -> None:
        if self._release_listeners:
            listeners, self._release_listeners = self._release_listeners, []
            for fut in listeners:
                if not fut.done():
                    fut.set_result(None)

    def min_val(self) -> float:
        """The floor the counter cannot be taken below."""
        return self.max_val * (1.0 - self.weight)

    def locked(self) -> bool:
        """True if ``acquire()`` would wait."""
        if self._value <= self.min_val():
            return True
        return bool(self._waiters) and any(not w.done() for w in self._waiters)

    async def acquire(self) -> bool:
        """Take one slot, waiting while none is free."""
        if not self.locked():
            self._value -= 1
            return True
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            try:
                await fut
            finally:
                self._waiters.remove(fut)
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                # We were handed a slot just as we were cancelled: give it back.
                self._value += 1
                self._wake_up_waiters()
            raise
        return True

    def release(self) -> None:
        """Give one slot back and wake a waiter if the floor allows."""
        self._value += 1
        self._wake_up_waiters()
        self._notify_listeners()

    def _wake_up_waiters(self) -> None:
        # A woken waiter's slot is taken here, so nobody can overtake it.
        for fut in self._waiters:
            if self._value <= self.min_val():
                return
            if not fut.done():
                self._value -= 1
                fut.set_result(True)

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class ServerBaseline(BaseModel):
    """Settings shared by inference servers.

    Given alone (not as an ``APIServerConfig`` or a list), it is a template: ``ServerManager``
    generates servers on ``localhost:9004-9007`` (or on the SLURM inference nodes).
    """

    timeout: int = Field(default=1200, description="Timeout for the request in seconds.")
    num_max_requests_at_once: int = Field(
        default=512,
        description="Maximum number of concurrent requests. You should divide this by the n kwarg.",
    )
    num_requests_for_eval: int = Field(
        default=64, description="Maximum number of concurrent requests for evaluation."
    )
    model_name: str = Field(
        default="default", description="The model name sent with every request."
    )
    rolling_buffer_length: int = Field(
        default=1000,
        description="How many recent requests the timing/attempt metrics are computed over.",
    )
    server_type: Literal["openai", "trl", "sglang", "vllm", "atropos-serve"] = Field(
        default="openai",
        description="Type of server to use: openai (any OpenAI-compatible endpoint; no token "
        "ids), vllm (vLLM, or any server with vLLM's /generate: exact token ids and "
        "log-probs), atropos-serve (the same client, by its name), sglang, trl (trl "
        "vllm-serve). docs/backends.md lists what each gives.",
    )
    tokenizer_name: str = Field(
        default="none",
        description="The tokenizer name to use. If none, will use the model_name as the tokenizer.",
    )


class APIServerConfig(ServerBaseline):
    """One concrete inference server."""

    api_key: str | None = Field(
        default="",
        description="API key for the server. Empty (or the placeholder 'x') for a server "
        "of atroposlib's own kinds (server_type vllm, atropos-serve, sglang, trl): the run's "
        "shared key from ATROPOS_API_KEY, when that is set (atropos-launch starts those "
        "servers with it); never for server_type openai.",
    )
    base_url: str | None = Field(
        default="",
        description="Base URL for the server (e.g. http://localhost:9000/v1). Empty means the "
        "provider's default (api.openai.com for openai).",
    )
    n_kwarg_is_ignored: bool = Field(
        default=False, description="Whether the n kwarg is ignored by this API server."
    )
    health_check: bool = Field(
        default=True, description="Whether to perform a health check on the server."
    )
    health_check_interval: float = Field(
        default=1.0, description="Seconds between two health checks."
    )
    health_check_method: Literal["auto", "health", "models", "completion"] = Field(
        default="auto",
        description="How the health loop probes the server: 'health' (GET /health), 'models' "
        "(GET /v1/models), 'auto' (/health, falling back to /v1/models), or 'completion' "
        "(a 1-token request; costs money on paid APIs).",
    )

    @model_validator(mode="after")
    def _run_key(self) -> APIServerConfig:
        # one key per run: atropos-launch gives it to run-api and to every inference server it
        # starts (ATROPOS_API_KEY); never sent to a third-party OpenAI endpoint
        if self.server_type != "openai" and self.api_key in (None, "", "x"):
            from atroposlib.utils.api_key import resolve_api_key

            key = resolve_api_key(None)
            if key:
                self.api_key = key
        return self


LOCAL_SERVER_DEFAULTS: dict[str, Any] = {
    "model_name": "SmolLM2-135M-Instruct",
    "base_url": "http://localhost:9001/v1",
    "api_key": "x",
    "server_type": "vllm",
    "num_requests_for_eval": 32,
    "timeout": 600,
}
"""The server the bundled environments default to: the embedded ``atropos-serve --port 9001``
(SmolLM2-135M-Instruct, which speaks vLLM's ``/generate``, so tokens and logprobs are exact)."""


def local_server_configs(**overrides: Any) -> list[APIServerConfig]:
    """The default server list of a bundled environment's ``config_init``: one
    ``APIServerConfig`` for the local ``atropos-serve`` (``LOCAL_SERVER_DEFAULTS``) with
    ``overrides`` laid over it, e.g. ``local_server_configs(num_requests_for_eval=8,
    timeout=300)``. Command-line ``--openai.*`` flags still override the result."""
    return [APIServerConfig(**{**LOCAL_SERVER_DEFAULTS, **overrides})]


def server_root(base_url: str) -> str:
    """``http://host:port/v1`` -> ``http://host:port`` (only a trailing ``/v1`` is removed)."""
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return root


def _was_aborted(result: Any) -> bool:
    """Whether a backend result holds a choice that ended with ``finish_reason`` "abort"."""
    choices = getattr(result, "choices", None)
    if choices is not None:
        return any(getattr(c, "finish_reason", None) == "abort" for c in choices)
    if isinstance(result, tuple) and len(result) == 4 and isinstance(result[3], list):
        return "abort" in result[3]  # tokens_and_logprobs_completion's finish reasons
    return False


def _retryable(exc: BaseException) -> bool:
    """Retry transport errors and 5xx/408/409/429; a bad request stays bad."""
    if isinstance(exc, (NotImplementedError, AssertionError, TypeError, ValueError)):
        return False
    status = getattr(exc, "status_code", None)
    if status is None:
        status = getattr(exc, "status", None)
    if status is None and isinstance(exc, httpx.HTTPStatusError):
        status = exc.response.status_code
    if isinstance(status, int) and 400 <= status < 500:
        return status in (408, 409, 429)
    return True


class APIServer(ABC):
    """Abstract client for one inference server.

    Public calls (``chat_completion``, ``completion``, ``tokens_and_logprobs_completion``,
    ``get_logprobs``) take the backend's keyword arguments plus ``split`` (``"train"``, the
    default, or anything else for eval). Each call:

    1. starts the health loop on first use (when ``health_check`` is on and a ``base_url`` is
       set; otherwise the server counts as healthy),
    2. sets ``model`` to ``config.model_name`` (chat calls also get reasoning options),
    3. waits while the server is unhealthy, then holds one slot of ``sem`` (train) or
       ``eval_sem`` (eval) for the duration of the request,
    4. retries transient failures (transport errors, 5xx, 408/409/429) up to 3 attempts in
       all, with random exponential backoff; exhausting them raises ``tenacity.RetryError``
       (the last error is ``err.last_attempt.exception()``), other errors propagate at once,
    5. re-runs a generation the server ended with ``finish_reason`` "abort" (a server paused
       for a weight update, vLLM's and atropos-serve's ``POST /pause``): up to
       ``abort_retries`` times, counted in ``aborted_generations``; the request then waits in
       the server's queue until it resumes, so environments only ever see whole samples, all
       drawn from the weights that were live when they ran,
    6. records the request time and attempt count in bounded buffers
       (``rolling_buffer_length`` entries) reported by ``wandb_metrics``,
    7. inside a rollout, records the server's policy version as known when the request
       started (``GET /policy_version``, cached; see :mod:`.policy_version`).

    Subclasses implement ``_chat_completion_wrapper``, ``_completion_wrapper``,
    ``_tokens_and_logprobs_completion_wrapper`` (returning ``(prompt_tokens, output_tokens,
    output_logprobs, finish_reasons)``, one list entry per choice) and optionally
    ``_get_logprobs_wrapper``; ``_probe_health`` may be overridden.
    """

    #: Whether ``tokens_and_logprobs_completion`` returns real token ids and logprobs
    #: (False for plain OpenAI endpoints: ``ManagedServer`` sessions need it).
    provides_token_logprobs: ClassVar[bool] = True
    #: Attempts per request (the first try included).
    retry_attempts: ClassVar[int] = 3
    #: Re-runs of a generation the server aborted (a pause for a weight update).
    abort_retries: ClassVar[int] = 20

    def __init__(
        self, config: APIServerConfig, reasoning_config: ReasoningConfig | None = None
    ) -> None:
        self.config = config
        self.reasoning_config = reasoning_config
        self.sem = AsyncSemWithAdaptiveWeight(config.num_max_requests_at_once)
        self.eval_sem = AsyncSemWithAdaptiveWeight(config.num_requests_for_eval)
        self.server_healthy = True
        maxlen = max(1, config.rolling_buffer_length)
        self.request_timings: collections.deque[float] = collections.deque(maxlen=maxlen)
        self.attempts_list: collections.deque[int] = collections.deque(maxlen=maxlen)
        self.eval_request_timings: collections.deque[float] = collections.deque(maxlen=maxlen)
        self.eval_attempts_list: collections.deque[int] = collections.deque(maxlen=maxlen)
        self.check_task: asyncio.Task | None = None
        self.initialized = False
        self.aborted_generations = 0
        # (monotonic time it went down, wall-clock "HH:MM:SS" of that, last log time)
        self._unhealthy_since: tuple[float, str, float] | None = None

    # ------------------------------------------------------------------ lifecycle

    def _ensure_started(self, chat_completion: bool = True) -> None:
        """Start the health loop on first use (needs a running event loop)."""
        if self.initialized:
            return
        self.initialized = True
        if getattr(self.config, "health_check", False) and getattr(self.config, "base_url", None):
            self.check_task = asyncio.create_task(
                self.check_server_status_task(chat_completion=chat_completion)
            )
        else:
            self.server_healthy = True

    async def check_server_status_task(self, chat_completion: bool = True) -> None:
        """Probe the server every ``health_check_interval`` seconds and set
        ``server_healthy``; runs until cancelled (see ``close``).

        While the server is down, requests wait for it; this loop says so: a warning when it
        goes down (URL and why), then every ``unhealthy_log_interval`` seconds a line with the
        URL and since when, and an info line when it is back."""
        interval = getattr(self.config, "health_check_interval", 1.0)
        # One client for the loop's lifetime: a new one per probe costs ~30 ms of CPU (its SSL
        # context), taken from the cores the inference server generates on.
        async with httpx.AsyncClient() as client:
            self._health_client = client
            try:
                await self._health_loop(interval, chat_completion)
            finally:
                self._health_client = None

    async def _health_loop(self, interval: float, chat_completion: bool) -> None:
        while True:
            why = "health check answered an error status"
            try:
                healthy = bool(await self._probe_health(chat_completion))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure to answer means unhealthy
                logger.debug("health check of %s failed: %r", self.config.base_url, exc)
                healthy, why = False, f"{type(exc).__name__}: {exc}".rstrip(": ")
            self.server_healthy = healthy
            self._log_health(healthy, why)
            await asyncio.sleep(interval)

    #: Seconds between "still waiting for the inference server" lines while it is down.
    unhealthy_log_interval: float = 30.0

    def _log_health(self, healthy: bool, why: str) -> None:
        now = time.monotonic()
        since = getattr(self, "_unhealthy_since", None)  # subclasses may skip __init__
        url = self.config.base_url
        if healthy:
            if since is not None:
                logger.info("inference server %s is back after %.0f s", url, now - since[0])
                self._unhealthy_since = None
            return
        if since is None:
            self._unhealthy_since = (now, time.strftime("%H:%M:%S"), now)
            logger.warning(
                "inference server %s is not answering (%s); requests wait for it", url, why
            )
        elif now - since[2] >= self.unhealthy_log_interval:
            self._unhealthy_since = (since[0], since[1], now)
            logger.warning(
                "still waiting for inference server %s: down since %s (%.0f s; %s)",
                url,
                since[1],
                now - since[0],
                why,
            )

    async def _probe_health(self, chat_completion: bool = True) -> bool:
        """One cheap health probe: ``GET /health``; when that route answers 4xx (absent, or
        not public), ``GET /v1/models``.

        ``health_check_method="completion"`` sends a 1-token request instead (through
        ``_completion_probe``); no paid request is made otherwise.
        """
        method = getattr(self.config, "health_check_method", "auto")
        if method == "completion":
            await self._completion_probe(chat_completion)
            return True
        base = (self.config.base_url or "").rstrip("/")
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        timeout = httpx.Timeout(min(float(self.config.timeout), 30.0))
        client = getattr(self, "_health_client", None)  # the health loop's, while it runs
        if client is None:
            async with httpx.AsyncClient() as own:
                return await self._probe_routes(own, method, base, headers, timeout)
        return await self._probe_routes(client, method, base, headers, timeout)

    async def _probe_routes(
        self,
        client: httpx.AsyncClient,
        method: str,
        base: str,
        headers: dict[str, str],
        timeout: httpx.Timeout,
    ) -> bool:
        if method in ("auto", "health"):
            response = await client.get(
                f"{server_root(base)}/health", headers=headers, timeout=timeout
            )
            if response.status_code < 400 or method == "health":
                return response.status_code < 400
            if response.status_code >= 500:  # the server itself reports a problem
                return False
            # 4xx: no such route (or not for us); ask for the model list instead.
        models_url = f"{base}/models" if base.endswith("/v1") else f"{base}/v1/models"
        response = await client.get(models_url, headers=headers, timeout=timeout)
        return response.status_code < 400

    async def _completion_probe(self, chat_completion: bool = True) -> None:
        """A 1-token request, for servers without a cheap health route. Raise on failure."""
        if chat_completion:
            await self._chat_completion_wrapper(
                model=self.config.model_name,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=1,
            )
        else:
            await self._completion_wrapper(model=self.config.model_name, prompt="hi", max_tokens=1)

    def _policy_tracker(self) -> _policy.PolicyVersionTracker:
        tracker = getattr(self, "_policy_versions", None)  # subclasses may skip __init__
        if tracker is None:
            base = getattr(self.config, "base_url", None)
            root = server_root(base) if base else None
            tracker = _policy.PolicyVersionTracker(root, getattr(self.config, "api_key", None))
            self._policy_versions = tracker
        return tracker

    @property
    def policy_version(self) -> int | None:
        """The server's policy version as last learned (None: unknown or not reported)."""
        tracker = getattr(self, "_policy_versions", None)
        return tracker.value if tracker is not None else None

    async def close(self) -> None:
        """Stop the health loop (subclasses also close their HTTP clients)."""
        tracker = getattr(self, "_policy_versions", None)
        if tracker is not None:
            await tracker.aclose()
        if self.check_task is not None:
            self.check_task.cancel()
            try:
                await self.check_task
            except (asyncio.CancelledError, Exception):
                pass
            self.check_task = None
        self.initialized = False

    async def update_weight(self, weight: float) -> None:
        """Set this env's share of both semaphores."""
        self.sem.update_weight(weight)
        self.eval_sem.update_weight(weight)

    # ------------------------------------------------------------------ reasoning

    def _inject_reasoning_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Merge reasoning options into ``extra_body`` (``skip_reasoning=True`` opts out).

        The official OpenAI endpoint also gets ``temperature=1.0`` and ``max_tokens`` renamed to
        ``max_completion_tokens``, as its reasoning models require.
        """
        if kwargs.pop("skip_reasoning", False):
            return kwargs
        if self.reasoning_config is None or not self.reasoning_config.is_reasoning_kwargs_active():
            return kwargs
        base_url = getattr(self.config, "base_url", None)
        extra = self.reasoning_config.build_extra_body(base_url)
        if extra:
            kwargs["extra_body"] = {**(kwargs.get("extra_body") or {}), **extra}
        if base_url and "api.openai.com" in base_url:
            kwargs["temperature"] = 1.0
            if kwargs.get("max_tokens"):
                kwargs["max_completion_tokens"] = kwargs.pop("max_tokens")
        return kwargs

    # ------------------------------------------------------------------ metrics

    async def wandb_metrics(
        self, metrics_dict: dict[str, Any] | None, server_name: str | None
    ) -> dict[str, Any]:
        """Add ``server/{name}_request_time_{avg,std,99p}`` (and the eval versions),
        ``server/{name}_average_num_attempts`` and ``server/{name}_eval_retry_rate``.

        Values are over the last ``rolling_buffer_length`` requests. Override and call
        ``super()`` to add more.
        """
        metrics = {} if metrics_dict is None else metrics_dict
        name = server_name or "server"
        for prefix, timings in (("", self.request_timings), ("eval_", self.eval_request_timings)):
            if timings:
                values = np.asarray(timings, dtype=float)
                metrics[f"server/{name}_{prefix}request_time_avg"] = float(values.mean())
                metrics[f"server/{name}_{prefix}request_time_std"] = float(values.std())
                metrics[f"server/{name}_{prefix}request_time_99p"] = float(
                    np.percentile(values, 99)
                )
        if self.attempts_list:
            metrics[f"server/{name}_average_num_attempts"] = float(np.mean(self.attempts_list))
        if self.eval_attempts_list:
            metrics[f"server/{name}_eval_retry_rate"] = float(np.mean(self.eval_attempts_list))
        return metrics

    # ------------------------------------------------------------------ backend hooks

    @abstractmethod
    async def _chat_completion_wrapper(self, **kwargs: Any) -> ChatCompletion:
        """Send one chat request; return a ``ChatCompletion`` with ``n`` choices."""

    @abstractmethod
    async def _completion_wrapper(self, **kwargs: Any) -> Completion:
        """Send one completion request; return a ``Completion`` with ``n`` choices."""

    @abstractmethod
    async def _tokens_and_logprobs_completion_wrapper(
        self, **kwargs: Any
    ) -> tuple[list, list, list, list]:
        """Generate from ``prompt`` or ``input_ids``; return ``(prompt_tokens,
        output_tokens_per_choice, output_logprobs_per_choice, finish_reasons)``."""

    async def _get_logprobs_wrapper(self, **kwargs: Any) -> dict[str, Any]:
        """Prompt logprobs: ``{prompt_tokens, prompt_topk_token_ids, prompt_topk_logprobs}``."""
        raise NotImplementedError(
            f"{self.__class__.__name__} does not implement _get_logprobs_wrapper."
        )

    # ------------------------------------------------------------------ request plumbing

    async def _run(self, wrapper: Any, split: str, kwargs: dict[str, Any]) -> Any:
        """One backend call; a generation the server aborted is run again (see the class
        docstring)."""
        collecting = _policy.collecting()
        # read before the request: never newer than the weights that will answer it
        before = await self._policy_tracker().current() if collecting else None
        for attempt in range(self.abort_retries + 1):
            # the version the final attempt's response names, where the server says one
            seen = _policy.watch_responses() if collecting else []
            result = await self._run_once(wrapper, split, kwargs)
            if not _was_aborted(result):
                break
            if attempt == self.abort_retries:
                logger.warning(
                    "the server aborted the same generation %d times; returning its partial result",
                    self.abort_retries + 1,
                )
                break
            self.aborted_generations += 1
            logger.debug("the server aborted a generation (paused?); running it again")
        if collecting:
            _policy.record(min(seen) if seen else before)
        return result

    async def _run_once(self, wrapper: Any, split: str, kwargs: dict[str, Any]) -> Any:
        """Health wait, semaphore, retries and bookkeeping around one backend call."""
        is_train = split == "train"
        sem = self.sem if is_train else self.eval_sem
        attempts = 0
        start: float | None = None
        # The first attempt runs without tenacity (its per-call machinery costs more CPU than
        # a local request); a retryable failure hands over to it for the remaining attempts.
        first_error: BaseException | None = None
        while not self.server_healthy:
            await asyncio.sleep(0.5)
        async with sem:
            start = time.monotonic()
            attempts = 1
            try:
                result = await wrapper(**dict(kwargs))
            except Exception as exc:
                if not _retryable(exc):
                    raise
                first_error = exc
        if first_error is not None:
            retrying = AsyncRetrying(
                stop=stop_after_attempt(self.retry_attempts),
                wait=wait_random_exponential(multiplier=1, max=10),
                retry=retry_if_exception(_retryable),
            )
            async for attempt in retrying:
                with attempt:
                    if attempt.retry_state.attempt_number == 1:
                        raise first_error
                    while not self.server_healthy:
                        await asyncio.sleep(0.5)
                    async with sem:
                        attempts += 1
                        result = await wrapper(**dict(kwargs))
        elapsed = time.monotonic() - (start if start is not None else time.monotonic())
        if is_train:
            self.request_timings.append(elapsed)
            self.attempts_list.append(attempts)
        else:
            self.eval_request_timings.append(elapsed)
            self.eval_attempts_list.append(attempts)
        return result

    async def chat_completion(self, **kwargs: Any) -> ChatCompletion:
        """Chat completion with reasoning injected (``skip_reasoning=True`` opts out)."""
        self._ensure_started(chat_completion=True)
        kwargs["model"] = self.config.model_name
        split = kwargs.pop("split", "train")
        kwargs = self._inject_reasoning_kwargs(kwargs)
        return await self._run(self._chat_completion_wrapper, split, kwargs)

    async def completion(self, **kwargs: Any) -> Completion:
        """Text completion (no reasoning injection: the completions API has none)."""
        self._ensure_started(chat_completion=False)
        kwargs["model"] = self.config.model_name
        kwargs.pop("skip_reasoning", None)
        split = kwargs.pop("split", "train")
        return await self._run(self._completion_wrapper, split, kwargs)

    async def tokens_and_logprobs_completion(self, **kwargs: Any) -> tuple[list, list, list, list]:
        """Generate from ``prompt`` or ``input_ids`` and return token ids and logprobs:
        ``(prompt_tokens, output_tokens, output_logprobs, finish_reasons)``, one entry of the
        last three per choice."""
        self._ensure_started(chat_completion=False)
        kwargs["model"] = self.config.model_name
        kwargs.pop("skip_reasoning", None)
        split = kwargs.pop("split", "train")
        return await self._run(self._tokens_and_logprobs_completion_wrapper, split, kwargs)

    async def get_logprobs(self, **kwargs: Any) -> dict[str, Any]:
        """Prompt logprobs for ``prompt`` or ``input_ids`` (``top_k``, default 1), as
        ``{prompt_tokens, prompt_topk_token_ids, prompt_topk_logprobs}``."""
        self._ensure_started(chat_completion=False)
        kwargs["model"] = self.config.model_name
        split = kwargs.pop("split", "train")
        return await self._run(self._get_logprobs_wrapper, split, kwargs)
