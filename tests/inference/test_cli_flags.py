"""``atropos-serve``'s flags: a port it cannot listen on, or a host that is not this machine's,
is a usage error naming the flag, reported before the model loads (seconds to minutes)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest


def _serve(*argv: str) -> subprocess.CompletedProcess[str]:
    # A model folder that does not exist: had the command tried to load it, it would say so
    # ("cannot load model") instead of naming the address flag.
    return subprocess.run(
        [sys.executable, "-m", "atroposlib.inference.cli", "--model", "/no/such/model", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_port_in_use_is_named_before_the_model_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _serve("--port", str(port))
    assert result.returncode == 2, result.stderr
    assert f"atropos-serve: error: --port: cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "cannot load model" not in result.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "-5"], "--port '-5': Input should be greater than or equal to 1"),
        (["--port", "70000"], "--port '70000': Input should be less than or equal to 65535"),
        # TEST-NET-2: an address no machine has as its own
        (["--host", "198.51.100.7"], "--host: cannot listen on 198.51.100.7:8000"),
    ],
)
def test_bad_addresses_name_their_flag(argv: list[str], message: str) -> None:
    result = _serve(*argv)
    assert result.returncode == 2, result.stderr
    assert f"atropos-serve: error: {message}" in result.stderr
    assert "cannot load model" not in result.stderr
