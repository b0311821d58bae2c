"""Routes environments call: ``/register-env``, ``/disconnect-env``, ``/status-env`` and the
two that take scored groups, ``/scored_data`` and ``/scored_data_list``.

:func:`ingest` is what both scored-data routes do, and what the ingest fast lane
(:class:`~atroposlib.api.middleware.IngestFastLane`) calls directly: every outcome is a
response, so both paths answer alike.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from atroposlib.api.dependencies import ApiState, Queue, State
from atroposlib.api.errors import Refused, UnknownEnv
from atroposlib.api.ingest import ParserGone, parse_json
from atroposlib.api.models import EnvIdentifier, RegisterEnv, ScoredData
from atroposlib.api.responses import bad_param, json_response, refusal_response

router = APIRouter(tags=["environments"])


@router.post("/register-env")
async def register_env(register_env: RegisterEnv, queue: Queue) -> dict[str, Any]:
    """Env registration; answers ``wait for trainer to start`` until the first ``/batch``."""
    if register_env.group_size <= 0:
        raise bad_param("group_size must be at least 1", "group_size")
    fraction = register_env.min_batch_allocation
    if fraction is not None and not 0.0 <= fraction <= 1.0:
        raise bad_param("min_batch_allocation must be between 0 and 1", "min_batch_allocation")
    return await run_in_threadpool(queue.register_env, register_env)


@router.post("/disconnect-env")
async def disconnect_env(body: EnvIdentifier, state: State, queue: Queue) -> Any:
    """Mark an env gone; its held parts are queued as they are, and pinned evaluations stop
    waiting for it. Unknown id: 404."""
    try:
        reply = await run_in_threadpool(queue.disconnect_env, body.env_id)
    except UnknownEnv as exc:
        return JSONResponse({"status": "failure", "error": str(exc)}, 404)
    state.evals.env_left(body.env_id)
    return reply


@router.api_route("/status-env", methods=["GET", "POST"])
async def status_env(request: Request, state: State, queue: Queue) -> Any:
    """Per-env queue view. ``env_id`` from ``?env_id=`` or a JSON body (GET or POST). Carries
    ``eval_request`` (not in upstream) while the env has a pinned evaluation to answer."""
    env_id: Any = request.query_params.get("env_id")
    dropped: Any = None
    if env_id is None:
        raw = await request.body()
        if not raw:
            raise bad_param("env_id is required (JSON body or ?env_id=)", "env_id", "missing")
        data = parse_json(raw)
        if not isinstance(data, dict) or "env_id" not in data:
            raise bad_param("env_id is required", "env_id", "missing")
        env_id = data["env_id"]
        dropped = data.get("dropped")
    try:
        env_id = EnvIdentifier.model_validate({"env_id": env_id}).env_id
    except ValidationError:
        raise bad_param("env_id must be an integer", "env_id", "int_parsing") from None
    drops = None if dropped is None else _drop_counts(dropped)
    try:
        reply = queue.status_env(env_id)
        if drops is not None:
            queue.report_env_drops(env_id, drops)
    except UnknownEnv as exc:  # the env addressed does not exist: 404, not a refusal
        where = "query" if "env_id" in request.query_params else "body"
        detail = [{"loc": [where, "env_id"], "msg": str(exc), "type": "unknown_env"}]
        return JSONResponse({"detail": detail}, 404)
    pending = state.evals.pending_for(env_id)
    if pending is not None:
        reply["eval_request"] = {
            "request_id": pending.request_id,
            "policy_version": pending.policy_version,
            "step": pending.step,
        }
    return reply


async def ingest(state: ApiState, raw: bytes, many: bool) -> Response:
    """Queue the scored group(s) in ``raw`` (the decompressed body of ``/scored_data``, or of
    ``/scored_data_list`` when ``many``); every outcome is a response."""
    queue = state.queue
    try:
        groups = await state.parser(raw, many)
    except ParserGone:
        refused = Refused(
            "parser_died",
            "the body parser process died (out of memory?) while parsing this request: "
            "retry later, or send smaller requests",
            retry_after=max(1, state.settings.retry_after_s),
        )
        queue.count_refused(refused.reason)
        return refusal_response(refused)
    except Refused as exc:
        queue.count_refused(exc.reason)  # the queue counts what it refuses itself
        return refusal_response(exc)
    try:
        if queue.store.durable:
            results = await run_in_threadpool(queue.add_groups, groups)
        else:
            results = queue.add_groups(groups)
    except Refused as exc:
        return refusal_response(exc)
    if not many:
        return json_response(results[0])
    reply: dict[str, Any] = {"status": "received", "groups_processed": len(results)}
    buffered = [r for r in results if r["status"] == "buffered"]
    if buffered:
        reply["buffered"] = len(buffered)
        reply["last_buffer_size"] = buffered[-1]["buffer_size"]
    return json_response(reply)


def _body_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI for a route that reads its body itself (so the docs still show it)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


@router.post("/scored_data", openapi_extra=_body_schema(ScoredData.model_json_schema()))
async def scored_data(request: Request, state: State) -> Response:
    """Queue one scored group (``ScoredData``)."""
    return await ingest(state, await request.body(), many=False)


@router.post(
    "/scored_data_list",
    openapi_extra=_body_schema({"type": "array", "items": ScoredData.model_json_schema()}),
)
async def scored_data_list(request: Request, state: State) -> Response:
    """Queue several scored groups at once (all or none)."""
    return await ingest(state, await request.body(), many=True)


def _drop_counts(value: Any) -> dict[str, int]:
    """``/status-env``'s optional ``dropped`` (not in upstream): the groups the env dropped
    before sending, ``{reason: count}`` (its running totals); 422 naming ``dropped``."""
    if (
        isinstance(value, dict)
        and len(value) <= 64
        and all(
            isinstance(k, str) and len(k) <= 64 and type(v) is int and 0 <= v < 2**63
            for k, v in value.items()
        )
    ):
        return dict(value)
    raise bad_param(
        "dropped must be an object of up to 64 reasons (names up to 64 characters) with "
        'non-negative integer counts, e.g. {"same_scores": 12}',
        "dropped",
        "value_error",
    )
