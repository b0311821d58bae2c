"""The code sandbox: every hostile program is contained and reported, and the host is fine.

Every containment test runs twice when the suite runs as root: in this process (root: the
sandbox drops to a fresh uid) and through a driver process running as ``nobody``
(``setpriv --reuid=65534``), so both the privileged and the unprivileged code paths of
:mod:`atroposlib.scoring.sandbox` are covered by CI. As a non-root user the suite covers that
user only.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

import pytest

from atroposlib.scoring import sandbox as sandbox_module
from atroposlib.scoring.sandbox import (
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    default_interpreter,
    run_python,
)

FAST = SandboxLimits(wall_time_s=4, cpu_time_s=2, max_processes=8)
REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534
RUNNERS = ["self", "nobody"] if os.geteuid() == 0 else ["self"]

# Runs in the driver process as nobody: one run_python call from a JSON request on stdin, the
# result as JSON on stdout (SandboxUnavailable as {"unavailable": message}). With
# "no_userns", the driver first moves into a user namespace that may not create user
# namespaces, like a host where unprivileged user namespaces are disabled.
DRIVER = textwrap.dedent(
    """
    import ctypes, json, logging, os, sys
    from dataclasses import asdict
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    request = json.load(sys.stdin)
    if request.get("no_userns"):
        libc = ctypes.CDLL(None, use_errno=True)
        uid, gid = os.getuid(), os.getgid()
        assert libc.unshare(0x10000000) == 0, ctypes.get_errno()
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                           ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as fh:
                fh.write(text)
        with open("/proc/sys/user/max_user_namespaces", "w") as fh:
            fh.write("0")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from atroposlib.scoring.sandbox import SandboxLimits, SandboxUnavailable, run_python
    out = []
    for _ in range(request.get("repeat", 1)):
        try:
            result = run_python(request["code"], limits=SandboxLimits(**request["limits"]),
                                stdin=request["stdin"], files=request["files"],
                                args=request["args"])
            out.append(asdict(result))
        except SandboxUnavailable as exc:
            out.append({"unavailable": str(exc)})
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="session")
def nobody_package() -> Iterator[Path]:
    """A copy of the sandbox modules (standard library only) that ``nobody`` can read, wherever
    the checkout lives."""
    root = Path(tempfile.mkdtemp(prefix="atropos-sandbox-test-"))
    scoring = root / "atroposlib" / "scoring"
    scoring.mkdir(parents=True)
    shutil.copy(REPO / "atroposlib" / "__init__.py", root / "atroposlib")
    for name in ("__init__.py", "sandbox.py", "_sandbox_launcher.py"):
        shutil.copy(REPO / "atroposlib" / "scoring" / name, scoring)
    (root / "driver.py").write_text(DRIVER)
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _run_as_nobody(package: Path, code: str, **kwargs) -> list[dict]:
    """``run_python`` in a driver process, as ``nobody`` when we are root (else as ourselves)."""
    limits = kwargs.pop("limits", None) or SandboxLimits()
    request = {
        "code": code,
        "limits": asdict(limits),
        "stdin": kwargs.pop("stdin", None),
        "files": kwargs.pop("files", None),
        "args": kwargs.pop("args", None),
        "no_userns": kwargs.pop("no_userns", False),
        "repeat": kwargs.pop("repeat", 1),
    }
    assert not kwargs, kwargs
    python = default_interpreter(drop_privileges=True)
    as_nobody = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]
    proc = subprocess.run(
        [*(as_nobody if os.geteuid() == 0 else []), python, "-I", str(package / "driver.py")],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        cwd=package,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    runs = json.loads(proc.stdout)
    for run in runs:
        run["driver_stderr"] = proc.stderr
    return runs


RunPython = Callable[..., SandboxResult]


@pytest.fixture(params=RUNNERS)
def run(request: pytest.FixtureRequest) -> RunPython:
    """``run_python`` as this process's user, or (under root) as ``nobody``."""
    if request.param == "self":
        return run_python
    package = request.getfixturevalue("nobody_package")

    def as_nobody(code: str, **kwargs) -> SandboxResult:
        (result,) = _run_as_nobody(package, code, **kwargs)
        result.pop("driver_stderr")
        return SandboxResult(**result)

    return as_nobody


def _processes_with(marker: str) -> list[str]:
    """Command lines of host processes that mention ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if marker.encode() in cmdline:
                found.append(f"{entry}: {cmdline.decode(errors='replace')}")
    return found


def _gone(marker: str, within: float = 5.0) -> list[str]:
    """Host processes still mentioning ``marker`` after ``within`` seconds (killed processes
    take a moment to be reaped)."""
    deadline = time.monotonic() + within
    while (left := _processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_normal_program_runs_with_stdin_and_files(run: RunPython) -> None:
    result = run(
        "import sys; print(open('data.txt').read() + sys.stdin.read())",
        stdin="world",
        files={"data.txt": "hello "},
    )
    assert result.ok, result.stderr
    assert result.stdout.strip() == "hello world"
    assert "rlimits" in result.isolation
    assert {"pid-namespace", "private-root", "tmpfs-quota"} <= set(result.isolation)


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


def test_huge_allocation_hits_memory_limit(run: RunPython) -> None:
    result = run("x = bytearray(4 * 1024**3)\nprint('allocated')", limits=FAST)
    assert result.status == "memory_limit", result
    assert "allocated" not in result.stdout


def test_total_memory_of_many_processes_is_capped(run: RunPython) -> None:
    """Each child stays under the per-process limit; together they are over the total."""
    code = textwrap.dedent(
        """
        import os, time
        for _ in range(6):
            if os.fork() == 0:
                block = bytearray(100 * 1024 * 1024)
                for i in range(0, len(block), 4096):
                    block[i] = 1
                time.sleep(3)
                os._exit(0)
        for _ in range(6):
            os.wait()
        print("done")
        """
    )
    limits = SandboxLimits(wall_time_s=10, cpu_time_s=8, memory_bytes=256 * 1024 * 1024)
    result = run(code, limits=limits)
    assert result.status == "memory_limit", result
    assert "total" in result.reason


@pytest.mark.parametrize("ignore_errors", [False, True], ids=["raises", "ignores-errors"])
def test_fork_bomb_is_reported_as_process_limit(run: RunPython, ignore_errors: bool) -> None:
    marker = f"forkbomb-{secrets.token_hex(6)}"
    if ignore_errors:
        code = (
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
        )
    else:
        code = "import os\nwhile True:\n    os.fork()"
    limits = SandboxLimits(wall_time_s=3, cpu_time_s=2, max_processes=8)
    result = run(code, limits=limits, args=[marker])
    assert result.status == "process_limit", result
    assert _gone(marker) == []
    assert run_python("print(1)").ok  # the host can still start processes


# Bombs that are not Python's ``os.fork``: a shell's (bash retries refused forks with a
# back-off and would otherwise read as a timeout; dash says "Cannot fork" and exits 0) and a
# thread bomb (CPython says "can't start new thread", whether the task cap or the address space
# for the thread's stack ran out; with non-daemon threads the program then waits forever).
# Every one runs inside the sandbox's limits (8 tasks, 256 MiB, 2 s CPU, 3 s wall clock).
BOMBS = {
    "bash-classic": "import subprocess, sys\n"
    "subprocess.run(['bash', '-c', ':(){ :|:& };:', sys.argv[1]])",
    "bash-waits": "import subprocess, sys\n"
    "subprocess.run(['bash', '-c', ':(){ :|:& };:; wait', sys.argv[1]])",
    "sh-os-system": "import os, sys\nos.system('bomb(){ bomb|bomb& }; bomb; wait # ' + sys.argv[1])",
    "threads": "import threading, time\n"
    "while True:\n    threading.Thread(target=time.sleep, args=(60,)).start()",
    "daemon-threads": "import threading, time\n"
    "while True:\n    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()",
    "threads-ignore-errors": "import threading, time\n"
    "while True:\n    try:\n"
    "        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    "    except RuntimeError:\n        time.sleep(0.01)",
}


@pytest.mark.parametrize("bomb", list(BOMBS))
def test_shell_and_thread_bombs_are_reported_as_process_limit(run: RunPython, bomb: str) -> None:
    marker = f"bomb-{secrets.token_hex(6)}"
    limits = SandboxLimits(
        wall_time_s=3, cpu_time_s=2, max_processes=8, memory_bytes=256 * 1024 * 1024
    )
    result = run(BOMBS[bomb], limits=limits, args=[marker])
    assert result.status == "process_limit", result
    assert "process limit of 8" in result.reason, result.reason
    assert _gone(marker) == []
    assert run_python("print(1)").ok  # the host can still start processes


def test_detached_children_are_killed(run: RunPython) -> None:
    """``setsid`` daemons, from a shell and from Python, die with the run, as any user."""
    marker = str(900000 + secrets.randbelow(99999))
    code = textwrap.dedent(
        f"""
        import os, subprocess, time
        subprocess.run("setsid sleep {marker} > /dev/null 2>&1 &", shell=True)
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execvp("sleep", ["sleep", "{marker}"])
            os._exit(0)
        time.sleep(0.3)
        print("parent done")
        """
    )
    result = run(code, limits=FAST)
    assert result.ok and "parent done" in result.stdout, result
    assert result.wall_time_s < 3
    assert _gone(f"sleep {marker}") == []


def test_files_written_anywhere_stay_in_the_sandbox(run: RunPython) -> None:
    """A shell, Python and raw ``open(2)`` through ctypes may write to /tmp, /var/tmp and
    /dev/shm inside the sandbox; none of it reaches the host, and the rest is read-only."""
    name = f"atropos-escape-{secrets.token_hex(6)}"
    host_paths = [
        Path(d, name + suffix) for d in ("/tmp", "/dev/shm", "/var/tmp") for suffix in "abc"
    ]
    code = textwrap.dedent(
        f"""
        import ctypes, os, subprocess
        name = "{name}"
        for d in ("/tmp", "/dev/shm", "/var/tmp"):
            subprocess.run(f"echo x > {{d}}/{{name}}a", shell=True, check=True)
            open(f"{{d}}/{{name}}b", "w").write("x")
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.open(f"{{d}}/{{name}}c".encode(), 0o101, 0o644)
            assert fd >= 0, ctypes.get_errno()
            libc.close(fd)
            assert sorted(f for f in os.listdir(d) if f.startswith(name)) == [
                name + "a", name + "b", name + "c"]
        for target in ("/etc/{name}", "/usr/{name}", "/{name}"):
            rc = subprocess.run(f"echo x > {{target}}", shell=True, capture_output=True)
            assert rc.returncode != 0, target
            fd = ctypes.CDLL(None, use_errno=True).open(target.encode(), 0o101, 0o644)
            assert fd < 0, target
        print("wrote inside")
        """
    )
    try:
        result = run(code, limits=FAST)
        assert result.ok and "wrote inside" in result.stdout, result
        for path in [*host_paths, Path("/etc", name), Path("/usr", name), Path("/", name)]:
            assert not path.exists(), path
    finally:
        for path in host_paths:
            path.unlink(missing_ok=True)


def test_disk_writes_beyond_the_quota_fail(run: RunPython) -> None:
    """/tmp, /dev/shm and the work directory share one quota; files under the per-file limit
    fill it."""
    code = textwrap.dedent(
        """
        import subprocess
        open("work.bin", "wb").write(b"x" * 3 * 1024 * 1024)
        subprocess.run("dd if=/dev/zero of=/dev/shm/a bs=1M count=3 status=none", shell=True, check=True)
        for i in range(4):
            open(f"/tmp/f{i}", "wb").write(b"x" * 3 * 1024 * 1024)
            print("wrote", i, flush=True)
        """
    )
    limits = SandboxLimits(max_disk_bytes=10 * 1024 * 1024, max_file_bytes=4 * 1024 * 1024)
    result = run(code, limits=limits)
    assert result.status == "file_limit", result
    assert "disk quota" in result.reason
    assert "wrote 0" in result.stdout and "wrote 2" not in result.stdout


def test_big_file_hits_file_size_limit() -> None:
    limits = SandboxLimits(max_file_bytes=1024 * 1024)
    result = run_python("open('big', 'wb').write(b'x' * 10 * 1024 * 1024)", limits=limits)
    assert result.status == "file_limit", result


def test_flooding_output_is_cut() -> None:
    result = run_python("while True:\n    print('x' * 1000)", limits=FAST)
    assert result.status == "output_limit"
    assert len(result.stdout) <= FAST.max_output_bytes


def test_sockets_cannot_reach_the_host(run: RunPython) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    try:
        result = run(
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "print('connected')",
            limits=FAST,
        )
        assert result.status == "blocked", result
        assert "connected" not in result.stdout
        # raw connect(2) through ctypes meets the same empty network namespace
        raw = (
            "import socket, ctypes, struct\n"
            "s = socket.socket()\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            f"addr = struct.pack('=H', 2) + struct.pack('!H4s8x', {port}, bytes([127, 0, 0, 1]))\n"
            "print('rc', libc.connect(s.fileno(), addr, 16))\n"
        )
        result = run(raw, limits=FAST)
        assert "net-namespace" in result.isolation
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


def test_cannot_signal_or_see_host_processes(run: RunPython) -> None:
    code = textwrap.dedent(
        f"""
        import os, signal
        print(sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
        os.kill({os.getpid()}, signal.SIGTERM)
        """
    )
    result = run(code)
    assert result.status == "error"
    assert "ProcessLookupError" in result.reason or "PermissionError" in result.reason
    assert max(json.loads(result.stdout.splitlines()[0])) < 10  # only the sandbox's own
    # and we are still alive to assert it


def test_no_privileges_inside(run: RunPython) -> None:
    """No capabilities, no new user namespaces, no mounts: the limits cannot be lifted."""
    code = textwrap.dedent(
        """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        print("unshare", libc.unshare(0x10000000))
        print("mount", libc.mount(b"none", b"/tmp", b"tmpfs", 0, None))
        print([l for l in open("/proc/self/status") if l.startswith("CapEff")][0].split()[1])
        """
    )
    result = run(code)
    assert result.ok, result
    assert result.stdout.split() == ["unshare", "-1", "mount", "-1", "0000000000000000"]


def test_bad_limits_name_the_field() -> None:
    with pytest.raises(ValueError, match="SandboxLimits.memory_bytes"):
        SandboxLimits(memory_bytes=0)
    with pytest.raises(ValueError, match="SandboxLimits.max_disk_bytes"):
        SandboxLimits(max_disk_bytes=0)


def test_without_user_namespaces_it_refuses_unless_weak_is_allowed(
    nobody_package: Path,
) -> None:
    """Where the kernel refuses user namespaces, run_python raises with the reason and the way
    out; explicitly allowed, it runs with weak containment, says so in ``isolation`` and logs
    one warning per process."""
    (refused,) = _run_as_nobody(nobody_package, "print(1)", no_userns=True)
    assert "unavailable" in refused
    assert "ATROPOS_SANDBOX_ALLOW_WEAK=1" in refused["unavailable"]
    assert "allow_weak_isolation=True" in refused["unavailable"]
    runs = _run_as_nobody(
        nobody_package,
        "print(1)",
        limits=SandboxLimits(allow_weak_isolation=True),
        no_userns=True,
        repeat=2,
    )
    for weak in runs:
        assert weak["status"] == "ok" and weak["stdout"] == "1\n", weak
        assert weak["isolation"][0] == "weak"
    assert runs[0]["driver_stderr"].count("WEAK containment") == 1


def test_unavailability_is_detected_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once strong containment failed in a process, later runs do not retry it."""
    monkeypatch.setattr(sandbox_module, "_strong_unavailable", "test: no namespaces")
    with pytest.raises(SandboxUnavailable, match="test: no namespaces"):
        run_python("print(1)")
    monkeypatch.setenv("ATROPOS_SANDBOX_ALLOW_WEAK", "1")
    result = run_python("print(1)")
    assert result.ok and result.isolation[0] == "weak"
