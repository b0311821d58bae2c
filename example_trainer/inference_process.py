"""Process management for the inference server the trainer feeds.

``ChildProcess`` and the reaper that stops children when this process dies moved to
:mod:`atroposlib.utils.processes` (``atropos-launch`` uses them too); they are still importable
from here, and ``InferenceLaunchError`` is the same class as ``ProcessLaunchError``. The
weight-sync strategies (``VLLMRestart``, ``VLLMReload``, ``AtroposServeReload``,
``SGLangReload``, ``NoSync``, ``vllm_command``) live in ``example_trainer.weight_sync`` and are
importable from here as well.
"""

from __future__ import annotations

from atroposlib.utils.processes import (
    ChildProcess,
    ProcessLaunchError,
    stop_all_children,
    unwatch_process_group,
    watch_process_group,
)

#: The error a child raises when it cannot start or become ready (same class as
#: :class:`atroposlib.utils.processes.ProcessLaunchError`).
InferenceLaunchError = ProcessLaunchError

__all__ = [
    "ChildProcess",
    "InferenceLaunchError",
    "ProcessLaunchError",
    "stop_all_children",
    "unwatch_process_group",
    "watch_process_group",
]

# ------------------------------------------------------------------------------ weight sync

# The weight-sync strategies live in example_trainer.weight_sync; their old import path keeps
# working (lazily: weight_sync imports ChildProcess from here).
_WEIGHT_SYNC_NAMES = (
    "AtroposServeReload",
    "NoSync",
    "SGLangReload",
    "VLLMReload",
    "VLLMRestart",
    "WeightSync",
    "vllm_command",
)


def __getattr__(name: str):
    if name in _WEIGHT_SYNC_NAMES:
        from example_trainer import weight_sync

        return getattr(weight_sync, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
