"""Run untrusted Python code with OS-level containment and limits, and say why it stopped.

:func:`run_python` writes the program into a fresh temporary directory and runs it in a child
process that isolates itself before any untrusted code runs (``_sandbox_launcher.py``).

Strong containment (the default; the same as root and as an unprivileged user)
-------------------------------------------------------------------------------
Needs Linux namespaces: as root they are always there; as any other user the kernel must allow
unprivileged user namespaces (``unshare -Ur true`` works). The program then runs:

- in **its own PID namespace**, whose PID 1 is the sandbox's init: when the program's main
  process exits, the run times out, or the parent kills it, the init exits and the kernel kills
  every process left in the namespace, ``setsid``/double-forked daemons included;
- on **a private root filesystem**: a tmpfs holding read-only binds of ``/usr``, ``/etc``, the
  library directories, ``/opt`` and the interpreter's prefixes, five device nodes (``null``,
  ``zero``, ``full``, ``random``, ``urandom``), a fresh ``/proc`` of its own PID namespace, and
  **one tmpfs of ``max_disk_bytes``** mounted at ``/tmp``, ``/var/tmp`` and ``/dev/shm``. The
  host's ``/tmp``, ``/dev/shm``, ``/home``, ``/root``, ``/run``, the project and everything else
  are not there; nothing the program writes (from Python, a shell or raw syscalls) reaches the
  host, and all its writes together are capped. Its work directory is ``/tmp/<name>`` (``HOME``
  and ``TMPDIR`` point there);
- with **no network** (an empty network namespace) unless ``network=True``, its own IPC and UTS
  namespaces, **no capabilities**, ``no_new_privs``, and new user namespaces forbidden;
- as root additionally under a fresh, unused uid (one per run), so it owns nothing on the host;
- **processes**: ``RLIMIT_NPROC`` inside its own user namespace, so the count is the sandbox's
  own (threads count), plus a ``pids`` cgroup where one is writable (root, cgroup v1 or v2);
  hitting the cap is reported as ``process_limit`` even when the program ignores the errors;
- **memory**: ``RLIMIT_AS`` per process, and a **total** of ``memory_bytes`` for the whole sandbox
  (its processes plus its tmpfs): a ``memory`` cgroup (``memory.max`` /
  ``memory.limit_in_bytes``, swap included) where one is writable, which is the case under root
  on cgroup v1 and on cgroup v2 with the controller delegated; otherwise the init polls every
  process's resident anonymous and shared memory, System V shared memory and the tmpfs every
  50 ms and kills the whole sandbox when the sum is over. The polled cap can be overshot for up
  to one polling interval (a few hundred MB at most, bounded by ``RLIMIT_AS`` per process), and
  kernel memory (page tables, socket buffers, pipes) is not counted: use a cgroup for a hard cap;
- **time**: ``RLIMIT_CPU`` per process and a wall-clock deadline; **files**: ``RLIMIT_FSIZE``
  (per file) and ``RLIMIT_NOFILE``; **environment**: a sanitized ``os.environ``.

What it does not do: no seccomp filter (the whole syscall surface of the kernel is reachable, as
in an unprivileged container: a kernel exploit escapes it), the read-only binds are readable
(``/etc/passwd``, the Python installation), and CPU time is limited per process, not in total.

Weak containment (only on request)
----------------------------------
Where the namespaces cannot be created (unprivileged user namespaces disabled, a seccomp profile
refusing ``unshare``, an AppArmor user-namespace restriction), :func:`run_python` **refuses** with
:class:`SandboxUnavailable` explaining why, unless weaker containment is allowed explicitly with
``SandboxLimits(allow_weak_isolation=True)`` or the environment variable
``ATROPOS_SANDBOX_ALLOW_WEAK=1``; then it logs one warning per process and runs with rlimits,
a uid drop and read-only mounts under root, an empty network namespace where possible, and a
Python audit hook refusing network access and writes outside the work directory. Under a
non-root user that mode does **not** contain files (shell and ``ctypes`` bypass the hook),
``setsid`` children can survive, ``RLIMIT_NPROC`` counts every process of the user host-wide,
and memory is per process. The result's ``isolation`` lists the layers that applied (``weak`` is
the first one in that mode).

The result's :attr:`SandboxResult.status` says what happened: ``ok``, ``error`` (non-zero exit),
``timeout`` (wall clock), ``cpu_limit``, ``memory_limit`` (a process or the total),
``process_limit`` (a new process or thread was refused: the cap of ``max_processes``, or for a
thread no address space left for its stack; fork and thread bombs, from Python or a shell, end
here, not in ``timeout`` or ``error``), ``file_limit`` (file size or the disk quota), ``output_limit`` or ``blocked`` (a refused network or
filesystem access), with a one-line ``reason``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
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
    "SandboxUnavailable",
    "arun_python",
    "default_interpreter",
    "run_python",
]

_LAUNCHER = Path(__file__).with_name("_sandbox_launcher.py")
_UNAVAILABLE_EXIT = 97
ALLOW_WEAK_ENV = "ATROPOS_SANDBOX_ALLOW_WEAK"
logger = logging.getLogger(__name__)

# Why strong containment failed in this process (probed by the first run), or None.
_strong_unavailable: str | None = None
_warned_weak = False


class SandboxUnavailable(RuntimeError):
    """Strong containment cannot be set up on this host and weaker containment was not allowed."""


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
    and ``max_output_bytes``, which the parent enforces, and the total of ``memory_bytes`` where
    no memory cgroup is available, which the sandbox's init enforces by polling).

    ``memory_bytes`` caps each process's address space and the whole sandbox's memory (tmpfs
    included); ``max_disk_bytes`` caps everything written (``/tmp``, ``/var/tmp``, ``/dev/shm``
    and the work directory share it); ``max_processes`` counts the program's processes and
    threads. ``allow_weak_isolation`` lets :func:`run_python` fall back to weak containment
    (module docstring) instead of raising :class:`SandboxUnavailable`."""

    wall_time_s: float = 10.0
    cpu_time_s: int = 10
    memory_bytes: int = 512 * 1024 * 1024
    max_processes: int = 16
    max_file_bytes: int = 16 * 1024 * 1024
    max_open_files: int = 64
    max_output_bytes: int = 1024 * 1024
    network: bool = False
    max_disk_bytes: int = 64 * 1024 * 1024
    allow_weak_isolation: bool = False

    def __post_init__(self) -> None:
        for name in (
            "wall_time_s",
            "cpu_time_s",
            "memory_bytes",
            "max_processes",
            "max_file_bytes",
            "max_open_files",
            "max_output_bytes",
            "max_disk_bytes",
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


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_counter(path: Path, key: str) -> int:
    """``key N`` from a cgroup ``*.events`` / ``memory.oom_control`` file; 0 if absent."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


class _Cgroups:
    """The run's own memory and pids cgroups (root only; cgroup v2, or v1 controllers), made
    under the cgroups this process is in. Absent pieces are simply not used."""

    def __init__(self, limits: SandboxLimits, name: str) -> None:
        self.dirs: list[Path] = []
        self.memory: Path | None = None
        self.pids: Path | None = None
        self.v2 = False
        own: dict[str, str] = {}
        try:
            for line in Path("/proc/self/cgroup").read_text().splitlines():
                _, controllers, path = line.split(":", 2)
                for controller in controllers.split(",") if controllers else [""]:
                    own[controller] = path
        except (OSError, ValueError):
            return
        base = Path("/sys/fs/cgroup")
        if (base / "cgroup.controllers").exists() and "" in own:  # pure cgroup v2
            self._v2(base / own[""].lstrip("/"), limits, name)
            return
        for controller in ("memory", "pids"):
            parent = base / controller / own.get(controller, "/").lstrip("/")
            if controller in own and parent.is_dir():
                self._v1(controller, parent, limits, name)

    def _v2(self, parent: Path, limits: SandboxLimits, name: str) -> None:
        group = parent / name
        try:
            group.mkdir()
        except OSError:
            return
        self.dirs.append(group)
        self.v2 = True
        if not (group / "memory.max").exists() or not (group / "pids.max").exists():
            try:
                (parent / "cgroup.subtree_control").write_text("+memory +pids")
            except OSError:
                pass
        try:
            if (group / "memory.max").exists():
                (group / "memory.max").write_text(str(limits.memory_bytes))
                if (group / "memory.swap.max").exists():
                    (group / "memory.swap.max").write_text("0")
                self.memory = group
            if (group / "pids.max").exists():
                (group / "pids.max").write_text(str(limits.max_processes + 1))
                self.pids = group
        except OSError:
            self.memory = self.pids = None

    def _v1(self, controller: str, parent: Path, limits: SandboxLimits, name: str) -> None:
        group = parent / name
        try:
            group.mkdir()
        except OSError:
            return
        self.dirs.append(group)
        try:
            if controller == "memory":
                (group / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
                if (group / "memory.memsw.limit_in_bytes").exists():
                    (group / "memory.memsw.limit_in_bytes").write_text(str(limits.memory_bytes))
                self.memory = group
            else:
                (group / "pids.max").write_text(str(limits.max_processes + 1))
                self.pids = group
        except OSError:
            pass

    @property
    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files the sandbox's init joins."""
        return [str(d / "cgroup.procs") for d in self.dirs if d in (self.memory, self.pids)]

    def oom_kills(self) -> int:
        """Processes the kernel killed for the memory limit."""
        if self.memory is None:
            return 0
        name = "memory.events" if self.v2 else "memory.oom_control"
        return _read_counter(self.memory / name, "oom_kill")

    def pids_refused(self) -> int:
        """Forks refused by ``pids.max``."""
        return _read_counter(self.pids / "pids.events", "max") if self.pids else 0

    def remove(self) -> None:
        """Kill whatever is left in the groups and remove them."""
        for group in self.dirs:
            if self.v2 and (group / "cgroup.kill").exists():
                try:
                    (group / "cgroup.kill").write_text("1")
                except OSError:
                    pass
            deadline = time.monotonic() + 2.0
            while True:
                try:
                    for pid in (group / "cgroup.procs").read_text().split():
                        try:
                            os.kill(int(pid), signal.SIGKILL)
                        except (ProcessLookupError, ValueError):
                            pass
                    group.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        logger.warning("sandbox: could not remove cgroup %s", group)
                        break
                    time.sleep(0.02)


# What programs print when the kernel refuses them a new process or thread: Python's os.fork
# (BlockingIOError), bash ("fork: retry: Resource temporarily unavailable", then "fork:
# Resource temporarily unavailable"), dash ("Cannot fork"), CPython's threading ("can't start
# new thread") and glibc's pthread_create via other runtimes ("Resource temporarily unavailable"
# next to "thread").
_TASK_REFUSED = (
    "fork: retry: Resource temporarily unavailable",
    "fork: Resource temporarily unavailable",
    "Cannot fork",
    "can't start new thread",
)


def _tasks_refused(stderr: str) -> bool:
    if any(marker in stderr for marker in _TASK_REFUSED):
        return True
    return "BlockingIOError" in stderr and ("fork" in stderr or "Resource temporarily" in stderr)


def _classify(
    returncode: int | None,
    stderr: str,
    limits: SandboxLimits,
    timed_out: bool,
    cpu_s: float,
    report: dict,
) -> tuple[Status, str]:
    tail = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if report.get("memory_exceeded"):
        return (
            "memory_limit",
            f"the sandbox's total memory went over {limits.memory_bytes} bytes; all killed",
        )
    if report.get("oom_kills"):
        return (
            "memory_limit",
            f"total memory limit of {limits.memory_bytes} bytes reached: "
            f"{report['oom_kills']} process(es) killed",
        )
    if returncode == -signal.SIGXCPU or (
        not timed_out and returncode == -signal.SIGKILL and cpu_s >= limits.cpu_time_s - 0.5
    ):
        return "cpu_limit", f"CPU-time limit of {limits.cpu_time_s}s reached"
    limit_hit = report.get("process_limit_hit") or report.get("pids_refused")
    if (limit_hit and returncode != 0) or _tasks_refused(stderr):
        # Before the timeout: a bomb whose shell retries refused forks (bash) or whose main
        # thread waits for its threads runs into the wall clock, but the cap is why.
        return "process_limit", f"process limit of {limits.max_processes} reached ({tail})"
    if timed_out:
        return (
            "timeout",
            f"wall-clock limit of {limits.wall_time_s:g}s reached; every process killed",
        )
    if returncode == -signal.SIGXFSZ or "File too large" in stderr:
        return "file_limit", f"file-size limit of {limits.max_file_bytes} bytes reached"
    if "No space left on device" in stderr:
        return "file_limit", f"disk quota of {limits.max_disk_bytes} bytes reached ({tail})"
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return "memory_limit", f"memory limit of {limits.memory_bytes} bytes reached ({tail})"
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


def _weak_allowed(limits: SandboxLimits) -> bool:
    return limits.allow_weak_isolation or os.environ.get(ALLOW_WEAK_ENV, "") not in ("", "0")


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
    ``python`` overrides the interpreter (default: :func:`default_interpreter`).

    Raises :class:`SandboxUnavailable` when strong containment cannot be set up here and weak
    containment is not allowed (see the module docstring)."""
    global _strong_unavailable, _warned_weak
    limits = limits or SandboxLimits()
    if _strong_unavailable is None:
        result = _run(code, stdin, limits, files, args, python, "strong")
        if isinstance(result, SandboxResult):
            return result
        _strong_unavailable = result
    if not _weak_allowed(limits):
        raise SandboxUnavailable(
            f"the code sandbox cannot contain programs on this host ({_strong_unavailable}). "
            "Run as root, or allow unprivileged user namespaces (sysctl "
            "kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0; on Ubuntu "
            "kernel.apparmor_restrict_unprivileged_userns=0), or accept weaker containment with "
            f"SandboxLimits(allow_weak_isolation=True) or {ALLOW_WEAK_ENV}=1"
        )
    if not _warned_weak:
        _warned_weak = True
        logger.warning(
            "code sandbox: strong containment unavailable (%s); running with WEAK containment "
            "(rlimits and an audit hook; files, detached processes and total memory are not "
            "contained without root), as allowed by %s",
            _strong_unavailable,
            "allow_weak_isolation" if limits.allow_weak_isolation else ALLOW_WEAK_ENV,
        )
    result = _run(code, stdin, limits, files, args, python, "weak")
    assert isinstance(result, SandboxResult)
    return result


def _run(
    code: str,
    stdin: str | None,
    limits: SandboxLimits,
    files: dict[str, str] | None,
    args: list[str] | None,
    python: str | None,
    mode: str,
) -> SandboxResult | str:
    """One run in ``mode``; a string (why) when strong containment could not be set up."""
    workdir = tempfile.mkdtemp(prefix="atropos-sandbox-")
    workdir = os.path.realpath(workdir)
    uid = random.randrange(1 << 20, 1 << 30) if os.geteuid() == 0 else None
    cgroups = (
        _Cgroups(limits, os.path.basename(workdir))
        if uid is not None and mode == "strong"
        else None
    )
    status_r, status_w = os.pipe()
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
            "mode": mode,
            "workdir": workdir,
            "uid": uid,
            "status_fd": status_w,
            "program": "main.py",
            "args": list(args or []),
            "network": limits.network,
            "cpu_time_s": int(limits.cpu_time_s),
            "memory_bytes": int(limits.memory_bytes),
            "max_disk_bytes": int(limits.max_disk_bytes),
            "max_file_bytes": int(limits.max_file_bytes),
            "max_open_files": int(limits.max_open_files),
            "max_processes": int(limits.max_processes),
            "cgroup_procs": cgroups.procs_files if cgroups else [],
            "memory_cgroup": bool(cgroups and cgroups.memory),
        }
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": workdir,
            "TMPDIR": workdir,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
            # glibc gives each new thread a malloc arena of 64 MiB of address space: with
            # RLIMIT_AS that, not max_processes, would stop a thread bomb (or a thread pool)
            # after a handful of threads. Two arenas: a thread costs its stack.
            "MALLOC_ARENA_MAX": "2",
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
            pass_fds=(status_w,),
        )
        os.close(status_w)
        status_w = -1
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
        _killpg(proc.pid)
        if mode == "weak" and uid is not None:
            _kill_uid(uid)
        wall = time.monotonic() - start
        report: dict = {}
        with os.fdopen(status_r, "rb") as fh:
            status_r = -1
            os.set_blocking(fh.fileno(), False)
            for line in (fh.read() or b"").splitlines():
                try:
                    report.update(json.loads(line))
                except ValueError:
                    pass
        if "unavailable" in report:
            return str(report["unavailable"])
        returncode = report.get("returncode", proc.returncode)
        if returncode == _UNAVAILABLE_EXIT and "isolation" not in report and mode == "strong":
            return f"the sandbox launcher exited before isolating ({err.decode(errors='replace').strip()[-300:]})"
        cpu_s = max(cpu_s, float(report.get("cpu_s", 0.0)))
        if cgroups is not None:
            report["oom_kills"] = cgroups.oom_kills()
            report["pids_refused"] = cgroups.pids_refused()
        stdout = out.decode(errors="replace")
        stderr = err.decode(errors="replace")
        if overflow:
            status: Status = "output_limit"
            reason = f"output over {limits.max_output_bytes} bytes; every process killed"
        else:
            status, reason = _classify(returncode, stderr, limits, timed_out, cpu_s, report)
        isolation = list(report.get("isolation", []))
        return SandboxResult(status, returncode, stdout, stderr, wall, reason, isolation)
    finally:
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        if cgroups is not None:
            cgroups.remove()
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
            _killpg(proc.pid)
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
        _killpg(proc.pid)
    for stream in buffers:
        stream.close()
    cap = limits.max_output_bytes
    return bytes(buffers[proc.stdout][:cap]), bytes(buffers[proc.stderr][:cap]), timed_out, overflow


async def arun_python(code: str, **kwargs) -> SandboxResult:
    """:func:`run_python` in a worker thread, for environments' event loops."""
    return await asyncio.to_thread(run_python, code, **kwargs)
