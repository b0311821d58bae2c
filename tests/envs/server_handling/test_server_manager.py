"""ServerManager: building servers from configs, routing, n splitting and sessions."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import warnings
from pathlib import Path
from typing import Any

import pytest

from atroposlib.envs.server_handling.managed_server import DummyManagedServer, ManagedServer
from atroposlib.envs.server_handling.openai_server import (
    OpenAIServer,
    ServerConfigError,
    resolve_openai_configs,
)
from atroposlib.envs.server_handling.server_baseline import (
    APIServerConfig,
    ServerBaseline,
    server_root,
)
from atroposlib.envs.server_handling.server_harness import (
    ServerHarness,
    create_chat_completion,
    create_completion,
)
from atroposlib.envs.server_handling.server_manager import ServerManager, ServerManagerConfig
from atroposlib.envs.server_handling.sglang_server import SGLangServer
from atroposlib.envs.server_handling.trl_vllm_server import TrlVllmServer
from atroposlib.envs.server_handling.vllm_server import VLLMServer
from atroposlib.envs.server_handling.vllm_server import (
    resolve_openai_configs as resolve_vllm_configs,
)
from tests.envs.server_handling.conftest import engine_requests

MESSAGES = [{"role": "user", "content": "hi"}]

# ---------------------------------------------------------------- construction


def test_config_defaults() -> None:
    cfg = ServerManagerConfig()
    assert (cfg.slurm, cfg.testing, cfg.max_n_completions, cfg.proxy_url) == (False, False, 8, None)


def test_single_api_server_config_keeps_its_url_and_key() -> None:
    """Regression: upstream replaced a lone APIServerConfig with localhost:9004-9007."""
    config = APIServerConfig(base_url="http://127.0.0.1:8123/v1", api_key="secret", model_name="m")
    manager = ServerManager(config)
    assert len(manager.servers) == 1
    (server,) = manager.servers
    assert isinstance(server, OpenAIServer)
    assert server.config.base_url == "http://127.0.0.1:8123/v1"
    assert server.config.api_key == "secret"


def test_bare_baseline_generates_local_servers() -> None:
    baseline = ServerBaseline(model_name="m", timeout=7, num_max_requests_at_once=3)
    manager = ServerManager(baseline)
    urls = [s.config.base_url for s in manager.servers]
    assert urls == [f"http://localhost:{p}/v1" for p in range(9004, 9008)]
    for server in manager.servers:
        assert (server.config.api_key, server.config.model_name, server.config.timeout) == (
            "x",
            "m",
            7,
        )
        assert server.sem.max_val == 3


def test_list_gives_one_server_each_and_class_by_type(tiny_model_dir: Path) -> None:
    configs = [APIServerConfig(base_url=f"http://127.0.0.1:{p}/v1", model_name="m") for p in (1, 2)]
    assert [s.config.base_url for s in ServerManager(configs).servers] == [
        "http://127.0.0.1:1/v1",
        "http://127.0.0.1:2/v1",
    ]
    for server_type, cls in (
        ("vllm", VLLMServer),
        ("sglang", SGLangServer),
        ("trl", TrlVllmServer),
    ):
        config = APIServerConfig(
            base_url="http://127.0.0.1:1/v1",
            model_name=str(tiny_model_dir),
            server_type=server_type,
        )
        assert type(ServerManager([config]).servers[0]) is cls
    bad = APIServerConfig.model_construct(**{**configs[0].model_dump(), "server_type": "nope"})
    with pytest.raises(ValueError, match="Invalid server type"):
        ServerManager([bad])


def test_testing_mode_uses_harness() -> None:
    manager = ServerManager(APIServerConfig(), testing=True)
    assert len(manager.servers) == 1 and isinstance(manager.servers[0], ServerHarness)


@pytest.fixture()
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real ``scontrol`` executable on PATH that expands the node list like SLURM's."""
    script = tmp_path / "scontrol"
    script.write_text('#!/bin/sh\nfor n in $(echo "$3" | tr , " "); do echo "$n"; done\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("NUM_TRAINING_NODES", "1")


def test_slurm_baseline_with_string_infer_tp(fake_slurm: None, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_JOB_NODELIST", "train0,infer1,infer2")
    monkeypatch.setenv("INFER_TP", "2")  # an env var is a string: upstream divided by it
    manager = ServerManager(ServerBaseline(model_name="m"))
    assert [s.config.base_url for s in manager.servers] == [
        f"http://{node}:{9000 + i}/v1" for node in ("infer1", "infer2") for i in range(4)
    ]


def test_slurm_list_uses_first_config_as_template(fake_slurm: None, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_JOB_NODELIST", "train0,infer1")
    monkeypatch.delenv("INFER_TP", raising=False)
    template = APIServerConfig(base_url="http://ignored/v1", api_key="k", model_name="m")
    manager = ServerManager([template], slurm=True)
    assert [s.config.base_url for s in manager.servers] == [
        f"http://infer1:{9000 + i}/v1" for i in range(8)
    ]
    assert {s.config.api_key for s in manager.servers} == {"k"}
    assert template.base_url == "http://ignored/v1"  # copied, not mutated

    monkeypatch.setenv("SLURM_JOB_NODELIST", "solo")  # fewer than 2 nodes: as given
    manager = ServerManager([template], slurm=True)
    assert [s.config.base_url for s in manager.servers] == ["http://ignored/v1"]


# ---------------------------------------------------------------- routing


def harness_manager(count: int, slots: int = 4, **kwargs: Any) -> ServerManager:
    manager = ServerManager(APIServerConfig(), testing=True, **kwargs)
    manager.servers = [ServerHarness(concurrency=slots) for _ in range(count)]
    for server in manager.servers:
        server.set_desired_response(MESSAGES, create_chat_completion("ok"))
    return manager


async def test_routes_to_most_available_healthy_server() -> None:
    manager = harness_manager(3)
    a, b, c = manager.servers
    a.sem._value, b.sem._value, c.sem._value = 1, 3, 4
    a.eval_sem._value, b.eval_sem._value, c.eval_sem._value = 4, 2, 1
    c.server_healthy = False  # most training slots, but unhealthy
    await manager.chat_completion(messages=MESSAGES)
    assert (len(a.calls), len(b.calls), len(c.calls)) == (0, 1, 0)
    await manager.chat_completion(messages=MESSAGES, split="eval")
    assert len(a.calls) == 1 and a.calls[0][1]["split"] == "eval"
    for server in manager.servers:
        server.server_healthy = False
    await manager.chat_completion(messages=MESSAGES)  # none healthy: server 0
    assert len(a.calls) == 2


async def test_ties_go_to_lowest_index() -> None:
    manager = harness_manager(3)
    await manager.chat_completion(messages=MESSAGES)
    assert [len(s.calls) for s in manager.servers] == [1, 0, 0]


async def test_wait_for_sem_blocks_until_a_slot_frees() -> None:
    manager = harness_manager(1, slots=2)
    (server,) = manager.servers
    await server.sem.acquire()
    await server.eval_sem.acquire()  # an eval request in flight uses the other train slot
    waiter = asyncio.create_task(manager.chat_completion(messages=MESSAGES))
    await asyncio.sleep(0.3)
    assert not waiter.done()
    server.eval_sem.release()
    await asyncio.wait_for(waiter, 5)
    assert len(server.calls) == 1


async def test_manager_built_with_object_new_still_routes(tiny_tokenizer: Any) -> None:
    manager = object.__new__(ServerManager)
    harness = ServerHarness()
    harness.set_desired_completion("p", create_completion("done"))
    manager.servers = [harness]
    manager.max_n_completions = 8
    manager.reasoning_config = None
    out = await manager.completion(prompt="p")
    assert out.choices[0].text == "done"
    async with manager.managed_server(tokenizer=tiny_tokenizer) as managed:
        assert isinstance(managed, ManagedServer)


async def test_n_split_into_chunks_and_merged() -> None:
    manager = harness_manager(1, max_n_completions=3)
    (server,) = manager.servers
    server.set_desired_response(MESSAGES, create_chat_completion(["x"] * 3, n=3))
    prompt = "p"
    server.set_tokens_and_logprobs_response(
        prompt, [1], [[2], [3], [4]], [[-1.0]] * 3, ["stop"] * 3
    )
    out = await manager.tokens_and_logprobs_completion(prompt=prompt, n=7)
    assert [call[1]["n"] for call in server.calls] == [3, 3, 1]
    assert out[0] == [1] and len(out[1]) == len(out[2]) == len(out[3]) == 9


async def test_chat_n_split_against_real_server(tiny_config: APIServerConfig) -> None:
    config = tiny_config.model_copy(update={"server_type": "openai"})
    manager = ServerManager([config], max_n_completions=2)
    try:
        before = engine_requests(server_root(config.base_url))
        out = await manager.chat_completion(messages=MESSAGES, n=5, max_tokens=3)
        assert len(out.choices) == 5
        assert [c.index for c in out.choices] == list(range(5))
        assert engine_requests(server_root(config.base_url)) == before + 3
        text = await manager.completion(prompt="Hello", n=3, max_tokens=2, split="eval")
        assert len(text.choices) == 3
        assert len(manager.servers[0].eval_request_timings) == 2
    finally:
        await manager.close()


async def test_tokens_split_against_real_vllm(tiny_config: APIServerConfig) -> None:
    manager = ServerManager([tiny_config], max_n_completions=2)
    try:
        prompt_tokens, outputs, logprobs, reasons = await manager.tokens_and_logprobs_completion(
            prompt="Hello", n=3, max_tokens=4
        )
        assert len(outputs) == len(logprobs) == len(reasons) == 3
        assert [len(o) for o in outputs] == [len(lp) for lp in logprobs]
    finally:
        await manager.close()


# ---------------------------------------------------------------- sessions and weights


async def test_dedicated_server_holds_a_slot() -> None:
    manager = harness_manager(2, slots=2)
    async with manager.dedicated_server() as server:
        assert server is manager.servers[0] and server.sem._value == 1
    assert manager.servers[0].sem._value == 2
    evals = manager.servers[0].eval_sem._value
    async with manager.dedicated_server("eval") as server:
        assert server.eval_sem._value == evals - 1 and server.sem._value == 2
    assert server.eval_sem._value == evals


async def test_managed_server_for_openai_needs_opt_in(monkeypatch) -> None:
    manager = ServerManager(APIServerConfig(base_url="http://127.0.0.1:1/v1", health_check=False))
    monkeypatch.delenv("ATROPOS_ALLOW_DUMMY_MANAGED_SERVER", raising=False)
    monkeypatch.delenv("ATROPOS_PROXY_URL", raising=False)
    with pytest.raises(NotImplementedError, match="ATROPOS_ALLOW_DUMMY_MANAGED_SERVER"):
        async with manager.managed_server():
            pass
    monkeypatch.setenv("ATROPOS_ALLOW_DUMMY_MANAGED_SERVER", "yes")
    with pytest.warns(UserWarning, match="DummyManagedServer"):
        async with manager.managed_server() as managed:
            assert isinstance(managed, DummyManagedServer)


async def test_managed_server_session_resets_and_pins(tiny_config: APIServerConfig) -> None:
    other = tiny_config.model_copy(update={"base_url": "http://127.0.0.1:9/v1"})
    manager = ServerManager([other, tiny_config])
    manager.servers[0].server_healthy = True
    try:
        async with manager.managed_server(base_url=tiny_config.base_url) as managed:
            assert isinstance(managed, ManagedServer)
            assert managed.server is manager.servers[1]
            await managed.chat_completion(messages=MESSAGES, max_tokens=3)
            assert len(managed.get_state()["nodes"]) == 1
        assert managed.get_state()["nodes"] == []
    finally:
        await manager.close()


async def test_update_weight_reaches_every_semaphore() -> None:
    manager = harness_manager(2, slots=10)
    await manager.update_weight(0.3)
    for server in manager.servers:
        assert server.sem.weight == server.eval_sem.weight == 0.3
        assert server.sem.min_val() == pytest.approx(7.0)


@pytest.mark.filterwarnings("ignore:Using DummyManagedServer")
async def test_pinned_but_unhealthy_server_falls_back(monkeypatch, tiny_tokenizer) -> None:
    monkeypatch.setenv("ATROPOS_ALLOW_DUMMY_MANAGED_SERVER", "1")
    configs = [
        APIServerConfig(base_url=f"http://worker-{i}:8000/v1", health_check=False) for i in range(3)
    ]
    manager = ServerManager(configs)
    manager.servers[0].server_healthy = False
    manager.servers[1].sem._value = 2
    with pytest.warns(UserWarning, match="unhealthy"):
        async with manager.managed_server(base_url="http://worker-0:8000/v1") as managed:
            assert managed.server is manager.servers[2]
    with pytest.warns(UserWarning, match="No server with base_url"):
        async with manager.managed_server(base_url="http://nowhere/v1") as managed:
            assert managed.server is manager.servers[2]


async def test_session_id_maps_to_a_stable_server(monkeypatch) -> None:
    monkeypatch.setenv("ATROPOS_ALLOW_DUMMY_MANAGED_SERVER", "1")
    configs = [
        APIServerConfig(base_url=f"http://worker-{i}:8000/v1", health_check=False) for i in range(3)
    ]
    manager = ServerManager(configs)
    picked = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            async with manager.managed_server(session_id="episode-42") as managed:
                picked.add(managed.server.config.base_url)
        spread = set()
        for i in range(20):
            async with manager.managed_server(session_id=f"episode-{i}") as managed:
                spread.add(managed.server.config.base_url)
    assert len(picked) == 1 and len(spread) > 1


def test_resolve_openai_configs() -> None:
    log = logging.getLogger("test")
    single = APIServerConfig(base_url="http://127.0.0.1:9001/v1", api_key="x", model_name="m")
    merged = {**single.model_dump(), "model_name": "cli-model"}
    out = resolve_openai_configs(single, merged, {}, {"openai.model_name": "cli-model"}, log)
    assert isinstance(out, list) and len(out) == 1
    assert (out[0].base_url, out[0].model_name) == ("http://127.0.0.1:9001/v1", "cli-model")

    baseline = ServerBaseline(model_name="m")
    assert resolve_openai_configs(baseline, {}, {}, {}, log) is baseline
    overridden = resolve_openai_configs(
        baseline, {"base_url": "http://h/v1"}, {}, {"openai.base_url": "http://h/v1"}, log
    )
    assert overridden[0].base_url == "http://h/v1" and overridden[0].model_name == "m"

    pair = [APIServerConfig(base_url=f"http://h{i}/v1") for i in range(2)]
    assert resolve_openai_configs(pair, {}, {}, {}, log) == pair
    yaml_pair = {"openai": [{"base_url": "http://y1/v1"}, {"base_url": "http://y2/v1"}]}
    assert [c.base_url for c in resolve_openai_configs(single, {}, yaml_pair, {}, log)] == [
        "http://y1/v1",
        "http://y2/v1",
    ]
    with pytest.raises(ServerConfigError) as info:
        resolve_openai_configs(pair, {}, {}, {"openai.base_url": "x"}, log)
    assert info.value.exit_code == 2
    assert resolve_vllm_configs is resolve_openai_configs


async def test_wait_for_sem_wakes_on_release_not_on_a_poll(monkeypatch: Any) -> None:
    from atroposlib.envs.server_handling import server_manager

    monkeypatch.setattr(server_manager, "SEM_POLL_INTERVAL", 60.0)
    manager = harness_manager(2, slots=1)
    for server in manager.servers:
        await server.sem.acquire()
    waiter = asyncio.create_task(manager.chat_completion(messages=MESSAGES))
    await asyncio.sleep(0.2)
    assert not waiter.done()
    manager.servers[1].sem.release()  # the second server frees a slot: no 60 s poll needed
    await asyncio.wait_for(waiter, 5)
    assert [len(s.calls) for s in manager.servers] == [0, 1]
