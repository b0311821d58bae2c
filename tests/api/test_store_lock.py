"""Two run-api processes on one ``--store`` both served the same groups. Now the second one
stops at start with an error naming the store and the first one's pid; the lock goes with the
process that held it (also on ``kill -9``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from tests.api.helpers import group, registration
from tests.conftest import REPO


def _second(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "atroposlib.cli.run_api", "--port", "0", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_second_run_api_on_a_store_is_refused(start_api, tmp_path: Path) -> None:
    store = tmp_path / "run.sqlite3"
    first = start_api("--store", str(store))
    with httpx.Client(base_url=first.url, timeout=30) as api:
        assert api.post("/register", json=registration(2)).status_code == 200
        api.post("/scored_data", json=group(2, tag=1))
    assert first.proc is not None
    for args in (("--store", str(store)), ("--replay", str(store))):
        done = _second(*args)
        assert done.returncode == 1, done
        assert "in use by another process" in done.stderr, done.stderr
        assert f"pid {first.proc.pid}" in done.stderr, done.stderr
    # the first one still serves, alone
    with httpx.Client(base_url=first.url, timeout=30) as api:
        assert api.get("/batch").json()["batch"][0]["tokens"][0][0] == 1

    first.kill9()  # no clean shutdown: the lock still goes with the process
    again = start_api("--store", str(store))
    with httpx.Client(base_url=again.url, timeout=30) as api:
        assert api.get("/status").json()["current_step"] == 1
