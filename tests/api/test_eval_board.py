"""``atroposlib.api.evals.EvalBoard``: evaluation requests pinned to a policy version, without
HTTP (the routes and the envs' side are tested in tests/envs/test_pinned_eval.py)."""

from __future__ import annotations

import pytest

from atroposlib.api.evals import EvalBoard, EvalBoardError, EvalReport


def _report(env_id: int, version: int, status: str = "done", **metrics: float) -> EvalReport:
    return EvalReport(env_id, "", status, version, metrics=metrics)  # type: ignore[arg-type]


def test_a_request_completes_once_every_expected_env_answered() -> None:
    board = EvalBoard()
    req = board.request(3, 3, {0: "gsm8k", 1: "math"})
    assert board.pending_for(0) is req and board.pending_for(1) is req
    assert board.pending_for(2) is None  # not asked
    board.report(req.request_id, _report(0, 3, **{"eval/acc": 0.5}))
    assert not board.results(req.request_id).complete
    assert board.pending_for(0) is None and board.pending_for(1) is req
    board.report(req.request_id, _report(1, 3, "refused"))
    wire = board.results(req.request_id).wire()
    assert wire["complete"] and wire["policy_version"] == 3 and wire["step"] == 3
    assert [(r["env_name"], r["status"]) for r in wire["reports"]] == [
        ("gsm8k", "done"),
        ("math", "refused"),
    ]
    assert [r.env_id for r in board.latest()] == [0]  # only "done" reports feed /metrics


def test_results_are_never_recorded_under_another_version() -> None:
    board = EvalBoard()
    req = board.request(4, None, {0: "env"})
    with pytest.raises(EvalBoardError) as info:
        board.report(req.request_id, _report(0, 5))
    assert info.value.field == "policy_version" and info.value.status_code == 409
    assert "is for policy version 4, not 5" in str(info.value)
    assert not board.results(req.request_id).reports


@pytest.mark.parametrize(
    ("request_id", "env_id", "field", "code"),
    [(99, 0, "request_id", 404), (1, 7, "env_id", 409)],
)
def test_unknown_request_or_env_is_refused(request_id, env_id, field, code) -> None:
    board = EvalBoard()
    board.request(0, 0, {0: "env"})
    with pytest.raises(EvalBoardError) as info:
        board.report(request_id, _report(env_id, 0))
    assert (info.value.field, info.value.status_code) == (field, code)


def test_second_answer_and_non_finite_metrics_are_refused() -> None:
    board = EvalBoard()
    req = board.request(0, 0, {0: "env", 1: "other"})
    board.report(req.request_id, _report(0, 0, acc=1.0))
    with pytest.raises(EvalBoardError, match="already answered"):
        board.report(req.request_id, _report(0, 0, acc=1.0))
    with pytest.raises(EvalBoardError) as info:
        board.report(req.request_id, _report(1, 0, acc=float("nan")))
    assert info.value.field == "metrics.acc"


def test_a_disconnected_env_stops_the_wait_and_no_env_means_complete_at_once() -> None:
    board = EvalBoard()
    req = board.request(1, 1, {0: "a", 1: "b"})
    board.report(req.request_id, _report(0, 1, acc=0.1))
    board.env_left(1)
    wire = board.results(req.request_id).wire()
    assert wire["complete"] and wire["disconnected"] == [1]
    assert board.request(2, 2, {}).complete  # nobody takes requests: answered at once


def test_requests_are_answered_oldest_first_and_reset_forgets_them() -> None:
    board = EvalBoard()
    first = board.request(1, 1, {0: "a"})
    second = board.request(2, 2, {0: "a"})
    assert board.pending_for(0) is first
    board.report(first.request_id, _report(0, 1))
    assert board.pending_for(0) is second
    board.reset()
    assert board.pending_for(0) is None
    with pytest.raises(EvalBoardError):
        board.results(second.request_id)
