"""Inference-server clients for environments: configs, backends, routing and token tracking.

The main names are re-exported here; each also lives in its upstream module
(``server_baseline``, ``server_manager``, ``openai_server``, ``vllm_server``, ...).
"""

from atroposlib.envs.server_handling.managed_server import (
    DummyManagedServer,
    ManagedServer,
    SequenceNode,
)
from atroposlib.envs.server_handling.openai_server import OpenAIServer
from atroposlib.envs.server_handling.server_baseline import (
    APIServer,
    APIServerConfig,
    AsyncSemWithAdaptiveWeight,
    ReasoningConfig,
    ServerBaseline,
)
from atroposlib.envs.server_handling.server_harness import ServerHarness
from atroposlib.envs.server_handling.server_manager import ServerManager, ServerManagerConfig
from atroposlib.envs.server_handling.sglang_server import SGLangServer
from atroposlib.envs.server_handling.trl_vllm_server import TrlVllmServer
from atroposlib.envs.server_handling.vllm_server import VLLMServer

__all__ = [
    "APIServer",
    "APIServerConfig",
    "AsyncSemWithAdaptiveWeight",
    "DummyManagedServer",
    "ManagedServer",
    "OpenAIServer",
    "ReasoningConfig",
    "SGLangServer",
    "SequenceNode",
    "ServerBaseline",
    "ServerHarness",
    "ServerManager",
    "ServerManagerConfig",
    "TrlVllmServer",
    "VLLMServer",
]
