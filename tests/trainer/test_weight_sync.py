"""Weight-sync strategies against stand-ins: vLLM in-place reload (tests/trainer/fake_vllm.py),
SGLang's ``/update_weights_from_disk`` (a small HTTP server here), the ``/policy_version``
middleware that runs inside vLLM, and the version the trainer passes to atropos-serve."""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from example_trainer.config import TrainingConfig
from example_trainer.inference_process import InferenceLaunchError
from example_trainer.vllm_plugins import PLUGIN_DIR
from example_trainer.vllm_plugins.atropos_policy_version import PolicyVersionMiddleware
from example_trainer.weight_sync import (
    POLICY_VERSION_MIDDLEWARE,
    AtroposServeReload,
    NoSync,
    SGLangReload,
    VLLMReload,
    VLLMRestart,
    make_weight_sync,
    vllm_command,
)
from tests.conftest import ServeProcess, free_port

FAKE = Path(__file__).with_name("fake_vllm.py")


def _checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    return folder


def _build(port: int):
    def build(model: str) -> list[str]:
        argv = vllm_command(model, served_model_name="policy", port=port)
        return [sys.executable, str(FAKE), *argv[3:]]

    return build


def _strategy(cls, tmp_path: Path, port: int, env: dict | None = None, **kwargs):
    return cls(
        _build(port),
        f"http://127.0.0.1:{port}",
        tmp_path / "vllm.log",
        startup_timeout=20,
        served_model_name="policy",
        env={
            "FAKE_VLLM_RECORD": str(tmp_path / "launches.jsonl"),
            "FAKE_VLLM_CALLS": str(tmp_path / "calls.jsonl"),
            **(env or {}),
        },
        **kwargs,
    )


def _lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def _served(port: int) -> tuple[str, int]:
    root = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["root"]
    version = httpx.get(f"http://127.0.0.1:{port}/policy_version").json()["policy_version"]
    return root, version


# ------------------------------------------------------------------------------ vLLM in place


