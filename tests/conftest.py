"""Shared fixtures: real servers started as subprocesses on free loopback ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def private_mounts() -> list[str]:
    """Command prefix that runs a command in a mount namespace of its own (``unshare``), where
    it may mount a small tmpfs to fill up: as root the mount namespace alone, otherwise in a
    user namespace mapped to root."""
    if os.geteuid() == 0:
        return ["unshare", "--mount"]
    return ["unshare", "--user", "--map-root-user", "--mount"]


class ApiProcess:
    """``python -m atroposlib.cli.run_api`` as a child process on a free loopback port."""

    def __init__(
        self, *args: str, log_path: Path, port: int | None = None, python: str = sys.executable
    ) -> None:
        self.python = python
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> ApiProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for key in list(env):
            if key.startswith("ATROPOS_"):
                del env[key]
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                self.python,
                "-m",
                "atroposlib.cli.run_api",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--log-level",
                "warning",
                *self.args,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"run-api exited early:\n{self.log_path.read_text()}")
            try:
                # 401: up, and started with --api-key
                if httpx.get(self.url + "/info", timeout=1.0).status_code in (200, 401):
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(
            f"run-api did not answer /info in {timeout}s:\n{self.log_path.read_text()}"
        )

    def kill9(self) -> None:
        """Crash the server the hard way (no shutdown handlers run)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self._log.close()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="session")
def api_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiProcess]:
    """One in-memory ``run-api`` for the session; tests reset it before use."""
    server = ApiProcess(log_path=tmp_path_factory.mktemp("api") / "run-api.log").start()
    yield server
    server.stop()


@pytest.fixture()
def api(api_server: ApiProcess) -> Iterator[httpx.Client]:
    """An httpx client on a freshly reset shared API server."""
    with httpx.Client(base_url=api_server.url, timeout=30.0) as client:
        assert client.get("/reset_data").status_code == 200
        yield client


@pytest.fixture()
def start_api(tmp_path: Path) -> Iterator:
    """Factory for extra servers with their own flags; all are stopped after the test."""
    started: list[ApiProcess] = []

    def start(*args: str, port: int | None = None) -> ApiProcess:
        server = ApiProcess(*args, log_path=tmp_path / f"run-api-{len(started)}.log", port=port)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


# ---------------------------------------------------------------- atropos-serve (inference)


class ServeProcess:
    """``python -m atroposlib.inference.cli`` on a free loopback port; always killed on stop."""

    def __init__(self, model: Path | str, *args: str, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model)
        self.args = args
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> ServeProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "atroposlib.inference.cli",
                "--model",
                self.model,
                "--port",
                str(self.port),
                "--log-level",
                "warning",
                *self.args,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"atropos-serve exited early:\n{self.log()}")
                try:
                    if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            raise RuntimeError(f"atropos-serve not healthy after {timeout}s:\n{self.log()}")
        except BaseException:
            self.stop()
            raise

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if hasattr(self, "_log") and not self._log.closed:
            self._log.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the real SmolLM2 tokenizer (seed 0)."""
    pytest.importorskip("torch", reason="the inference extra (torch) is not installed")
    from atroposlib.inference.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "seed0", seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture, different weights (seed 1): the target of reload tests."""
    pytest.importorskip("torch", reason="the inference extra (torch) is not installed")
    from atroposlib.inference.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "seed1", seed=1)


def start_server(
    tmp_path_factory: pytest.TempPathFactory,
    model: Path | str,
    *args: str,
    timeout: float = 120.0,
) -> ServeProcess:
    """Start a server; the caller stops it (fixtures below do so in a finally)."""
    log = tmp_path_factory.mktemp("serve") / "atropos-serve.log"
    return ServeProcess(model, *args, log_path=log).start(timeout)


@pytest.fixture(scope="session")
def tiny_serve(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[ServeProcess]:
    """One ``atropos-serve`` with the tiny model for the whole session, served as ``tiny``.

    For tests outside ``tests/inference`` that need a real OpenAI-compatible server.
    """
    server = start_server(
        tmp_path_factory, tiny_model_dir, "--dtype", "float32", "--served-model-name", "tiny"
    )
    try:
        yield server
    finally:
        server.stop()


# --- Skips fail CI -----------------------------------------------------------------------------
# A skipped test is a test that did not run. On a developer's machine a missing tool (Chromium,
# the upstream 0.4.0 virtualenv) skips its tests with a reason; in CI (`CI` set, as `.ci/run`
# does) every tool is installed first, so any skip means a broken CI setup and fails the run.


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


# Upstream's API tests (vendored unchanged) start ``run-api`` on the fixed port 8000 and share
# whatever listens there; ``test_api_legacy``'s server lives until its worker's session ends. Under
# ``--dist loadfile`` two workers could run these files at once and one would see the other's
# server, so the scheduler below hands them out as one unit, to one worker, one after the other.
UPSTREAM_PORT_8000_FILES = (
    "tests/upstream/test_api_legacy.py",
    "tests/upstream/test_api_compression.py",
    "tests/upstream/test_api_messages_handling.py",
)


def _upstream_port_8000_file(nodeid: str) -> bool:
    path = nodeid.split("::", 1)[0]
    return any(path.endswith(name) for name in UPSTREAM_PORT_8000_FILES)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown when xdist is not loaded
def pytest_xdist_make_scheduler(config, log):  # type: ignore[no-untyped-def]
    """``--dist loadfile``, with upstream's port-8000 files as one work unit (see above)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class _LoadFilePort8000Together(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if _upstream_port_8000_file(nodeid):
                return "upstream-api-tests-on-port-8000"
            return super()._split_scope(nodeid)

    return _LoadFilePort8000Together(config, log)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    """In CI, list every skipped test with its reason and say that the run fails because of it."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not (_ci() and skipped):
        return
    terminalreporter.section("skipped tests fail the run in CI", sep="=", red=True, bold=True)
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        terminalreporter.write_line(f"SKIPPED {report.nodeid}: {reason}")
    terminalreporter.write_line(
        f"{len(skipped)} test(s) skipped with CI set: install what they need (see .ci/run)."
    )


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """In CI, a run with any skipped test exits non-zero even when everything else passed."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or not _ci():
        return
    if reporter.stats.get("skipped") and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
