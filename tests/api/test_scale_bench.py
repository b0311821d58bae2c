"""``bench/api_scale.py`` at CI size: real env processes (``bench/scale_env.py``) post through a
real ``run-api`` with the stand-in inference server and a trainer draining ``/batch``; the
table it prints has sane numbers for each N and nothing was refused or dropped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "api_scale.py"


def _table(output: str) -> dict[int, dict[str, str]]:
    lines = [line for line in output.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[1:]:
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        rows[int(cells["envs"])] = cells
    return rows


@pytest.mark.nightly  # ~20 s; the per-commit CI budget is spent
def test_scale_bench_with_one_and_two_envs(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    command = [
        sys.executable,
        str(BENCH),
        "--workers",
        "1,2",
        "--seconds",
        "3",
        "--warmup",
        "1",
        "--seq-len",
        "256",
        "--json",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    table = _table(done.stdout)
    assert sorted(table) == [1, 2], done.stdout
    for row in table.values():
        assert float(row["groups/s"]) > 0 and float(row["batches/s"]) > 0, row
        assert float(row["POST p50 ms"]) > 0, row
        assert float(row["POST p99 ms"]) >= float(row["POST p50 ms"]), row
        assert float(row["API cores"]) > 0 and float(row["API RSS MiB"]) > 0, row
        assert float(row["env cores"]) > 0, row
        assert row["refused"] == row["dropped"] == row["env drops"] == "0", row
    report = json.loads(out.read_text())
    assert report["setup"]["group_size"] == 8 and report["setup"]["seq_len"] == 256
    for row in report["rows"]:
        # every POST the envs made in the window was answered 200, and posts carried groups
        assert set(row["post_statuses"]) == {"200"}, row
        assert row["posts_per_s"] > 0 and row["groups_per_post"] >= 1, row
        assert row["sequences_per_s"] == pytest.approx(row["groups_per_s"] * 8), row
