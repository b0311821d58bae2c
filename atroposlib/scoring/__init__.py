"""Reusable scoring pieces that environments compose (one kind of reward each).

- :mod:`atroposlib.scoring.math`: math answer extraction and ``math-verify`` checking.
- :mod:`atroposlib.scoring.answers`: multiple-choice letters, tagged answers, exact match.
- :mod:`atroposlib.scoring.rewards`: reward functions by name, upstream's length penalty.
- :mod:`atroposlib.scoring.sandbox`: run untrusted Python under OS-level limits.
- :mod:`atroposlib.scoring.code`: run unit tests against a candidate program in the sandbox.

Submodules are imported on use, so importing this package pulls in neither sympy nor
subprocess machinery.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["answers", "code", "math", "rewards", "sandbox"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
