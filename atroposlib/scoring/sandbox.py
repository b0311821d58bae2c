"""Run untrusted Python code with OS-level limits, and say why it stopped.

:func:`run_python` writes the program into a fresh temporary directory and runs it in a child
process that, before any untrusted code runs (see ``_sandbox_launcher.py``):

- **time**: ``RLIMIT_CPU`` plus a wall-clock deadline after which the whole process group (and,
  under root, every process of the sandbox uid) is SIGKILLed;
- **memory**: ``RLIMIT_AS``;
- **processes**: ``RLIMIT_NPROC``; the child leads its own session, killed as a whole at the end.
  Root ignores ``RLIMIT_NPROC``, so when we run as root the child drops to a fresh, unused uid
  (one per run), which makes the limit hold and lets cleanup kill every process of that uid;
- **files**: ``RLIMIT_FSIZE`` and ``RLIMIT_NOFILE``; the working directory is a throwaway temp
  dir (removed afterwards); as root the child gets a private mount namespace in which every
  mount except that directory is read-only; an audit hook also refuses writes outside it;
- **network**: a new, empty network namespace (no interfaces up) where the kernel allows it
  (root, or unprivileged user namespaces), and in every case an audit hook refusing
  ``connect``/``bind``/``sendto`` (the hook alone can be bypassed with ``ctypes``; the result's
  ``isolation`` says which layers applied);
- **environment**: a sanitized ``os.environ`` (PATH, HOME and TMPDIR point into the temp dir).

The result's :attr:`SandboxResult.status` says what happened: ``ok``, ``error`` (non-zero exit),
``timeout`` (wall clock), ``cpu_limit``, ``memory_limit``, ``process_limit``, ``file_limit``,
``output_limit`` or ``blocked`` (a refused network or filesystem access), with a one-line
``reason``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

__all__ = [
    "SandboxLimits",
    "SandboxResult",
    "arun_python",
    "default_interpreter",
    "run_python",
]

_LAUNCHER = Path(__file__).with_name("_sandbox_launcher.py")

Status = Literal[
    "ok",
    "error",
    "timeout",
    "cpu_limit",
    "memory_limit",
    "process_limit",
    "file_limit",
    "output_limit",
    "blocked",
]


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one sandboxed run (all enforced by the kernel except ``wall_time_s``
    and ``max_output_bytes``, which the parent enforces)."""

    wall_time_s: float = 10.0
    cpu_time_s: int = 10
    memory_bytes: int = 512 * 1024 * 1024
    max_processes: int = 16
    max_file_bytes: int = 16 * 1024 * 1024
    max_open_files: int = 64
    max_output_bytes: int = 1024 * 1024
    network: bool = False

    def __post_init__(self) -> None:
        for name in (
            "wall_time_s",
            "cpu_time_s",
            "memory_bytes",
            "max_processes",
            "max_file_bytes",
            "max_open_files",
            "max_output_bytes",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"SandboxLimits.{name} must be positive, got {getattr(self, name)}"
                )


