"""The HTTP layer of ``atropos-serve``: OpenAI- and vLLM-compatible routes over the engine.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with SSE streaming),
``GET /v1/models``, ``GET /health``, ``POST /generate`` (vLLM's token-level endpoint used by
upstream's ``VLLMServer``), ``POST /reload_weights`` and ``GET /policy_version``. Every error
body has OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

vLLM's token-id extras on the OpenAI routes work as in vLLM 0.32 (what TRL's ``VLLMClient`` and
``TrlVllmServer`` read): ``return_token_ids`` adds the sampled ``token_ids`` to each choice and
the prompt's ``prompt_token_ids`` (per choice for completions, on the response for chat; in the
first chunk of each choice when streaming); ``return_tokens_as_token_ids`` spells every logprob
token ``token_id:N``. vLLM request fields this server cannot honour are refused with a 400
naming them (``protocol.VLLM_ONLY_DEFAULTS``) unless they hold their no-op value.

Policy version: the trainer step whose weights are served (``{"policy_version": N}`` at
``GET /policy_version``, also in ``/health``). It starts at ``--policy-version`` (default 0);
``/reload_weights`` sets it to the ``policy_version`` of its body, or adds 1 when the body has
none, and the new value is reported once the new weights serve requests (never before), so a
client that reads it before sending a request never claims newer weights than the ones that
answer it. Environments stamp their groups with it (see ``docs/compat.md``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from atroposlib.inference.engine import (
    EngineError,
    EngineUnavailableError,
    GenerationEngine,
    MemoryBudgetError,
    QueueFullError,
    RequestHandle,
    SampleOutput,
    StreamEvent,
    copy_weights,
    release_model,
)
from atroposlib.inference.models import load_weights
from atroposlib.inference.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    ReloadRequest,
    TokenGenerateRequest,
    UnsupportedFieldError,
)
from atroposlib.inference.sampling import InvalidParamError, SamplingParams
from atroposlib.schema import POLICY_VERSION_HEADER, PolicyVersion
from atroposlib.utils.http_guard import (
    ApiKeyCheck,
    BodyTooLarge,
    ClientGone,
    body_chunks,
    declared_too_large,
    read_body,
)
from atroposlib.utils.http_security import HttpSecurityMiddleware, replay_body
from atroposlib.utils.shm_weights import SegmentError, SegmentReader

logger = logging.getLogger(__name__)

INLINE_TOKENIZE_CHARS = 8192
"""Prompts up to this many characters are tokenized on the event loop (well under 1 ms)."""

DEFAULT_MAX_REQUEST_BYTES = 16 << 20
"""Default ``--max-request-bytes``: a full context of text many times over, or a batch of
hundreds of token-id prompts."""

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    421: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered in OpenAI's shape with an HTTP status."""

    def __init__(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {message, type, param, code}}``."""
        return {
            "error": {
                "message": self.message,
                "type": _ERROR_TYPES.get(self.status, "error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        """The error as a response (429 and 503 say when to retry)."""
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


@dataclass
class ServerState:
    """Everything the routes share: the engine, names, auth and reload bookkeeping."""

    engine: GenerationEngine
    served_model_names: list[str]
    model_source: str
    dtype: torch.dtype
    api_key: str | None = None
    created: int = 0
    reload_lock: asyncio.Lock | None = None
    last_reload: dict[str, Any] | None = None
    policy_version: int = 0
    """The trainer step whose weights are served (``GET /policy_version``)."""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """Largest request body read; larger ones get 413 (``--max-request-bytes``)."""
    tokenize_pool: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="atropos-tokenize"
        )
    )
    """Where prompts are rendered and tokenized, off the event loop (one thread: a fast
    tokenizer must not be driven from two threads at once)."""
    allowed_hosts: frozenset[str] | None = None
    """Host header names served (``loopback_hosts``); None: no Host check (bound to all)."""
    cors_origins: tuple[str, ...] = ()
    """Origins whose pages may read answers and send requests (never with credentials)."""
    spare_model: Any = None
    """The model the last shared-memory load swapped out, reused by the next one (the new
    weights are copied into it and it is prepared while the current one serves)."""
    folder_source: str = ""
    """The last checkpoint folder served (``model_source`` at start, then each
    ``/reload_weights``): where the first shared-memory load gets its spare model."""
    policy_by_weights: dict[int, int] = field(default_factory=dict)
    """The policy version of each engine weights version (``X-Policy-Version`` of a
    response: the version of the weights its prompt was prefilled on), the last 64; the
    weights loaded at start (engine weights version 0) are ``policy_version``."""
    segments: SegmentReader = field(default_factory=SegmentReader)
    """Keeps the mapping of the trainer's shared-memory segment between syncs."""
    _max_prompt_chars: int | None = None

    def __post_init__(self) -> None:
        self.folder_source = self.folder_source or self.model_source
        self.policy_by_weights.setdefault(0, self.policy_version)

    def expect_policy(self, policy_version: int | None) -> int:
        """Register the policy version the next weights swap will serve (the body's, else
        the current one + 1), under the engine's next weights version, before the swap: a
        response prefilled on the new weights is stamped with it even before the reload
        handler resumes. Returns it."""
        version = policy_version if policy_version is not None else self.policy_version + 1
        self.policy_by_weights[self.engine.weights_version + 1] = version
        while len(self.policy_by_weights) > 64:
            self.policy_by_weights.pop(next(iter(self.policy_by_weights)))
        return version

    def now_serving(self, weights_version: int, policy_version: int) -> None:
        """The swap to engine weights ``weights_version`` (policy ``policy_version``, as
        :meth:`expect_policy` registered it) is live: ``GET /policy_version`` reports it."""
        self.policy_by_weights[weights_version] = policy_version
        self.policy_version = policy_version

    def policy_of(self, weights_version: int | None) -> int | None:
        """The policy version of engine weights ``weights_version`` (None: unknown)."""
        return None if weights_version is None else self.policy_by_weights.get(weights_version)

    @property
    def tokenizer(self) -> Any:
        """The tokenizer (kept across weight reloads)."""
        return self.engine.tokenizer

    @property
    def max_prompt_chars(self) -> int:
        """Characters past which a text prompt cannot fit the context, whatever it says:
        the context length times the longest token's characters, times 4 (for normalisers
        that compose characters). Longer texts are refused without tokenizing them."""
        if self._max_prompt_chars is None:
            tokens = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
            longest = max((len(t) for t in tokens if t), default=1)
            self._max_prompt_chars = 4 * self.engine.max_model_len * max(longest, 1)
        return self._max_prompt_chars

    async def off_loop(self, chars: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, which renders or tokenizes ``chars`` characters: on the tokenizer
        thread (the event loop serves others meanwhile) when that is long enough to matter.

        Short texts are done inline: handing them to a thread costs more than tokenizing them,
        up to ~0.25 s while the event loop is busy (the thread waits for the GIL at every
        release the tokenizer makes).
        """
        if chars <= INLINE_TOKENIZE_CHARS:
            return fn(*args)
        return await asyncio.wrap_future(self.tokenize_pool.submit(fn, *args))


class ReloadBody(ReloadRequest):
    """``POST /reload_weights``: the checkpoint folder, and optionally the policy version (the
    trainer step) its weights are; without one the served version goes up by 1."""

    policy_version: PolicyVersion | None = Field(
        default=None,
        description="Trainer step of these weights, reported at GET /policy_version once they "
        "are live. Default: the current version + 1.",
    )


class ShmLoadBody(BaseModel):
    """``POST /load_weights_from_shm``: a shared-memory segment on this host holding the new
    parameters (:mod:`atroposlib.utils.shm_weights`), and optionally their policy version."""

    model_config = ConfigDict(extra="forbid")

    shm_path: str = Field(
        description="Path of the segment (a file in /dev/shm) the trainer wrote the weights "
        "into; it must exist on the server's machine."
    )
    policy_version: PolicyVersion | None = Field(
        default=None,
        description="Trainer step of these weights, reported at GET /policy_version once they "
        "are live. Default: the current version + 1.",
    )


SEGMENT_CHECK_SECONDS = 5.0
"""How often the server checks whether the shared-memory segment it keeps mapped was deleted."""


def create_app(state: ServerState) -> FastAPI:
    """Build the FastAPI application serving ``state.engine``.

    The caller owns the engine: start it before serving and shut it down afterwards (the
    app's lifespan does the latter).
    """
    state.created = state.created or int(time.time())

    async def forget_deleted_segments() -> None:
        # a segment mapping kept for the next sync goes once its trainer deleted the file (or
        # died and the next writer reaped it): otherwise it holds a model's worth of memory
        while True:
            await asyncio.sleep(SEGMENT_CHECK_SECONDS)
            if state.segments.release_if_gone():
                logger.info("released the mapping of a deleted shared-memory segment")

    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.reload_lock = asyncio.Lock()
        watcher = asyncio.create_task(forget_deleted_segments())
        yield
        watcher.cancel()
        state.segments.release()
        state.engine.shutdown()
        state.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="atropos-serve", lifespan=_as_context(lifespan))
    app.state.atropos = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body')}: {e.get('msg')}"
            for e in errors
        )
        return APIError(400, message or "invalid request", param=".".join(loc) or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    # Plain ASGI middlewares only: ``@app.middleware("http")`` (BaseHTTPMiddleware) hands the
    # route a receive channel that never reports the client going away, so generation went on
    # for clients long gone. The last added runs first: Host and origin checks, then CORS
    # (its preflights carry no API key), then the API key and the body limit.
    app.add_middleware(_Guard, state=state)
    if state.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(state.cors_origins),
            allow_credentials=False,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    app.add_middleware(
        HttpSecurityMiddleware,
        allowed_hosts=state.allowed_hosts,
        allowed_origins=state.cors_origins,
    )

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the engine runs, 503 otherwise (vLLM clients only read the status)."""
        engine = state.engine
        body = {
            "status": "ok" if engine.healthy else "unavailable",
            "model": state.served_model_names[0],
            "weights_version": engine.weights_version,
            "policy_version": state.policy_version,
            "decode_path": engine.decode_path,
            # the precision the model computes in: a trainer checks it against its own
            "dtype": str(state.dtype).removeprefix("torch."),
            "paused": engine.paused,
            **engine.load(),
            "stats": dict(engine.stats),
        }
        return JSONResponse(body, status_code=200 if engine.healthy else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """The served model names (one entry per alias), as in OpenAI and vLLM."""
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "atropos",
                    "root": state.model_source,
                    "parent": None,
                    "max_model_len": state.engine.max_model_len,
                }
                for name in state.served_model_names
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI chat completions; the prompt is rendered with the tokenizer's chat template."""
        _check_model(state, body.model)
        _check_features(body)
        chars = sum(len(str(m.get("content") or "")) for m in body.messages)
        prompt_ids = await state.off_loop(chars, _render_chat, state, body)
        max_tokens = _resolve_max_tokens(
            state, len(prompt_ids), body.max_completion_tokens or body.max_tokens
        )
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        limit = state.engine.max_logprobs
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= limit:
            raise APIError(
                400,
                f"top_logprobs must be in [0, {limit}], got {body.top_logprobs}",
                param="top_logprobs",
            )
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling_params(max_tokens, logprobs)
        handle = _submit(state, prompt_ids, params, body.stream)
        if body.stream:
            return _sse(_chat_stream(state, body, handle))
        outputs = await _wait(request, [handle])
        as_ids = bool(body.return_tokens_as_token_ids)
        choices = []
        for out in outputs[0]:
            choice = {
                "index": out.index,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": _chat_logprobs(
                    state, out.token_ids, out.logprobs, out.top_logprobs, as_ids
                )
                if body.logprobs
                else None,
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
            }
            if body.return_token_ids:
                choice["token_ids"] = list(out.token_ids)
            choices.append(choice)
        reply: dict[str, Any] = {
            "id": f"chatcmpl-{handle.id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.model,
            "choices": choices,
            "usage": _usage([handle]),
        }
        if body.return_token_ids:  # vLLM: on the response, not per choice
            reply["prompt_token_ids"] = list(handle.prompt_ids)
        return _json(state, reply, handle)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI text completions for one prompt or a batch (text or token ids)."""
        _check_model(state, body.model)
        _check_features(body)
        if body.echo:
            raise APIError(400, "'echo' is not supported by atropos-serve", param="echo")
        texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        chars = sum(len(p) for p in texts if isinstance(p, str))
        prompts = await state.off_loop(chars, _completion_prompts, state, body)
        handles = []
        try:
            for prompt_ids in prompts:
                max_tokens = _resolve_max_tokens(state, len(prompt_ids), body.max_tokens)
                params = body.sampling_params(max_tokens, body.logprobs)
                handles.append(_submit(state, prompt_ids, params, body.stream))
        except APIError:
            for handle in handles:
                handle.abort()
            raise
        if body.stream:
            return _sse(_completion_stream(state, body, handles))
        outputs = await _wait(request, handles)
        as_ids = bool(body.return_tokens_as_token_ids)
        choices = []
        for p, outs in enumerate(outputs):
            for out in outs:
                choice = {
                    "index": p * body.n + out.index,
                    "text": out.text,
                    "logprobs": _completion_logprobs(state, out, body.logprobs, as_ids=as_ids)
                    if body.logprobs is not None
                    else None,
                    "finish_reason": out.finish_reason,
                    "stop_reason": out.stop_reason,
                }
                if body.return_token_ids:  # vLLM: both per choice
                    choice["prompt_token_ids"] = list(handles[p].prompt_ids)
                    choice["token_ids"] = list(out.token_ids)
                choices.append(choice)
        return _json(
            state,
            {
                "id": f"cmpl-{handles[0].id}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": body.model,
                "choices": choices,
                "usage": _usage(handles),
            },
            *handles,
        )

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        """vLLM's token-level endpoint (as served by upstream's ``vllm_api_server.py``).

        Answers ``{"text", "prompt", "finish_reasons", "logprobs", "prompt_token_ids",
        "token_ids"}``; ``logprobs[i]`` holds, per generated token, a one-element list with a
        ``{token_id: logprob}`` dict whose first key is the generated token.
        """
        if isinstance(body.prompt, str):
            prompt_ids = await state.off_loop(
                len(body.prompt), _tokenize, state, body.prompt, True, "prompt"
            )
        else:
            if "prompt_token_ids" not in body.prompt:
                raise APIError(400, "prompt must be {'prompt_token_ids': [...]}", param="prompt")
            prompt_ids = list(body.prompt["prompt_token_ids"])
        handle = _submit(state, prompt_ids, body.sampling_params(), False)
        outputs = (await _wait(request, [handle]))[0]
        result: dict[str, Any] = {
            "text": [out.text for out in outputs],
            "prompt": state.tokenizer.decode(prompt_ids),
            "finish_reasons": [out.finish_reason for out in outputs],
            "stop_reasons": [out.stop_reason for out in outputs],
            "prompt_token_ids": prompt_ids,
            "token_ids": [out.token_ids for out in outputs],
        }
        if body.logprobs is not None:
            result["logprobs"] = [_generate_logprobs(out) for out in outputs]
        if body.prompt_logprobs is not None:
            result["prompt_logprobs"] = handle.prompt_logprobs
        return _json(state, result, handle)

    @app.post("/inference/v1/generate")
    async def token_generate(body: TokenGenerateRequest, request: Request) -> Response:
        """vLLM's tokens-in, tokens-out endpoint (``/inference/v1/generate``).

        Answers ``{"request_id", "prompt_token_ids", "choices": [{"index", "token_ids",
        "logprobs": {"content": [{"token": "token_id:N", "logprob", "bytes", "top_logprobs"}]},
        "finish_reason", "stop_reason"}], "usage"}``; ``logprobs`` is ``null`` unless
        ``sampling_params.logprobs`` is set (verifiers' renderer client always sets it).
        """
        if body.model is not None:
            _check_model(state, body.model)
        if body.features is not None or body.content_parts is not None:
            param = "features" if body.features is not None else "content_parts"
            raise APIError(
                400, "atropos-serve serves text models only: no multimodal inputs", param=param
            )
        extra = body.sampling_params.unsupported()
        if extra:
            raise APIError(
                400,
                f"sampling_params.{extra[0]} is not supported by atropos-serve",
                param=f"sampling_params.{extra[0]}",
            )
        sampling = body.sampling_params
        max_tokens = _resolve_max_tokens(state, len(body.token_ids), sampling.max_tokens)
        handle = _submit(state, list(body.token_ids), sampling.to_params(max_tokens), False)
        outputs = (await _wait(request, [handle]))[0]
        choices = []
        for out in outputs:
            logprobs = (
                _chat_logprobs(state, out.token_ids, out.logprobs, out.top_logprobs, as_ids=True)
                if sampling.logprobs is not None
                else None
            )
            choices.append(
                {
                    "index": out.index,
                    "token_ids": list(out.token_ids),
                    "logprobs": logprobs,
                    "finish_reason": out.finish_reason,
                    "stop_reason": out.stop_reason,
                }
            )
        return _json(
            state,
            {
                "request_id": body.request_id or f"gen-{handle.id}",
                "prompt_token_ids": list(handle.prompt_ids),
                "choices": choices,
                "usage": _usage([handle]),
                "prompt_logprobs": None,
                "kv_transfer_params": None,
            },
            handle,
        )

    @app.post("/pause")
    async def pause(
        mode: str | None = None,
        wait_for_inflight_requests: bool = False,
        clear_cache: bool = True,
    ) -> dict[str, Any]:
        """Stop generating until ``POST /resume`` (vLLM's RL endpoint, same parameters).

        ``mode``: ``abort`` (the default, as vLLM: requests generating now end with
        ``finish_reason`` "abort"), ``wait`` (they finish first) or ``keep`` (they freeze
        and continue after ``/resume``). vLLM's older ``wait_for_inflight_requests=true``
        means ``wait``. New requests queue meanwhile. ``clear_cache`` (default true, as
        vLLM) empties the prefix cache; frozen rows keep their own key/value cache. Answers
        once the pause is in effect.
        """
        if clear_cache:
            state.engine.reset_prefix_cache()
        chosen = mode or ("wait" if wait_for_inflight_requests else "abort")
        if chosen not in state.engine.PAUSE_MODES:
            raise APIError(
                400, f"mode must be one of {', '.join(state.engine.PAUSE_MODES)}", param="mode"
            )
        seconds = await asyncio.wrap_future(state.engine.pause(chosen))
        return {"status": "paused", "mode": chosen, "seconds": round(seconds, 3)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, str]:
        """Forget the cached prompt prefixes (vLLM's endpoint). New weights do this anyway."""
        state.engine.reset_prefix_cache()
        return {"status": "ok"}

    @app.post("/resume")
    async def resume() -> dict[str, Any]:
        """Generate again after ``POST /pause`` (a no-op when not paused)."""
        was_paused = state.engine.resume()
        return {"status": "resumed", "was_paused": was_paused}

    @app.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        """``{"is_paused": bool}``, as vLLM."""
        return {"is_paused": state.engine.paused}

    @app.get("/policy_version")
    async def policy_version() -> dict[str, int]:
        """``{"policy_version": N}``: the trainer step whose weights serve requests now."""
        return {"policy_version": state.policy_version}

    @app.post("/reload_weights")
    async def reload_weights(body: ReloadBody) -> dict[str, Any]:
        """Load new weights from a checkpoint folder and swap them in without a restart.

        Sequences already generating finish on the old weights; requests that arrive meanwhile
        wait and then run on the new ones. The reply comes once the new weights are live; so
        does the new ``policy_version`` (the body's, else the current one + 1).
        """
        path = Path(body.path).expanduser()
        if not (path / "config.json").is_file():
            raise APIError(400, f"{path} is not a checkpoint folder (no config.json)", param="path")
        assert state.reload_lock is not None
        async with state.reload_lock:
            requested = time.time()
            started = time.monotonic()
            try:
                model = await _in_own_thread(load_weights, str(path), state.dtype)
            except Exception as exc:  # noqa: BLE001 - any loading failure is the client's input
                raise APIError(400, f"could not load {path}: {exc}", param="path") from exc
            await _in_own_thread(state.engine.prepare_model, model)
            load_seconds = time.monotonic() - started
            new_policy = state.expect_policy(body.policy_version)
            try:
                future = state.engine.request_reload(model)
            except ValueError as exc:
                release_model(model)
                raise APIError(400, str(exc), param="path") from exc
            info = await asyncio.wrap_future(future)
            state.model_source = state.folder_source = str(path)
            if state.spare_model is not None:  # another architecture's spare is no use
                release_model(state.spare_model)
                state.spare_model = None
            state.now_serving(info.weights_version, new_policy)
            state.last_reload = {
                "status": "ok",
                "model": state.served_model_names[0],
                "path": str(path),
                "weights_version": info.weights_version,
                "policy_version": state.policy_version,
                "requested_at": requested,
                "live_at": info.live_at,
                "load_seconds": round(load_seconds, 3),
                "drain_seconds": round(info.drain_seconds, 3),
                "total_seconds": round(time.monotonic() - started, 3),
            }
            logger.info("reloaded weights from %s: %s", path, state.last_reload)
            return state.last_reload

    @app.post("/load_weights_from_shm")
    async def load_weights_from_shm(body: ShmLoadBody) -> dict[str, Any]:
        """Copy new weights from a shared-memory segment into the served model, in place.

        For a trainer on the same machine: no checkpoint on disk, no model loaded, the served
        parameters take the segment's values (converted to the served dtype; tied ones follow).
        As ``/reload_weights``: sequences in flight finish on the old weights, the reply and
        the new ``policy_version`` come once the new ones are live. A segment that does not
        exist here (trainer on another machine) or does not fit the model is a 400 naming
        ``shm_path``; the served weights are then unchanged.
        """
        assert state.reload_lock is not None
        async with state.reload_lock:
            requested = time.time()
            started = time.monotonic()
            try:
                tensors = state.segments.read(body.shm_path)
                state.engine.check_update(tensors)
            except (SegmentError, ValueError) as exc:
                raise APIError(400, f"shm_path: {exc}", param="shm_path") from exc
            map_seconds = time.monotonic() - started
            copy_seconds = prepare_seconds = 0.0
            engine = state.engine
            new_policy = state.expect_policy(body.policy_version)
            load = engine.load()
            if engine.compiled or engine.paused or not (load["running"] or load["waiting"]):
                # Nothing generating (a trainer paused generation, or no requests): copy into
                # the served parameters and re-pack on the engine's own thread, with all its
                # cores. Compiled graphs always keep the served parameters.
                future = engine.request_update(tensors)
                mode = "in_place"
            else:
                # Sequences are generating: double buffer. Fill the spare model and prepare its
                # fast path on this (single-threaded) loader thread while the current one
                # serves, then swap (as /reload_weights, without from_pretrained).
                spare, state.spare_model = state.spare_model, None
                if spare is None:
                    spare = await _in_own_thread(load_weights, state.folder_source, state.dtype)
                try:
                    copy_seconds, prepare_seconds = await _in_own_thread(
                        _fill_model, state.engine, spare, tensors
                    )
                    future = state.engine.request_reload(spare, keep_outgoing=True)
                except ValueError as exc:
                    release_model(spare)
                    raise APIError(400, f"shm_path: {exc}", param="shm_path") from exc
                mode = "swap"
            info = await asyncio.wrap_future(future)
            del tensors  # the mapping closes with the last view
            if info.outgoing is not None:  # (an update in place keeps the spare as it is)
                state.spare_model = info.outgoing
            copy_seconds = copy_seconds or info.copy_seconds
            prepare_seconds = prepare_seconds or info.prepare_seconds
            state.model_source = f"shm:{body.shm_path}"
            state.now_serving(info.weights_version, new_policy)
            state.last_reload = {
                "status": "ok",
                "model": state.served_model_names[0],
                "path": body.shm_path,
                "source": "shm",
                "dtype": str(state.dtype).removeprefix("torch."),
                "mode": mode,
                "weights_version": info.weights_version,
                "policy_version": state.policy_version,
                "requested_at": requested,
                "live_at": info.live_at,
                "map_seconds": round(map_seconds, 4),
                "copy_seconds": round(copy_seconds, 4),
                "prepare_seconds": round(prepare_seconds, 4),
                "drain_seconds": round(info.drain_seconds, 4),
                "total_seconds": round(time.monotonic() - started, 4),
            }
            logger.info("loaded weights from %s: %s", body.shm_path, state.last_reload)
            return state.last_reload

    return app


def _fill_model(
    engine: GenerationEngine, model: Any, tensors: dict[str, torch.Tensor]
) -> tuple[float, float]:
    """Copy ``tensors`` into ``model``'s parameters (tied ones follow; converted to its dtype),
    then prepare its fast path; seconds of each."""
    started = time.monotonic()
    copy_weights(model, tensors)
    copied = time.monotonic()
    engine.prepare_model(model)
    return copied - started, time.monotonic() - copied


# ---------------------------------------------------------------------- middleware


class _Guard:
    """Checks every HTTP request before the routes see it: the API key (the rule every
    atroposlib service shares, :class:`~atroposlib.utils.http_guard.ApiKeyCheck`: open are
    ``GET``/``HEAD /health`` and CORS preflights), then the body: no ``Content-Encoding`` (415; clients of OpenAI-compatible
    servers send plain JSON) and at most ``state.max_request_bytes`` (413), counted while it
    is read, so a larger body is never held whatever ``Content-Length`` says.

    Pure ASGI (no ``BaseHTTPMiddleware``): after the body, ``receive`` is the server's own, so
    ``Request.is_disconnected()`` and streaming responses see a client disconnect and the
    request's sequences are aborted.
    """

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state
        # the key rule every atroposlib service shares (atroposlib.utils.http_guard)
        self.key_check = ApiKeyCheck(state.api_key, ("/health",)) if state.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self.key_check is not None and self.key_check.refusal(scope) is not None:
            error = APIError(401, "invalid or missing API key", code="invalid_api_key")
            await error.response()(scope, receive, send)
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            encoding = headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                error = APIError(
                    415,
                    f"Content-Encoding {encoding!r} is not accepted: send the body uncompressed",
                    param="content-encoding",
                )
                await error.response()(scope, receive, send)
                return
            body = await self._read_body(scope, receive, send, headers)
            if body is None:
                return
            receive = replay_body(body, receive)
        await self.app(scope, receive, send)

    async def _read_body(
        self, scope: Scope, receive: Receive, send: Send, headers: Headers
    ) -> bytes | None:
        """The whole body, or None once answered 413 (or the client left)."""
        limit = self.state.max_request_bytes
        too_large = APIError(
            413,
            f"request body too large: the limit is {limit} bytes (atropos-serve "
            "--max-request-bytes)",
            code="request_too_large",
        )
        try:
            if declared_too_large(scope, limit):
                raise BodyTooLarge
            return (await read_body(body_chunks(receive), limit)).data
        except BodyTooLarge:
            await too_large.response()(scope, receive, send)
        except ClientGone:
            pass
        return None


# ---------------------------------------------------------------------- helpers


async def _in_own_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` on a new thread that ends afterwards.

    Torch work off the engine's thread goes here rather than to ``asyncio.to_thread``: a
    thread that ran parallel torch ops keeps an OpenMP pool for as long as it lives, and the
    executor's threads live on, which would slow the engine's decoding (see
    :class:`GenerationEngine`).
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.cancelled():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def work() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:
            pass  # the event loop closed meanwhile: nobody is waiting

    threading.Thread(target=work, name="atropos-loader", daemon=True).start()
    return await future


def _as_context(lifespan: Callable[[FastAPI], AsyncIterator[None]]):
    from contextlib import asynccontextmanager

    return asynccontextmanager(lifespan)


def _check_model(state: ServerState, model: str) -> None:
    if model not in state.served_model_names:
        raise APIError(
            404,
            f"The model `{model}` does not exist. Served: {', '.join(state.served_model_names)}",
            code="model_not_found",
            param="model",
        )


def _check_features(body: ChatCompletionRequest | CompletionRequest) -> None:
    try:
        body.check_unsupported()
    except UnsupportedFieldError as exc:
        raise APIError(400, str(exc), param=exc.field) from exc


def _resolve_max_tokens(state: ServerState, prompt_len: int, requested: int | None) -> int:
    """vLLM's default: whatever context is left after the prompt."""
    room = state.engine.max_model_len - prompt_len
    if requested is None:
        if room < 1:
            raise APIError(
                400,
                f"This model's maximum context length is {state.engine.max_model_len} tokens, "
                f"and the prompt has {prompt_len}.",
                code="context_length_exceeded",
                param="messages",
            )
        return room
    return requested


def _render_chat(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    if not body.messages:
        raise APIError(400, "messages must not be empty", param="messages")
    messages = []
    for i, message in enumerate(body.messages):
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise APIError(
                        400, "only text content parts are supported", param=f"messages.{i}"
                    )
                parts.append(part.get("text", ""))
            content = "".join(parts)
        if "role" not in message:
            raise APIError(400, f"messages[{i}] has no role", param=f"messages.{i}.role")
        messages.append({**message, "content": content if content is not None else ""})
    try:
        text = state.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
            continue_final_message=body.continue_final_message,
            **(body.chat_template_kwargs or {}),
        )
    except Exception as exc:  # noqa: BLE001 - template errors come from the client's messages
        raise APIError(400, f"could not apply the chat template: {exc}", param="messages") from exc
    return _tokenize(state, text, False, "messages")


def _tokenize(state: ServerState, text: str, special: bool, param: str) -> list[int]:
    """Token ids of ``text``; a text too long to fit the context is refused untokenized
    (a 6 MB prompt took 3.5 s to tokenize)."""
    if len(text) > state.max_prompt_chars:
        raise APIError(
            400,
            f"This model's maximum context length is {state.engine.max_model_len} tokens; "
            f"the {param} has {len(text)} characters, more than that many tokens can hold "
            f"({state.max_prompt_chars}).",
            code="context_length_exceeded",
            param=param,
        )
    return state.tokenizer(text, add_special_tokens=special)["input_ids"]


def _completion_prompts(state: ServerState, body: CompletionRequest) -> list[list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError(400, "prompt must not be empty", param="prompt")
    encoded = []
    for p in prompts:
        if isinstance(p, str):
            encoded.append(_tokenize(state, p, body.add_special_tokens, "prompt"))
        else:
            encoded.append(list(p))
    return encoded


def _submit(
    state: ServerState, prompt_ids: list[int], params: SamplingParams, stream: bool
) -> RequestHandle:
    try:
        return state.engine.submit(prompt_ids, params, stream=stream)
    except QueueFullError as exc:
        raise APIError(429, str(exc), code="server_overloaded") from exc
    except EngineUnavailableError as exc:
        raise APIError(503, str(exc)) from exc
    except InvalidParamError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc
    except MemoryBudgetError as exc:
        raise APIError(400, str(exc), code=exc.code, param=exc.param) from exc
    except ValueError as exc:
        code = "context_length_exceeded" if "context length" in str(exc) else None
        raise APIError(400, str(exc), code=code) from exc


def _retrieve_exception(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        with contextlib.suppress(BaseException):
            task.exception()


async def _wait(request: Request, handles: list[RequestHandle]) -> list[list[SampleOutput]]:
    """Await the handles, aborting them if the client goes away before they finish."""
    task = asyncio.ensure_future(asyncio.gather(*(h.result() for h in handles)))
    # when the client leaves, the aborted handles end the gather with a CancelledError nobody
    # awaits any more: retrieve it here, or asyncio logs it as an error at garbage collection
    task.add_done_callback(_retrieve_exception)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=1.0)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise APIError(499, "client disconnected")
    except EngineUnavailableError as exc:
        raise APIError(503, str(exc)) from exc
    except EngineError as exc:
        raise APIError(500, str(exc)) from exc
    finally:
        if not task.done():
            task.cancel()
            for handle in handles:
                handle.abort()


def _usage(handles: list[RequestHandle]) -> dict[str, int]:
    prompt = sum(len(h.prompt_ids) for h in handles)
    completion = sum(len(o.token_ids) for h in handles for o in h.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _json(state: ServerState, body: dict[str, Any], *handles: RequestHandle) -> JSONResponse:
    """``body`` with the headers saying which weights answered: ``X-Weights-Version`` (the
    engine's count of weight swaps: a trainer checks a reload took effect) and
    ``X-Policy-Version`` (the trainer step of those weights: the version an env stamps on the
    samples, exact even when the request was aborted by a pause and re-run on new weights).
    With several prompts, the oldest weights any of them ran on."""
    versions = [h.weights_version for h in handles if h.weights_version is not None]
    weights = min(versions) if versions else None
    headers = {"X-Weights-Version": str(weights)}
    policy = state.policy_of(weights)
    if policy is not None:
        headers[POLICY_VERSION_HEADER] = str(policy)
    return JSONResponse(body, headers=headers)


def _token_text(state: ServerState, token_id: int) -> str:
    return _decoder(state.tokenizer)(token_id)


def _token_label(state: ServerState, token_id: int, as_ids: bool) -> str:
    """How a logprobs entry spells a token: its text, or ``token_id:N`` with vLLM's
    ``return_tokens_as_token_ids`` (a token whose text is not valid UTF-8 stays identifiable)."""
    return f"token_id:{token_id}" if as_ids else _token_text(state, token_id)


@lru_cache(maxsize=8)
def _decoder(tokenizer: Any) -> Callable[[int], str]:
    @lru_cache(maxsize=65536)
    def decode(token_id: int) -> str:
        return tokenizer.decode([token_id])

    return decode


def _chat_logprobs(
    state: ServerState,
    token_ids: list[int],
    logprobs: list[float],
    top: list[list[tuple[int, float]]],
    as_ids: bool = False,
) -> dict[str, Any]:
    content = []
    for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
        text = _token_text(state, token_id)
        alternatives = top[i] if i < len(top) else []
        content.append(
            {
                "token": _token_label(state, token_id, as_ids),
                "logprob": logprob,
                # vLLM: the sampled token's bytes are its text's, an alternative's are its label's
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": _token_label(state, tid, as_ids),
                        "logprob": value,
                        "bytes": list(_token_label(state, tid, as_ids).encode("utf-8")),
                    }
                    for tid, value in alternatives
                ],
            }
        )
    return {"content": content}


def _completion_logprobs(
    state: ServerState,
    out: SampleOutput | StreamEvent,
    k: int | None,
    offset: int = 0,
    *,
    as_ids: bool = False,
) -> dict[str, Any]:
    tokens, text_offset, top = [], [], []
    position = offset
    for i, token_id in enumerate(out.token_ids):
        label = _token_label(state, token_id, as_ids)
        tokens.append(label)
        text_offset.append(position)
        position += len(label)  # vLLM counts the label's length, token_id:N included
        entry = {label: out.logprobs[i]}
        if k and i < len(out.top_logprobs):
            for tid, value in out.top_logprobs[i]:
                entry.setdefault(_token_label(state, tid, as_ids), value)
        top.append(entry)
    return {
        "tokens": tokens,
        "token_logprobs": list(out.logprobs),
        "top_logprobs": top,
        "text_offset": text_offset,
    }


def _generate_logprobs(out: SampleOutput) -> list[list[dict[int, float]]]:
    per_token = []
    for i, (token_id, logprob) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        entry = {token_id: logprob}
        if i < len(out.top_logprobs):
            for tid, value in out.top_logprobs[i]:
                entry.setdefault(tid, value)
        per_token.append([entry])
    return per_token


def _sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n".encode()
        except EngineError as exc:
            status = 503 if isinstance(exc, EngineUnavailableError) else 500
            yield f"data: {json.dumps(APIError(status, str(exc)).body())}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


async def _merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, StreamEvent]]:
    """Events of several handles as they come, tagged with the handle's position."""
    if len(handles) == 1:
        async for event in handles[0].events():
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, StreamEvent | BaseException | None]] = asyncio.Queue()

    async def pump(position: int, handle: RequestHandle) -> None:
        try:
            async for event in handle.events():
                await queue.put((position, event))
            await queue.put((position, None))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((position, exc))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    remaining = len(handles)
    try:
        while remaining:
            position, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield position, item
    finally:
        for task in tasks:
            task.cancel()
        for handle in handles:
            if not handle.finished:
                handle.abort()


async def _chat_stream(
    state: ServerState, body: ChatCompletionRequest, handle: RequestHandle
) -> AsyncIterator[dict[str, Any]]:
    base = {
        "id": f"chatcmpl-{handle.id}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": body.model,
    }
    as_ids = bool(body.return_tokens_as_token_ids)
    for i in range(body.n):
        first = {
            **base,
            "choices": [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
        if body.return_token_ids:  # vLLM: with each choice's first chunk
            first["prompt_token_ids"] = list(handle.prompt_ids)
        yield first
    async for _, event in _merged([handle]):
        if (
            not event.text
            and event.finish_reason is None
            and not body.logprobs
            and not (body.return_token_ids and event.token_ids)
        ):
            continue
        choice = {
            "index": event.index,
            "delta": {"content": event.text} if event.text else {},
            "logprobs": _chat_logprobs(
                state, event.token_ids, event.logprobs, event.top_logprobs, as_ids
            )
            if body.logprobs
            else None,
            "finish_reason": event.finish_reason,
            "stop_reason": event.stop_reason,
        }
        if body.return_token_ids:
            choice["token_ids"] = list(event.token_ids)
        yield {**base, "choices": [choice]}
    if body.stream_options and body.stream_options.include_usage:
        yield {**base, "choices": [], "usage": _usage([handle])}


async def _completion_stream(
    state: ServerState, body: CompletionRequest, handles: list[RequestHandle]
) -> AsyncIterator[dict[str, Any]]:
    base = {
        "id": f"cmpl-{handles[0].id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model,
    }
    as_ids = bool(body.return_tokens_as_token_ids)
    offsets: dict[int, int] = {}
    sent_prompt: set[int] = set()
    async for position, event in _merged(handles):
        if (
            not event.text
            and event.finish_reason is None
            and body.logprobs is None
            and not (body.return_token_ids and event.token_ids)
        ):
            continue
        index = position * body.n + event.index
        logprobs = None
        if body.logprobs is not None:
            logprobs = _completion_logprobs(
                state, event, body.logprobs, offsets.get(index, 0), as_ids=as_ids
            )
            # as vLLM: advance by the tokens just reported (text held back for stop strings
            # lags them)
            if logprobs["tokens"]:
                offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        choice: dict[str, Any] = {
            "index": index,
            "text": event.text,
            "logprobs": logprobs,
            "finish_reason": event.finish_reason,
            "stop_reason": event.stop_reason,
        }
        if body.return_token_ids:  # vLLM: the prompt's ids with each choice's first chunk
            choice["prompt_token_ids"] = (
                list(handles[position].prompt_ids) if index not in sent_prompt else None
            )
            sent_prompt.add(index)
            choice["token_ids"] = list(event.token_ids)
        yield {**base, "choices": [choice]}
    if body.stream_options and body.stream_options.include_usage:
        yield {**base, "choices": [], "usage": _usage(handles)}
