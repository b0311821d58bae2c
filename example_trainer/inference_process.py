"""Process management and weight sync for the inference server the trainer feeds.

Kept out of the training loop on purpose. Three pieces:

- ``ChildProcess``: one owned subprocess in its own session (so stopping it also stops whatever
  it spawned, e.g. vLLM's workers), with its log in a file, readiness by polling an HTTP URL,
  and a clear error with the log's tail if it dies or never becomes ready. Every child still
  running is stopped at interpreter exit, and **also when this process dies without exiting**
  (``SIGKILL``, the OOM killer): a small *reaper* process, started with the first child, reads
  a pipe that only this process writes; when the pipe closes it SIGTERMs the process group of
  every child still registered (``watch_process_group``), and SIGKILLs what is left after 5 s.
  That works whichever thread started the child (``PR_SET_PDEATHSIG`` fires when the *thread*
  that forked exits, and reaches only the direct child, not its session).
- Weight sync strategies, all with ``start()``, ``sync(checkpoint) -> seconds`` and ``close()``:
  ``VLLMRestart`` (upstream: stop vLLM, relaunch it on the new checkpoint under the same served
  model name, wait for ``/health``), ``AtroposServeReload`` (``POST /reload_weights`` on a
  running ``atropos-serve``; no restart) and ``NoSync``.
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


class InferenceLaunchError(RuntimeError):
    """An inference server (or other child) failed to start or to become ready."""


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
    """

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        log_path: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        self.name = name
        self.command = [str(part) for part in command]
        self.log_path = Path(log_path)
        self.env = dict(env or {})
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ChildProcess:
        """Launch the process (does not wait for readiness)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n$ {' '.join(self.command)}\n".encode())
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
                raise InferenceLaunchError(
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

        Raises ``InferenceLaunchError`` (with the log's tail) if the process exits first or the
        URL is not ready within ``timeout`` seconds.
        """
        started = time.monotonic()
        deadline = started + timeout
        while True:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise InferenceLaunchError(
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
                raise InferenceLaunchError(
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


# ------------------------------------------------------------------------------ weight sync


class WeightSync:
    """How the inference server gets the trainer's new weights."""

    description = "none"
    outlives_trainer = True
    """Whether the server keeps running after the trainer exits (worth a final sync)."""

    def start(self, model: str) -> None:
        """Bring the inference side up serving ``model`` (a folder or model id)."""

    def sync(self, checkpoint: Path) -> float:
        """Make the inference server serve ``checkpoint``; returns the seconds it took."""
        return 0.0

    def close(self) -> None:
        """Stop whatever ``start`` launched."""

    def pause(self, mode: str = "abort") -> None:
        """Stop the server generating while the trainer computes (where it can)."""

    def resume(self) -> None:
        """Let the server generate again after :meth:`pause`."""

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NoSync(WeightSync):
    """Checkpoints only; the inference server (if any) is not touched."""


def vllm_command(
    model: str,
    *,
    served_model_name: str,
    host: str = "127.0.0.1",
    port: int = 9001,
    python: str = sys.executable,
    gpu_memory_utilization: float = 0.45,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The argv that launches vLLM's OpenAI server on ``model`` (upstream's flags)."""
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        served_model_name,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        "auto",
        "--gpu-memory-utilization",
        str(gpu_memory_utilization),
        *extra_args,
    ]


class VLLMRestart(WeightSync):
    """Upstream's weight sync: stop the vLLM server, relaunch it on the new checkpoint.

    Args:
        build_command: ``model -> argv``; normally ``vllm_command`` with the config's flags. The
            served model name must stay the same across launches so environments keep working.
        url: the server's base URL (``/health`` is polled there).
        log_path: vLLM's log file (appended across restarts).
        startup_timeout: seconds to wait for ``/health`` after each launch.
        env: extra environment variables for vLLM.
    """

    description = "vLLM restart"
    outlives_trainer = False

    def __init__(
        self,
        build_command,
        url: str,
        log_path: str | os.PathLike[str],
        *,
        startup_timeout: float = 600.0,
        served_model_name: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.build_command = build_command
        self.url = url.rstrip("/")
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.served_model_name = served_model_name
        self.env = dict(env or {})
        self.process: ChildProcess | None = None
        self.launches = 0

    def start(self, model: str) -> None:
        """Launch vLLM on ``model`` and wait until it is healthy (and serves the right name)."""
        self.process = ChildProcess("vllm", self.build_command(model), self.log_path, self.env)
        self.process.start()
        self.launches += 1
        waited = self.process.wait_ready(self.url + "/health", self.startup_timeout)
        self._check_name()
        logger.info("vLLM ready on %s after %.1f s (launch %d)", model, waited, self.launches)

    def _check_name(self) -> None:
        if self.served_model_name is None:
            return
        try:
            models = httpx.get(self.url + "/v1/models", timeout=10).json()
            names = [entry.get("id") for entry in models.get("data", [])]
        except (httpx.HTTPError, ValueError) as exc:
            raise InferenceLaunchError(f"vLLM /v1/models did not answer: {exc}") from exc
        if self.served_model_name not in names:
            self.close()
            raise InferenceLaunchError(
                f"vLLM serves {names}, not {self.served_model_name!r}; environments would fail"
            )

    def stop(self) -> None:
        """Stop the running vLLM (its GPU memory is free once this returns)."""
        if self.process is not None:
            self.process.stop()
            self.process = None

    def sync(self, checkpoint: Path) -> float:
        """Stop vLLM, relaunch it on ``checkpoint``, wait for ``/health``; seconds taken."""
        started = time.monotonic()
        self.stop()
        self.start(str(checkpoint))
        return time.monotonic() - started

    def close(self) -> None:
        self.stop()


class AtroposServeReload(WeightSync):
    """Hot reload on a running ``atropos-serve``: ``POST {url}/reload_weights {"path": ...}``.

    The reply comes once the new weights are live; requests in flight finish on the old ones.
    """

    description = "atropos-serve reload"

    def __init__(self, url: str, *, timeout: float = 300.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.last_reply: dict | None = None

    def start(self, model: str) -> None:
        """Check the server is up (it is started by the user or the quick start, not here)."""
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise InferenceLaunchError(
                    f"atropos-serve at {self.url} is not healthy; start it first "
                    "(atropos-serve --model ... --port ...)"
                )
            time.sleep(0.5)

    def sync(self, checkpoint: Path) -> float:
        started = time.monotonic()
        try:
            response = httpx.post(
                self.url + "/reload_weights",
                json={"path": str(Path(checkpoint).resolve())},
                timeout=self.timeout,
            )
        except httpx.TransportError as exc:
            raise InferenceLaunchError(f"atropos-serve at {self.url} unreachable: {exc}") from exc
        if response.status_code != 200:
            raise InferenceLaunchError(
                f"atropos-serve refused the reload of {checkpoint}: "
                f"HTTP {response.status_code} {response.text[:500]}"
            )
        self.last_reply = response.json()
        return time.monotonic() - started

    def pause(self, mode: str = "abort") -> None:
        """``POST /pause?mode=MODE``: nothing generates until :meth:`resume`."""
        self._post("/pause", params={"mode": mode})

    def resume(self) -> None:
        """``POST /resume``."""
        self._post("/resume")

    def _post(self, path: str, params: dict[str, str] | None = None) -> None:
        try:
            response = httpx.post(self.url + path, params=params, timeout=self.timeout)
        except httpx.TransportError as exc:
            raise InferenceLaunchError(f"atropos-serve at {self.url} unreachable: {exc}") from exc
        if response.status_code != 200:
            raise InferenceLaunchError(
                f"atropos-serve refused {path}: HTTP {response.status_code} {response.text[:300]}"
            )