@dataclass
class SandboxResult:
    """What a sandboxed program did."""

    status: Status
    returncode: int | None
    stdout: str
    stderr: str
    wall_time_s: float
    reason: str = ""
    isolation: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when the program exited with status 0 within every limit."""
        return self.status == "ok"


def _others_can_read(path: str) -> bool:
    """Whether a process of another, unprivileged uid can read ``path`` (every ancestor
    searchable by others, the file itself readable by others)."""
    import stat

    path = os.path.realpath(path)
    parts = Path(path).parents
    try:
        if not os.stat(path).st_mode & stat.S_IROTH:
            return False
        return all(os.stat(p).st_mode & stat.S_IXOTH for p in parts)
    except OSError:
        return False


def default_interpreter(drop_privileges: bool) -> str:
    """The Python that runs sandboxed code: this one, unless it must run under a dropped uid and
    its standard library is not readable by others (a pyenv under ``/root``); then the system
    ``python3``."""
    if not drop_privileges or _others_can_read(os.__file__):
        return sys.executable
    for candidate in ("/usr/local/bin/python3", "/usr/bin/python3"):
        if os.path.exists(candidate) and _others_can_read(candidate):
            return candidate
    return sys.executable


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` (root only): a forked helper becomes that uid and uses
    ``kill(-1)``, which reaches exactly the processes it may signal, i.e. that uid's."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.setgid(uid)
            os.setuid(uid)
            for _ in range(50):
                try:
                    os.kill(-1, signal.SIGKILL)
                except ProcessLookupError:
                    break
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _kill_all(proc: subprocess.Popen, uid: int | None) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid is not None:
        _kill_uid(uid)


def _classify(
    returncode: int | None, stderr: str, limits: SandboxLimits, timed_out: bool, cpu_s: float
) -> tuple[Status, str]:
    tail = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if timed_out:
        return (
            "timeout",
            f"wall-clock limit of {limits.wall_time_s:g}s reached; process group killed",
        )
    if returncode == -signal.SIGXCPU or (
        returncode == -signal.SIGKILL and cpu_s >= limits.cpu_time_s - 0.5
    ):
        return "cpu_limit", f"CPU-time limit of {limits.cpu_time_s}s reached"
    if returncode == -signal.SIGXFSZ or "File too large" in stderr:
        return "file_limit", f"file-size limit of {limits.max_file_bytes} bytes reached"
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return "memory_limit", f"memory limit of {limits.memory_bytes} bytes reached ({tail})"
    if "BlockingIOError" in stderr and ("fork" in stderr or "Resource temporarily" in stderr):
        return "process_limit", f"process limit of {limits.max_processes} reached ({tail})"
    if (
        "sandbox: " in stderr
        or "Read-only file system" in stderr
        or "Network is unreachable" in stderr
    ):
        return "blocked", tail
    if returncode == 0:
        return "ok", ""
    if returncode is not None and returncode < 0:
        return "error", f"killed by signal {signal.Signals(-returncode).name}"
    return "error", tail or f"exit status {returncode}"


def run_python(
    code: str,
    *,
    stdin: str | None = None,
    limits: SandboxLimits | None = None,
    files: dict[str, str] | None = None,
    args: list[str] | None = None,
    python: str | None = None,
) -> SandboxResult:
    """Run ``code`` as ``__main__`` in the sandbox and return what happened (never raises for
    anything the program does). ``files`` are extra files written into its work directory;
    ``python`` overrides the interpreter (default: :func:`default_interpreter`)."""
    limits = limits or SandboxLimits()
    workdir = tempfile.mkdtemp(prefix="atropos-sandbox-")
    workdir = os.path.realpath(workdir)
    uid = random.randrange(1 << 20, 1 << 30) if os.geteuid() == 0 else None
    nonce = secrets.token_hex(8)
    try:
        program = Path(workdir, "main.py")
        program.write_text(code)
        for name, content in (files or {}).items():
            target = Path(workdir, name).resolve()
            if not str(target).startswith(workdir + os.sep):
                raise ValueError(f"files: {name!r} is outside the work directory")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
        if uid is not None:
            for root, dirs, names in os.walk(workdir):
                for name in [*dirs, *names]:
                    os.chown(os.path.join(root, name), uid, uid)
            os.chown(workdir, uid, uid)
        config = {
            "workdir": workdir,
            "uid": uid,
            "nonce": nonce,
            "program": str(program),
            "args": list(args or []),
            "network": limits.network,
            "cpu_time_s": int(limits.cpu_time_s),
            "memory_bytes": int(limits.memory_bytes),
            "max_file_bytes": int(limits.max_file_bytes),
            "max_open_files": int(limits.max_open_files),
            "max_processes": int(limits.max_processes),
        }
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": workdir,
            "TMPDIR": workdir,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
        }

        start = time.monotonic()
        proc = subprocess.Popen(
            [
                python or default_interpreter(uid is not None),
                "-I",
                "-B",
                str(_LAUNCHER),
                json.dumps(config),
            ],
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env=env,
            start_new_session=True,
        )
        if stdin is not None:
            try:
                assert proc.stdin is not None
                proc.stdin.write(stdin.encode())
                proc.stdin.close()
            except BrokenPipeError:
                pass
        out, err, timed_out, overflow = _collect(proc, limits, start)
        try:
            _, status_word, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status_word)
            cpu_s = usage.ru_utime + usage.ru_stime
        except ChildProcessError:
            proc.wait()
            cpu_s = 0.0
        _kill_all(proc, uid)
        wall = time.monotonic() - start
        stdout = out.decode(errors="replace")
        stderr = err.decode(errors="replace")
        isolation: list[str] = []
        first, _, rest = stderr.partition("\n")
        if first.startswith(nonce):
            isolation = first[len(nonce) :].strip().split(",")
            stderr = rest
        if overflow:
            status: Status = "output_limit"
            reason = f"output over {limits.max_output_bytes} bytes; process group killed"
        else:
            status, reason = _classify(proc.returncode, stderr, limits, timed_out, cpu_s)
        return SandboxResult(status, proc.returncode, stdout, stderr, wall, reason, isolation)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _collect(
    proc: subprocess.Popen, limits: SandboxLimits, start: float
) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout/stderr up to the output cap until both close or the deadline passes; kill
    the group on timeout, overflow, or as soon as the main process has exited (leftover
    children could hold the pipes open forever)."""
    assert proc.stdout is not None and proc.stderr is not None
    buffers = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for stream in buffers:
        os.set_blocking(stream.fileno(), False)
        sel.register(stream, selectors.EVENT_READ)
    timed_out = overflow = False
    deadline = start + limits.wall_time_s
    main_exited_at: float | None = None
    while sel.get_map():
        now = time.monotonic()
        if now >= deadline:
            timed_out = True
            break
        if main_exited_at is None and proc.poll() is not None:
            main_exited_at = now
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        elif main_exited_at is not None and now - main_exited_at > 1.0:
            break
        for key, _ in sel.select(timeout=min(0.1, deadline - now)):
            chunk = os.read(key.fileobj.fileno(), 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            buffers[key.fileobj].extend(chunk)
            if sum(len(b) for b in buffers.values()) > limits.max_output_bytes:
                overflow = True
        if overflow:
            break
    sel.close()
    if timed_out or overflow:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for stream in buffers:
        stream.close()
    cap = limits.max_output_bytes
    return bytes(buffers[proc.stdout][:cap]), bytes(buffers[proc.stderr][:cap]), timed_out, overflow


async def arun_python(code: str, **kwargs) -> SandboxResult:
    """:func:`run_python` in a worker thread, for environments' event loops."""
    return await asyncio.to_thread(run_python, code, **kwargs)
