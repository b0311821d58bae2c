"""The names users import from ``atroposlib.envs.server_handling`` (spec section 8)."""

from __future__ import annotations

import inspect

from atroposlib.envs.server_handling import managed_server_proxy, server_harness, trl_vllm_server
from atroposlib.envs.server_handling.managed_server import ManagedServer
from atroposlib.envs.server_handling.openai_server import APIServerConfig as OpenAIConfig
from atroposlib.envs.server_handling.openai_server import OpenAIServer
from atroposlib.envs.server_handling.server_baseline import (
    APIServer,
    APIServerConfig,
    AsyncSemWithAdaptiveWeight,
    ReasoningConfig,
)
from atroposlib.envs.server_handling.server_manager import ServerManager
from atroposlib.envs.server_handling.tool_call_translator import VLLM_AVAILABLE, ToolCallTranslator


def test_import_surface() -> None:
    assert OpenAIConfig is APIServerConfig
    assert inspect.isabstract(APIServer) and issubclass(OpenAIServer, APIServer)
    assert callable(managed_server_proxy.create_app)
    assert isinstance(VLLM_AVAILABLE, bool) and callable(ToolCallTranslator)
    assert hasattr(trl_vllm_server, "AutoTokenizer") and hasattr(trl_vllm_server, "aiohttp")
    assert server_harness.ServerHarness and ServerManager and ManagedServer
    assert AsyncSemWithAdaptiveWeight and ReasoningConfig


async def test_testing_mode_session_without_tokenizer() -> None:
    """``--testing``: a ManagedServer over the harness needs no tokenizer and no network."""
    manager = ServerManager(APIServerConfig(), testing=True)
    (harness,) = manager.servers
    harness.set_tokens_and_logprobs_response(
        "user: hi", [1, 2], [[72, 105]], [[-0.5, -0.25]], ["stop"]
    )
    async with manager.managed_server() as managed:
        out = await managed.chat_completion(messages=[{"role": "user", "content": "hi"}])
        assert out.choices[0].message.content == "Hi"
        (node,) = managed.get_state()["nodes"]
        assert node.masked_tokens == [-100, -100, 72, 105]
        assert node.logprobs == [1.0, 1.0, -0.5, -0.25]
    metrics = await harness.wandb_metrics(None, "harness")
    assert metrics == {}


def test_package_exports_main_names() -> None:
    import atroposlib.envs.server_handling as package

    for name in package.__all__:
        assert getattr(package, name).__name__ == name
    assert package.ServerManager is ServerManager
    try:
        package.NotAThing  # noqa: B018
    except AttributeError:
        pass
    else:  # pragma: no cover
        raise AssertionError("unknown names must raise AttributeError")
