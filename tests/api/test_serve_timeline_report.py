"""``bench/serve_timeline.py``'s report: stretches between pauses, and stalls (unpaused, work
queued, no decode step and no prefill) told apart from idle time."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "serve_timeline.py"


def _load():
    spec = importlib.util.spec_from_file_location("serve_timeline", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sample(t: float, paused: bool, running: int, waiting: int, steps: int, requests: int):
    return {
        "t": 1000.0 + t,
        "paused": paused,
        "running": running,
        "waiting": waiting,
        "steps": steps,
        "requests": requests,
        "weights": 0,
    }


def test_stalls_are_reported_and_idle_time_is_not(capsys: pytest.CaptureFixture[str]) -> None:
    timeline = _load()
    samples = [_sample(0.0, True, 0, 0, 0, 0)]  # start-up pause
    # generating: steps advance
    samples += [_sample(0.1 * i, False, 32, 0, i, 2) for i in range(1, 6)]
    # a stall: 4 rows running, 8 requests waiting, nothing advances for 0.6 s
    samples += [_sample(0.6 + 0.1 * i, False, 4, 8, 6, 2) for i in range(7)]
    samples += [_sample(1.4, True, 0, 8, 7, 2)]  # the trainer pauses
    # idle after a resume: nothing to do for 0.5 s is not a stall
    samples += [_sample(1.5 + 0.1 * i, False, 0, 0, 7, 2) for i in range(6)]
    samples += [_sample(2.2, False, 16, 0, 8, 3), _sample(2.3, True, 0, 0, 8, 3)]
    timeline.report(samples, stall=0.25)
    out = capsys.readouterr().out
    assert "0.60 s with 4 rows running, 8 requests waiting" in out
    assert "total 0.6 s in 1 stalls" in out
    # the first stretch (up to the trainer's first pause) is start-up and not listed; the
    # second ran from 1.5 s to 2.2 s: one decode step, one request prefilled
    rows = [line for line in out.splitlines() if line.count("|") == 3 and "start s" not in line]
    assert [cell.split() for cell in rows[0].split("|")] == [["1.5"], ["0.70"], ["1"], ["1"]]
    assert len(rows) == 1
