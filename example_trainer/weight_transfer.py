"""Moved to :mod:`atroposlib.backends.weight_transfer` (vLLM's NCCL weight transfer, usable by
any trainer); upstream's import path keeps working."""

from atroposlib.backends.weight_transfer import (  # noqa: F401
    GlooTransport,
    Transport,
    VLLMNcclTransport,
    VLLMWeightTransfer,
)

__all__ = ["GlooTransport", "Transport", "VLLMNcclTransport", "VLLMWeightTransfer"]
