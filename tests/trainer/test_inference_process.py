"""Process management and the vLLM restart, against a stand-in server command
(tests/trainer/fake_vllm.py). The other weight-sync strategies: test_weight_sync.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from example_trainer.inference_process import (
    ChildProcess,
    InferenceLaunchError,
    VLLMRestart,
    vllm_command,
)
from example_trainer.vllm_api_server import atropos_serve_args
from tests.conftest import free_port

FAKE = Path(__file__).with_name("fake_vllm.py")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _wait_dead(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def _restarter(tmp_path: Path, port: int, *, env: dict | None = None, name: str = "policy"):
    def build(model: str) -> list[str]:
        argv = vllm_command(model, served_model_name=name, port=port)
        # same flags, but the stand-in script instead of vLLM's module
        return [sys.executable, str(FAKE), *argv[3:]]

    return VLLMRestart(
        build,
        f"http://127.0.0.1:{port}",
        tmp_path / "vllm.log",
        startup_timeout=20,
        served_model_name=name,
        env={"FAKE_VLLM_RECORD": str(tmp_path / "launches.jsonl"), **(env or {})},
    )


def _launches(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "launches.jsonl").read_text().splitlines()]


def test_vllm_command_has_upstream_flags() -> None:
    argv = vllm_command("/ckpt/step_3", served_model_name="Qwen/Qwen2.5-0.5B", port=9001)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == "/ckpt/step_3"
    assert argv[argv.index("--served-model-name") + 1] == "Qwen/Qwen2.5-0.5B"
    assert argv[argv.index("--port") + 1] == "9001"
    assert "--gpu-memory-utilization" in argv


def test_restart_relaunches_on_checkpoint_with_same_name(tmp_path: Path) -> None:
    port = free_port()
    sync = _restarter(tmp_path, port)
    sync.start("base-model")
    try:
        first = _launches(tmp_path)[0]
        seconds = sync.sync(tmp_path / "step_3")
        assert seconds > 0
        launches = _launches(tmp_path)
        assert len(launches) == 2
        second = launches[1]
        assert second["model"] == str(tmp_path / "step_3")
        assert second["served_model_name"] == first["served_model_name"] == "policy"
        # the old server and everything it spawned are gone; the new one answers
        assert _wait_dead(first["pid"]) and _wait_dead(first["grandchild"])
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert models["data"][0]["root"] == str(tmp_path / "step_3")
    finally:
        sync.close()
    last = _launches(tmp_path)[-1]
    assert _wait_dead(last["pid"]) and _wait_dead(last["grandchild"])


def test_failed_launch_is_a_visible_error(tmp_path: Path) -> None:
    sync = _restarter(tmp_path, free_port(), env={"FAKE_VLLM_FAIL": "1"})
    with pytest.raises(InferenceLaunchError) as info:
        sync.start("base-model")
    message = str(info.value)
    assert "exited with status 3" in message
    assert "CUDA out of memory (simulated)" in message  # the log's tail is shown


def test_launch_that_never_gets_healthy_times_out_and_is_stopped(tmp_path: Path) -> None:
    sync = _restarter(tmp_path, free_port(), env={"FAKE_VLLM_DELAY": "60"})
    sync.startup_timeout = 2
    with pytest.raises(InferenceLaunchError, match="did not answer"):
        sync.start("base-model")
    launch = _launches(tmp_path)[0]
    assert _wait_dead(launch["pid"]) and _wait_dead(launch["grandchild"])


def test_wrong_served_name_is_refused(tmp_path: Path) -> None:
    port = free_port()
    sync = _restarter(tmp_path, port)
    sync.served_model_name = "something-else"
    with pytest.raises(InferenceLaunchError, match="not 'something-else'"):
        sync.start("base-model")
    assert _wait_dead(_launches(tmp_path)[0]["pid"])


def test_missing_interpreter_is_reported(tmp_path: Path) -> None:
    child = ChildProcess("vllm", ["/nonexistent/python", "-m", "vllm"], tmp_path / "x.log")
    with pytest.raises(InferenceLaunchError, match="cannot run '/nonexistent/python'"):
        child.start()


def test_stop_escalates_to_sigkill(tmp_path: Path) -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    child = ChildProcess("stubborn", [sys.executable, "-c", code], tmp_path / "s.log").start()
    time.sleep(0.5)
    started = time.monotonic()
    status = child.stop(timeout=1.0)
    assert status == -9
    assert time.monotonic() - started < 10
    assert not child.running


def test_vllm_api_server_fallback_keeps_serve_flags() -> None:
    kept = atropos_serve_args(
        [
            "--model",
            "m",
            "--port",
            "9001",
            "--gpu-memory-utilization",
            "0.45",
            "--served-model-name=policy",
            "--disable-log-requests",
            "--dtype",
            "auto",
        ]
    )
    assert kept == [
        "--model",
        "m",
        "--port",
        "9001",
        "--served-model-name=policy",
        "--dtype",
        "auto",
    ]


def test_children_die_with_a_sigkilled_owner_whatever_thread_started_them(tmp_path: Path) -> None:
    """The owner starts a child (which starts a grandchild in its session) from a thread that
    then exits, and is SIGKILLed: the reaper still stops the child's whole process group."""
    pids = tmp_path / "pids.txt"
    owner_code = textwrap.dedent(
        f"""
        import threading, time
        from example_trainer.inference_process import ChildProcess
        command = ["sh", "-c", "sleep 600 & echo $$ $! > {pids}; wait"]
        thread = threading.Thread(
            target=lambda: ChildProcess("sleeper", command, {str(tmp_path / "log")!r}).start()
        )
        thread.start()
        thread.join()
        print("started", flush=True)
        time.sleep(600)
        """
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", owner_code],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 10
        while not (pids.is_file() and len(pids.read_text().split()) == 2):
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        child, grandchild = (int(p) for p in pids.read_text().split())
        assert _alive(child) and _alive(grandchild)
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        assert _wait_dead(child, 8) and _wait_dead(grandchild, 8)
    finally:
        owner.kill()
        owner.wait()


def test_weight_sync_names_still_import_from_inference_process() -> None:
    """The strategies moved to example_trainer.weight_sync; the old import path still works."""
    from example_trainer import inference_process, weight_sync

    for name in ("WeightSync", "NoSync", "VLLMRestart", "AtroposServeReload", "vllm_command"):
        assert getattr(inference_process, name) is getattr(weight_sync, name)
    with pytest.raises(AttributeError):
        _ = inference_process.NotAThing  # type: ignore[attr-defined]
