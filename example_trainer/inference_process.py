"""Process management for the inference server the trainer feeds.

``ChildProcess`` and the reaper that stops children when this process dies moved to
:mod:`atroposlib.utils.processes` (``atropos-launch`` uses them too); they are still importable
from here, and ``InferenceLaunchError`` is the same class as ``ProcessLaunchError``. The
weight-sync clients (``VLLMRestart``, ``VLLMReload``, ``AtroposServeReload``,
``SGLangReload``, ``NoSync``, ``vllm_command``) live in :mod:`atroposlib.backends` and are
importable from here (and from ``example_trainer.weight_sync``) as well.
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

# The weight-sync clients live in atroposlib.backends; this old import path keeps working.
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
        from atroposlib.backends import weight_sync

        return getattr(weight_sync, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
