"""The code sandbox: every hostile program is contained and reported, and the host is fine."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from atroposlib.scoring.sandbox import SandboxLimits, run_python

FAST = SandboxLimits(wall_time_s=4, cpu_time_s=2, max_processes=8)


def _uids() -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                found.add(os.stat(f"/proc/{entry}").st_uid)
            except OSError:
                pass
    return found


def _no_processes_of(uids_before: set[int], within: float = 5.0) -> bool:
    """Soon no process runs under a uid that did not exist before (the sandbox's uid); killed
    processes take a moment to be reaped by init."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if _uids() <= uids_before:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture()
def host_uids() -> set[int]:
    return _uids()


def test_normal_program_runs_with_stdin_and_files() -> None:
    result = run_python(
        "import sys; print(open('data.txt').read() + sys.stdin.read())",
        stdin="world",
        files={"data.txt": "hello "},
    )
    assert result.ok, result.stderr
    assert result.stdout.strip() == "hello world"
    assert "rlimits" in result.isolation


def test_environment_is_sanitized_and_cwd_is_a_throwaway_dir() -> None:
    os.environ["ATROPOS_SECRET_FOR_TEST"] = "s3cret"
    try:
        result = run_python("import os; print(sorted(os.environ)); print(os.getcwd())")
    finally:
        del os.environ["ATROPOS_SECRET_FOR_TEST"]
    assert result.ok
    assert "ATROPOS_SECRET_FOR_TEST" not in result.stdout
    cwd = result.stdout.strip().splitlines()[-1]
    assert "atropos-sandbox-" in cwd
    assert not Path(cwd).exists()  # removed afterwards


def test_error_exit_is_reported() -> None:
    result = run_python("raise ValueError('bad input')")
    assert result.status == "error"
    assert "ValueError: bad input" in result.reason


def test_infinite_loop_hits_cpu_limit() -> None:
    start = time.monotonic()
    result = run_python("while True:\n    pass", limits=FAST)
    assert result.status == "cpu_limit", result
    assert time.monotonic() - start < 4.5


def test_sleeping_program_hits_wall_clock() -> None:
    result = run_python(
        "import time\ntime.sleep(60)", limits=SandboxLimits(wall_time_s=1.5, cpu_time_s=5)
    )
    assert result.status == "timeout"
    assert result.wall_time_s < 3


def test_huge_allocation_hits_memory_limit() -> None:
    result = run_python("x = bytearray(4 * 1024**3)\nprint('allocated')", limits=FAST)
    assert result.status == "memory_limit", result
    assert "allocated" not in result.stdout


def test_fork_bomb_is_contained(host_uids: set[int]) -> None:
    start = time.monotonic()
    result = run_python("import os\nwhile True:\n    os.fork()", limits=FAST)
    assert result.status in ("process_limit", "timeout"), result
    assert time.monotonic() - start < 8
    assert _no_processes_of(host_uids)


def test_fork_bomb_that_ignores_errors_is_killed_at_the_deadline(host_uids: set[int]) -> None:
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = run_python(code, limits=SandboxLimits(wall_time_s=2, cpu_time_s=2, max_processes=8))
    assert result.status in ("timeout", "cpu_limit"), result
    assert _no_processes_of(host_uids)
    # the host can still start processes
    assert run_python("print(1)").ok


def test_detached_grandchild_is_killed(host_uids: set[int], tmp_path: Path) -> None:
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    time.sleep(30)\n"
        "print('parent done')\n"
    )
    result = run_python(code, limits=FAST)
    assert result.ok and "parent done" in result.stdout
    assert result.wall_time_s < 3
    if os.geteuid() == 0:
        assert _no_processes_of(host_uids)


@pytest.mark.parametrize(
    "code",
    [
        "open('{target}', 'w').write('pwned')",
        # past the Python-level hook, straight to the kernel
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "fd = libc.open(b'{target}', 0o101, 0o644)\nassert fd < 0, 'file created'\nprint('refused')",
    ],
    ids=["python-open", "ctypes-open"],
)
def test_writing_outside_the_work_dir_is_refused(code: str, tmp_path: Path) -> None:
    target = tmp_path / "outside.txt"
    tmp_path.chmod(0o777)
    result = run_python(code.format(target=target), limits=FAST)
    assert not target.exists()
    assert result.status in ("blocked", "ok"), result
    if result.status == "ok":
        assert "refused" in result.stdout


def test_big_file_hits_file_size_limit() -> None:
    limits = SandboxLimits(max_file_bytes=1024 * 1024)
    result = run_python("open('big', 'wb').write(b'x' * 10 * 1024 * 1024)", limits=limits)
    assert result.status == "file_limit", result


def test_flooding_output_is_cut() -> None:
    result = run_python("while True:\n    print('x' * 1000)", limits=FAST)
    assert result.status == "output_limit"
    assert len(result.stdout) <= FAST.max_output_bytes


def test_sockets_cannot_reach_the_host() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    try:
        result = run_python(
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "print('connected')",
            limits=FAST,
        )
        assert result.status == "blocked", result
        assert "connected" not in result.stdout
        # past the audit hook: raw connect(2) through ctypes meets an empty network namespace
        raw = (
            "import socket, ctypes, struct\n"
            "s = socket.socket()\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            f"addr = struct.pack('=H', 2) + struct.pack('!H4s8x', {port}, bytes([127, 0, 0, 1]))\n"
            "print('rc', libc.connect(s.fileno(), addr, 16))\n"
        )
        result = run_python(raw, limits=FAST)
        if "net-namespace" in result.isolation:
            assert "rc -1" in result.stdout, result
        listener.settimeout(0.2)
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()


def test_network_can_be_allowed_explicitly() -> None:
    result = run_python(
        "import socket\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\nprint('bound')",
        limits=SandboxLimits(network=True),
    )
    assert result.ok and "bound" in result.stdout


def test_cannot_signal_host_processes() -> None:
    result = run_python(f"import os, signal\nos.kill({os.getpid()}, signal.SIGTERM)")
    if os.geteuid() == 0:
        assert result.status == "error" and "PermissionError" in result.reason
    # and we are still alive to assert it


def test_bad_limits_name_the_field() -> None:
    with pytest.raises(ValueError, match="SandboxLimits.memory_bytes"):
        SandboxLimits(memory_bytes=0)
