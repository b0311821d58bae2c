"""Routes of evaluations pinned to a policy version (not in upstream; see
:mod:`atroposlib.api.evals` and ``docs/compat.md``).

* ``POST /eval-request`` (trainer): evaluate the weights of ``policy_version``; the envs expected
  to answer are the connected ones that registered with ``eval_requests``.
* ``GET /eval-results?request_id=`` (trainer): the answers so far, ``complete`` once every
  expected env answered or left.
* ``POST /eval-result`` (env): one env's answer. Each env finds its pending request in its
  ``/status-env`` reply (``eval_request``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from atroposlib.api.dependencies import Queue, State
from atroposlib.api.evals import EvalBoardError, EvalReport
from atroposlib.api.models import EvalRequestBody, EvalResultBody
from atroposlib.api.responses import bad_param

router = APIRouter(tags=["evaluations"])


def _refused(exc: EvalBoardError, where: str = "body") -> JSONResponse:
    detail = [{"loc": [where, *exc.field.split(".")], "msg": str(exc), "type": "eval_refused"}]
    return JSONResponse({"detail": detail}, exc.status_code)


@router.post("/eval-request")
async def eval_request(body: EvalRequestBody, state: State, queue: Queue) -> Any:
    """Ask every connected env that takes pinned evaluations to evaluate ``policy_version``."""
    try:
        req = state.evals.request(body.policy_version, body.step, queue.evaluators())
    except EvalBoardError as exc:
        return _refused(exc)
    return req.wire()


@router.get("/eval-results")
async def eval_results(state: State, request_id: int | None = None) -> Any:
    """The answers to request ``request_id`` so far."""
    if request_id is None:
        raise bad_param("request_id is required (?request_id=)", "request_id", "missing")
    try:
        return state.evals.results(request_id).wire()
    except EvalBoardError as exc:
        return _refused(exc, "query")


@router.post("/eval-result")
async def eval_result(body: EvalResultBody, state: State) -> Any:
    """An env's answer: recorded only for the version the request named."""
    report = EvalReport(
        env_id=body.env_id,
        env_name="",
        status=body.status,
        policy_version=body.policy_version,
        metrics=dict(body.metrics),
        reason=body.reason,
        seconds=body.seconds,
    )
    try:
        req = state.evals.report(body.request_id, report)
    except EvalBoardError as exc:
        return _refused(exc)
    return {"status": "received", "complete": req.complete}
