"""Owned child processes: started in their own session, stopped with everything they spawn.

``ChildProcess`` is one subprocess this process owns, with its log in a file, readiness by
polling an HTTP URL, and a clear error with the log's tail if it dies or never becomes ready.
Every child still running is stopped at interpreter exit, and **also when this process dies
without exiting** (``SIGKILL``, the OOM killer): a small *reaper* process, started with the first
child, reads a pipe that only this process writes; when the pipe closes it SIGTERMs the process
group of every child still registered (``watch_process_group``), and SIGKILLs what is left after
5 s. That works whichever thread started the child (``PR_SET_PDEATHSIG`` fires when the *thread*
that forked exits, and reaches only the direct child, not its session).

Used by ``atropos-launch`` (local backend), ``atropos-quickstart`` and the trainer's inference
management (``example_trainer.inference_process`` re-exports these names).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

logger = logging.getLogger(__name__)


class ProcessLaunchError(RuntimeError):
    """A child process failed to start or to become ready (the message has its log's tail)."""


_LIVE: weakref.WeakSet[ChildProcess] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def stop_all_children() -> None:
    """Stop every ``ChildProcess`` of this interpreter that is still running."""
    with _LIVE_LOCK:
        children = list(_LIVE)
    for child in reversed(children):
        child.stop()


atexit.register(stop_all_children)


# Runs in the reaper (standard library only): read "+PGID"/"-PGID" lines until EOF, i.e. until
# the process that owns the pipe's other end is gone, then take its children down.
_REAPER = r"""
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
groups = set()
for line in sys.stdin:
    line = line.strip()
    if line[:1] == "+":
        groups.add(int(line[1:]))
    elif line[:1] == "-":
        groups.discard(int(line[1:]))
def alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False
for pgid in groups:
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
deadline = time.monotonic() + 5.0
while time.monotonic() < deadline and any(alive(g) for g in groups):
    time.sleep(0.1)
for pgid in groups:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
"""


class _Reaper:
    """The process that stops our children's process groups if we die without cleaning up."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None

    def _send(self, line: str) -> None:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                if line.startswith("-"):
                    return
                self._proc = subprocess.Popen(
                    [sys.executable, "-I", "-c", _REAPER],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,  # a Ctrl-C or a group kill must not reach it
                )
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.write(line.encode() + b"\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError):
                logger.warning("the reaper process is gone; children may outlive a crash")


_REAPER_PROCESS = _Reaper()


def watch_process_group(pgid: int) -> None:
    """Have process group ``pgid`` stopped if this process dies without stopping it."""
    _REAPER_PROCESS._send(f"+{pgid}")


def unwatch_process_group(pgid: int) -> None:
    """Forget ``pgid`` (it was stopped, or is about to be)."""
    _REAPER_PROCESS._send(f"-{pgid}")


class ChildProcess:
    """A subprocess this process owns: started in its own session, stopped with its children.

    Args:
        name: short name for messages (``vllm``, ``run-api`` ...).
        command: argv of the process.
        log_path: file that receives its stdout and stderr (appended).
        env: extra environment variables.
        cwd: working directory.
        secrets: strings never written to the log (shown as ``***`` in the command line).
    """

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        log_path: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        secrets: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.secrets = [s for s in secrets if s]
        self.command = [str(part) for part in command]
        self.log_path = Path(log_path)
        self.env = dict(env or {})
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ChildProcess:
        """Launch the process (does not wait for readiness)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            shown = ["***" if part in self.secrets else part for part in self.command]
            log.write(f"\n$ {' '.join(shown)}\n".encode())
            log.flush()
            try:
                self.proc = subprocess.Popen(
                    self.command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
                    cwd=self.cwd,
                    start_new_session=True,
                )
            except OSError as exc:
                raise ProcessLaunchError(
                    f"{self.name}: cannot run {self.command[0]!r}: {exc}"
                ) from exc
        with _LIVE_LOCK:
            _LIVE.add(self)
        watch_process_group(self.proc.pid)
        logger.info("started %s (pid %d), log: %s", self.name, self.proc.pid, self.log_path)
        return self

    @property
    def running(self) -> bool:
        """Whether the process was started and has not exited."""
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the process's log file."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def wait_ready(self, url: str, timeout: float, *, interval: float = 0.5) -> float:
        """Poll ``url`` until it answers 200; returns the seconds waited.

        Raises ``ProcessLaunchError`` (with the log's tail) if the process exits first or the
        URL is not ready within ``timeout`` seconds.
        """
        started = time.monotonic()
        deadline = started + timeout
        while True:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise ProcessLaunchError(
                    f"{self.name} exited with status {code} before {url} was ready. "
                    f"Log ({self.log_path}):\n{self.log_tail()}"
                )
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ProcessLaunchError(
                    f"{self.name} did not answer {url} within {timeout:.0f} s. "
                    f"Log ({self.log_path}):\n{self.log_tail()}"
                )
            time.sleep(interval)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``timeout`` s; returns the exit status."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("%s ignored SIGTERM for %.0f s; killing it", self.name, timeout)
                self._signal(signal.SIGKILL)
                proc.wait(10)
        # Whatever it spawned in its session goes too (e.g. vLLM's engine workers).
        self._signal(signal.SIGKILL)
        unwatch_process_group(proc.pid)
        with _LIVE_LOCK:
            _LIVE.discard(self)
        return proc.returncode

    def _signal(self, sig: int) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> ChildProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
