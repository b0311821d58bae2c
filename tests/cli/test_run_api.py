"""The ``run-api`` command line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from atroposlib.api.settings import ApiSettings, parse_size
from atroposlib.cli.run_api import parse_settings


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "atroposlib.cli.run_api", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_help_lists_every_setting() -> None:
    result = run("--help")
    assert result.returncode == 0
    for name in ApiSettings.model_fields:
        assert "--" + name.replace("_", "-") in result.stdout
    assert "ATROPOS_MAX_QUEUE_BYTES" in result.stdout


def test_bad_flag_value_names_the_flag() -> None:
    result = run("--max-queue-bytes", "lots")
    assert result.returncode == 2
    assert "--max-queue-bytes" in result.stderr and "not a size" in result.stderr
    result = run("--port", "99999")
    assert result.returncode == 2 and "--port" in result.stderr


def test_unknown_flag_is_an_error() -> None:
    result = run("--max-queue-byte", "1G")
    assert result.returncode == 2 and "unrecognized arguments" in result.stderr


def test_defaults_bind_loopback_and_env_vars_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ApiSettings().host == "127.0.0.1"
    monkeypatch.setenv("ATROPOS_MAX_QUEUE_BYTES", "2G")
    monkeypatch.setenv("ATROPOS_STORE", "/tmp/x.sqlite3")
    settings = ApiSettings.from_env(store="/tmp/y.sqlite3")
    assert settings.max_queue_bytes == 2 << 30
    assert settings.store == "/tmp/y.sqlite3"  # flags win over the environment
    settings, dev = parse_settings(["--host", "0.0.0.0", "--max-request-bytes", "64M"])
    assert settings.host == "0.0.0.0" and settings.max_request_bytes == 64 << 20
    assert settings.max_queue_bytes == 2 << 30 and settings.store == "/tmp/x.sqlite3"
    assert dev.reload is False


def test_parse_size() -> None:
    assert parse_size("512M") == 512 << 20
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("1.5k") == 1536
    assert parse_size(1000) == 1000
    with pytest.raises(ValueError):
        parse_size("1X")


def test_flag_spellings_and_booleans() -> None:
    """Kebab-case is canonical, snake_case is accepted; booleans take --x, --no-x, --x BOOL."""
    environ: dict[str, str] = {}
    settings, _ = parse_settings(["--max_queue_bytes", "1G", "--cors-credentials"], environ)
    assert settings.max_queue_bytes == 1 << 30 and settings.cors_credentials is True
    for argv, expected in [
        (["--cors-credentials", "false"], False),
        (["--cors-credentials=yes"], True),
        (["--no-cors-credentials"], False),
        (["--cors_credentials", "true"], True),
    ]:
        assert parse_settings(argv, environ)[0].cors_credentials is expected, argv
    assert parse_settings(["--store-sync", "full"], environ)[0].store_sync == "FULL"
    assert parse_settings(["--reload", "false"], environ)[1].reload is False


def test_bad_environment_value_names_the_variable() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "atroposlib.cli.run_api"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "ATROPOS_PORT": "high"},
    )
    assert result.returncode == 2
    assert "ATROPOS_PORT in the environment: Input should be a valid integer" in result.stderr
