"""``bench/api_bench.py`` at toy sizes against a real ``run-api``: the load generator keeps
working (closed and open loop) and every posted group is accounted for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "api_bench.py"


def _row(output: str) -> list[str]:
    rows = [line for line in output.splitlines() if line.startswith("| http://")]
    assert len(rows) == 1, output
    return [cell.strip() for cell in rows[0].strip("|").split("|")]


@pytest.mark.parametrize("rate", [None, 20.0])
def test_api_bench_runs_against_run_api(start_api, rate: float | None) -> None:
    server = start_api()
    command = [
        sys.executable,
        str(BENCH),
        "--url",
        server.url,
        "--producers",
        "2",
        "--duration",
        "2",
        "--group-size",
        "4",
        "--seq-len",
        "64",
        "--batch-size",
        "8",
    ]
    if rate is not None:
        command += ["--rate", str(rate)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    cells = _row(done.stdout)
    offered, accepted, batches = cells[2], float(cells[3]), float(cells[4])
    errors = int(cells[10])
    assert offered == ("closed" if rate is None else f"{rate:g}")
    assert accepted > 0 and batches > 0
    assert errors == 0
    if rate is not None:
        # an open loop offers what it was told to, and this server takes all of it
        assert accepted == pytest.approx(rate, rel=0.3)