def test_reload_updates_the_running_server_in_place(tmp_path: Path) -> None:
    port = free_port()
    sync = _strategy(VLLMReload, tmp_path, port)
    sync.start("base-model", policy_version=0)
    try:
        (launch,) = _lines(tmp_path / "launches.jsonl")
        # the launch carries the plugin: middleware flag, its folder importable, version 0
        assert launch["argv"][-2:] == ["--middleware", POLICY_VERSION_MIDDLEWARE]
        assert launch["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(PLUGIN_DIR)
        assert launch["env"]["ATROPOS_POLICY_VERSION"] == "0"
        assert launch["env"]["VLLM_SERVER_DEV_MODE"] == "1"
        assert _served(port) == ("base-model", 0)

        step_3 = _checkpoint(tmp_path / "step_3")
        seconds = sync.sync(step_3, policy_version=3)
        assert 0 < seconds < 5
        assert len(_lines(tmp_path / "launches.jsonl")) == 1  # no restart
        assert _served(port) == (str(step_3.resolve()), 3)
        calls = _lines(tmp_path / "calls.jsonl")
        assert [c["path"] for c in calls] == [
            "/pause",
            "/collective_rpc",
            "/reset_prefix_cache",
            "/update_weight_version",
            "/resume",
        ]
        assert calls[0]["query"] == {"mode": "wait"}
        assert calls[1]["body"] == {
            "method": "reload_weights",
            "kwargs": {"weights_path": str(step_3.resolve())},
        }
        assert calls[3]["body"] == {"new_version": "3"}
        assert sync.policy_version == 3 and sync.in_place
    finally:
        sync.close()


def test_reload_inside_a_trainer_pause_keeps_the_trainers_pause(tmp_path: Path) -> None:
    port = free_port()
    sync = _strategy(VLLMReload, tmp_path, port)
    sync.start("base-model", policy_version=0)
    try:
        sync.pause("keep")
        sync.sync(_checkpoint(tmp_path / "step_1"), policy_version=1)
        assert httpx.get(f"http://127.0.0.1:{port}/is_paused").json() == {"is_paused": True}
        sync.resume()
        paths = [(c["path"], c["query"]) for c in _lines(tmp_path / "calls.jsonl")]
        assert paths[0] == ("/pause", {"mode": "keep"})
        assert [p for p, _ in paths].count("/pause") == 1
        assert paths[-1] == ("/resume", {})
    finally:
        sync.close()


def test_failed_reload_resumes_the_server_and_falls_back_to_restarts(tmp_path: Path) -> None:
    port = free_port()
    sync = _strategy(VLLMReload, tmp_path, port)
    sync.start("base-model", policy_version=0)
    try:
        broken = tmp_path / "not-a-checkpoint"
        broken.mkdir()
        with pytest.raises(InferenceLaunchError, match="reload_weights"):
            sync.reload_in_place(broken, policy_version=1)
        assert httpx.get(f"http://127.0.0.1:{port}/is_paused").json() == {"is_paused": False}

        # through sync(): the failure turns into a restart on the checkpoint, and later syncs
        # restart directly
        sync.sync(broken, policy_version=1)
        launches = _lines(tmp_path / "launches.jsonl")
        assert len(launches) == 2 and not sync.in_place
        assert launches[1]["model"] == str(broken)
        assert launches[1]["env"]["ATROPOS_POLICY_VERSION"] == "1"
        assert _served(port) == (str(broken), 1)
        sync.sync(_checkpoint(tmp_path / "step_2"), policy_version=2)
        assert len(_lines(tmp_path / "launches.jsonl")) == 3
    finally:
        sync.close()


def test_vllm_without_rl_endpoints_is_restarted_or_refused(tmp_path: Path) -> None:
    port = free_port()
    sync = _strategy(VLLMReload, tmp_path, port, env={"FAKE_VLLM_NO_RL": "1"})
    sync.start("base-model")
    try:
        sync.sync(_checkpoint(tmp_path / "step_1"), policy_version=1)
        assert len(_lines(tmp_path / "launches.jsonl")) == 2
        assert _served(port)[1] == 1
    finally:
        sync.close()

    strict = _strategy(
        VLLMReload, tmp_path, free_port(), env={"FAKE_VLLM_NO_RL": "1"}, fallback_to_restart=False
    )
    strict.start("base-model")
    try:
        with pytest.raises(InferenceLaunchError, match="HTTP 404"):
            strict.sync(_checkpoint(tmp_path / "step_1"), policy_version=1)
    finally:
        strict.close()


def test_restart_reports_the_version_it_was_launched_with(tmp_path: Path) -> None:
    port = free_port()
    sync = _strategy(VLLMRestart, tmp_path, port)
    sync.start("base-model", policy_version=4)
    try:
        assert _served(port) == ("base-model", 4)
        sync.sync(_checkpoint(tmp_path / "step_6"), policy_version=6)
        assert _served(port)[1] == 6
        assert "VLLM_SERVER_DEV_MODE" not in {
            k for k, v in _lines(tmp_path / "launches.jsonl")[-1]["env"].items() if v
        }
    finally:
        sync.close()


def test_config_picks_the_strategy(tmp_path: Path) -> None:
    base = TrainingConfig(model_name="m", save_path=str(tmp_path))
    assert isinstance(make_weight_sync(base), VLLMReload)  # the default: in place
    restart = make_weight_sync(base.model_copy(update={"weight_sync": "restart"}))
    assert type(restart) is VLLMRestart
    assert isinstance(
        make_weight_sync(base.model_copy(update={"inference": "sglang"})), SGLangReload
    )
    serve = make_weight_sync(base.model_copy(update={"inference": "atropos-serve"}))
    assert isinstance(serve, AtroposServeReload)
    assert type(make_weight_sync(base.model_copy(update={"inference": "none"}))) is NoSync


def test_config_picks_a_client_of_a_running_server(tmp_path: Path) -> None:
    """launch_vllm false, trl-vllm-serve, several URLs: clients of servers already running
    (what atropos-launch gives the trainer), and the settings that cannot work are named."""
    from atroposlib.backends import MultiServerSync
    from atroposlib.backends.weight_transfer import VLLMWeightTransfer

    base = TrainingConfig(model_name="m", save_path=str(tmp_path), served_model_name="policy")
    attached = make_weight_sync(
        base.model_copy(update={"launch_vllm": False, "inference_url": "http://gpu:8000"})
    )
    assert type(attached) is VLLMReload and not attached.launches_server
    assert (attached.url, attached.served_model_name) == ("http://gpu:8000", "policy")
    trl = make_weight_sync(
        base.model_copy(update={"inference": "trl-vllm-serve", "weight_sync": "nccl"})
    )
    assert isinstance(trl, VLLMWeightTransfer) and not trl.launches_server
    copies = make_weight_sync(
        base.model_copy(
            update={"inference": "atropos-serve", "inference_url": "http://a:1, http://b:2"}
        )
    )
    assert isinstance(copies, MultiServerSync)
    assert [c.url for c in copies.clients] == ["http://a:1", "http://b:2"]
    for fields, message in (
        ({"launch_vllm": False, "weight_sync": "restart"}, "weight_sync restart relaunches"),
        ({"inference": "sglang", "weight_sync": "nccl"}, "weight_sync nccl is vLLM's"),
    ):
        with pytest.raises(ValueError, match=message):
            TrainingConfig(model_name="m", **fields)


def test_bad_weight_sync_flags_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from example_trainer.config import load_config

    with pytest.raises(SystemExit) as exc:
        load_config(["--model", "m", "--no-launch-vllm", "--weight-sync", "restart"])
    assert exc.value.code == 2
    assert "weight_sync restart relaunches vLLM" in capsys.readouterr().err


# ------------------------------------------------------------------------------ the middleware


class _Engine:
    def __init__(self, version: object) -> None:
        self.version = version

    async def get_weight_version(self) -> str:
        if isinstance(self.version, Exception):
            raise self.version
        return self.version


def _app(engine: _Engine | None):
    from fastapi import FastAPI

    app = FastAPI()
    if engine is not None:
        app.state.engine_client = engine

    @app.get("/v1/models")
    async def models() -> dict:
        return {"data": []}

    app.add_middleware(PolicyVersionMiddleware)
    return app


@pytest.mark.parametrize(
    ("engine", "env", "expected"),
    [
        (_Engine("7"), None, 7),  # the engine's version wins
        (_Engine("default"), "3", 3),  # a fresh launch: the version given at launch
        (_Engine("default"), None, 0),
        (_Engine(RuntimeError("engine dead")), "2", 2),
        (None, "5", 5),
    ],
)
async def test_policy_version_middleware(
    monkeypatch: pytest.MonkeyPatch, engine: _Engine | None, env: str | None, expected: int
) -> None:
    if env is None:
        monkeypatch.delenv("ATROPOS_POLICY_VERSION", raising=False)
    else:
        monkeypatch.setenv("ATROPOS_POLICY_VERSION", env)
    transport = httpx.ASGITransport(app=_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://vllm") as client:
        reply = await client.get("/policy_version")
        assert reply.status_code == 200 and reply.json() == {"policy_version": expected}
        assert (await client.get("/v1/models")).json() == {"data": []}  # passes through
        assert (await client.post("/policy_version")).status_code == 405


def test_middleware_imports_only_the_standard_library() -> None:
    source = (PLUGIN_DIR / "atropos_policy_version.py").read_text()
    imports = {
        line.split()[1].split(".")[0]
        for line in source.splitlines()
        if line.startswith(("import ", "from "))
    }
    assert imports <= {"__future__", "json", "os"}, imports


# ------------------------------------------------------------------------------ SGLang


class _SGLang(BaseHTTPRequestHandler):
    """SGLang's weight routes as its http_server.py answers them."""

    state: dict = {}

    def _send(self, status: int, body: dict | None) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/health":
            self._send(200, None)
        elif self.path == "/model_info":
            self._send(
                200,
                {"model_path": self.state["model_path"], "weight_version": self.state["version"]},
            )
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.state.setdefault("requests", []).append((self.path, body))
        if self.path != "/update_weights_from_disk":
            self._send(404, {"detail": "Not Found"})
            return
        path = Path(body["model_path"])
        if not (path / "config.json").is_file():
            self._send(
                400, {"success": False, "message": f"Failed to get weights iterator: {path}"}
            )
            return
        self.state["model_path"] = str(path)
        if body.get("weight_version") is not None:
            self.state["version"] = body["weight_version"]
        self._send(
            200,
            {
                "success": True,
                "message": "Succeeded to update model weights.",
                "num_paused_requests": 0,
            },
        )

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def sglang() -> Iterator[str]:
    _SGLang.state = {"model_path": "base", "version": "default"}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SGLang)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_sglang_update_weights_from_disk(sglang: str, tmp_path: Path) -> None:
    sync = SGLangReload(sglang)
    sync.start("base", policy_version=0)
    step_2 = _checkpoint(tmp_path / "step_2")
    assert sync.sync(step_2, policy_version=2) >= 0
    assert _SGLang.state["requests"] == [
        ("/update_weights_from_disk", {"model_path": str(step_2.resolve()), "weight_version": "2"})
    ]
    info = httpx.get(sglang + "/model_info").json()
    assert info == {"model_path": str(step_2.resolve()), "weight_version": "2"}
    assert sync.last_reply is not None and sync.last_reply["success"] is True
    assert sync.policy_version == 2

    with pytest.raises(InferenceLaunchError, match="Failed to get weights iterator"):
        sync.sync(tmp_path / "missing", policy_version=3)
    assert sync.policy_version == 2


def test_sglang_not_running_is_a_clear_error() -> None:
    sync = SGLangReload(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(InferenceLaunchError, match="unreachable"):
        sync.sync(Path("/nonexistent"), policy_version=1)


# ------------------------------------------------------------------------------ atropos-serve


def test_atropos_serve_reload_carries_the_policy_version(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The trainer's body ``{"path", "policy_version"}`` is accepted by atropos-serve (which
    ignored unknown keys before it knew the field), and the new weights are live after it."""
    server = ServeProcess(
        tiny_model_dir, "--served-model-name", "policy", log_path=tmp_path / "s.log"
    )
    server.start()
    try:
        sync = AtroposServeReload(server.url)
        sync.start(str(tiny_model_dir), policy_version=0)
        seconds = sync.sync(tiny_model_dir, policy_version=5)
        assert seconds > 0 and sync.policy_version == 5
        assert sync.last_reply is not None and sync.last_reply["status"] == "ok"
        assert sync.last_reply["path"] == str(tiny_model_dir.resolve())
    finally:
        server.stop()


# ------------------------------------------------------------------------------ NCCL path (gloo)


def test_weight_transfer_broadcasts_the_trainers_parameters(tmp_path: Path) -> None:
    """vLLM's weight-transfer protocol end to end against the stand-in, gloo standing in for
    NCCL: group set-up at start, then per sync start/update/finish with one broadcast per
    parameter, no checkpoint read."""
    import torch

    from example_trainer.weight_transfer import GlooTransport, VLLMWeightTransfer

    port = free_port()
    sync = _strategy(VLLMWeightTransfer, tmp_path, port, transport=GlooTransport(timeout=60))
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    sync.attach(model)
    sync.start("base-model", policy_version=0)
    try:
        argv = _lines(tmp_path / "launches.jsonl")[0]["argv"]
        assert argv[argv.index("--weight-transfer-config") + 1] == '{"backend": "nccl"}'
        assert sync.connected
        (init,) = _lines(tmp_path / "calls.jsonl")
        assert init["path"] == "/init_weight_transfer_engine"
        info = init["body"]["init_info"]
        assert (info["rank_offset"], info["world_size"], info["packed"]) == (1, 2, False)

        with torch.no_grad():
            model[0].weight.add_(1.0)
        seconds = sync.sync(tmp_path / "step_1-never-read", policy_version=1)
        assert seconds > 0 and sync.policy_version == 1
        calls = _lines(tmp_path / "calls.jsonl")[1:]
        assert [c["path"] for c in calls] == [
            "/pause",
            "/start_weight_update",
            "/update_weights",
            "/update_weights (received)",
            "/finish_weight_update",
            "/reset_prefix_cache",
            "/resume",
        ]
        names = [name for name, _ in model.named_parameters()]
        assert calls[2]["body"]["update_info"] == {
            "names": names,
            "dtype_names": ["float32"] * len(names),
            "shapes": [list(p.shape) for p in model.parameters()],
        }
        expected = {name: float(p.detach().double().sum()) for name, p in model.named_parameters()}
        assert calls[3]["received"] == pytest.approx(expected)
        assert calls[4]["body"] == {"weight_version": "1"}
        assert _served(port) == ("transferred", 1)

        sync.send_dtype = "bfloat16"  # half the bytes for a bf16 server
        sync.sync(tmp_path / "step_2-never-read", policy_version=2)
        sent = _lines(tmp_path / "calls.jsonl")[-5]
        assert sent["body"]["update_info"]["dtype_names"] == ["bfloat16"] * len(names)
        assert _served(port) == ("transferred", 2)
    finally:
        sync.close()


def test_weight_transfer_without_a_model_reloads_the_checkpoint(tmp_path: Path) -> None:
    from example_trainer.weight_transfer import GlooTransport, VLLMWeightTransfer

    port = free_port()
    sync = _strategy(VLLMWeightTransfer, tmp_path, port, transport=GlooTransport(timeout=60))
    sync.start("base-model", policy_version=0)
    try:
        step_1 = _checkpoint(tmp_path / "step_1")
        sync.sync(step_1, policy_version=1)
        assert "/collective_rpc" in [c["path"] for c in _lines(tmp_path / "calls.jsonl")]
        assert _served(port) == (str(step_1.resolve()), 1)
    finally:
        sync.close()


def test_nccl_setting_builds_the_transfer_launch(tmp_path: Path) -> None:
    from example_trainer.weight_transfer import VLLMNcclTransport, VLLMWeightTransfer

    config = TrainingConfig(
        model_name="m", save_path=str(tmp_path), weight_sync="nccl", vllm_python="/venv/bin/python"
    )
    sync = make_weight_sync(config)
    assert isinstance(sync, VLLMWeightTransfer)
    assert isinstance(sync.transport, VLLMNcclTransport)
    argv = sync.command("/ckpt/base")
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[-2:] == ["--weight-transfer-config", '{"backend": "nccl"}']
    assert "--middleware" in argv
    env = sync.launch_env(0)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["ATROPOS_POLICY_VERSION"] == "0"


# ------------------------------------------------------------------------------ the trainer


def test_trainer_syncs_vllm_in_place_with_its_step_as_version(
    tmp_path: Path, start_api, tiny_model_dir: Path
) -> None:
    """``atropos-grpo --inference vllm`` (default ``--weight-sync reload``) end to end, with the
    stand-in ``vllm`` package: one launch at version 0, then each sync reloads ``step_N`` in
    place and sets version N."""
    import subprocess

    from tests.trainer.test_end_to_end import ENV, _metrics, _tokenized_groups, _trainer_cmd

    package = tmp_path / "fakepkg" / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for folder in (package, package.parent, package.parent.parent):
        (folder / "__init__.py").write_text("")
    (package / "api_server.py").write_text(
        f"import runpy\nrunpy.run_path({str(FAKE)!r}, run_name='__main__')\n"
    )
    api = start_api()
    for group in _tokenized_groups(6):
        assert httpx.post(api.url + "/scored_data", json=group).status_code == 200
    port = free_port()
    argv = ["--training-steps", "3", "--inference", "vllm", "--vllm-port", str(port)]
    argv += ["--weight-sync-interval", "1", "--served-model-name", "policy"]
    result = subprocess.run(
        _trainer_cmd(tiny_model_dir, api.url, tmp_path / "ckpt", *argv),
        capture_output=True,
        text=True,
        env={
            **ENV,
            "PYTHONPATH": str(tmp_path / "fakepkg"),
            "FAKE_VLLM_RECORD": str(tmp_path / "launches.jsonl"),
            "FAKE_VLLM_CALLS": str(tmp_path / "calls.jsonl"),
        },
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    (launch,) = _lines(tmp_path / "launches.jsonl")
    assert Path(launch["model"]).name == tiny_model_dir.name
    assert launch["env"]["ATROPOS_POLICY_VERSION"] == "0"
    calls = _lines(tmp_path / "calls.jsonl")
    reloaded = [
        Path(c["body"]["kwargs"]["weights_path"]).name
        for c in calls
        if c["path"] == "/collective_rpc"
    ]
    versions = [c["body"]["new_version"] for c in calls if c["path"] == "/update_weight_version"]
    # the vLLM the trainer launched stops with it: no sync after the last step
    assert reloaded == ["step_1", "step_2"] and versions == ["1", "2"]
    assert [m["reload_seconds"] > 0 for m in _metrics(tmp_path / "ckpt")] == [True, True, False]
