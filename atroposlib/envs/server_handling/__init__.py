"""Inference-server clients for environments: configs, backends, routing and token tracking.

The main names are available here; each lives in its upstream module (``server_baseline``,
``server_manager``, ``openai_server``, ``vllm_server``, ...). They are imported on first use, so
importing one light module (say ``server_baseline``) does not load transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "APIServer": "server_baseline",
    "APIServerConfig": "server_baseline",
    "AsyncSemWithAdaptiveWeight": "server_baseline",
    "ReasoningConfig": "server_baseline",
    "ServerBaseline": "server_baseline",
    "local_server_configs": "server_baseline",
    "DummyManagedServer": "managed_server",
    "ManagedServer": "managed_server",
    "RetokenizingManagedServer": "managed_server",
    "SequenceNode": "managed_server",
    "OpenAIServer": "openai_server",
    "ServerHarness": "server_harness",
    "ServerManager": "server_manager",
    "ServerManagerConfig": "server_manager",
    "SGLangServer": "sglang_server",
    "TrlVllmServer": "trl_vllm_server",
    "VLLMServer": "vllm_server",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
