"""Small metric helpers for W&B logging."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["get_std_min_max_avg"]


def get_std_min_max_avg(name: str, data: Iterable[float], metrics_dict: dict[str, Any]) -> dict:
    """Add ``{name}_mean``, ``{name}_std`` (population), ``{name}_max`` and ``{name}_min`` of
    ``data`` to ``metrics_dict`` and return it.

    Values are Python floats. Empty ``data`` adds nothing (upstream raised from ``np.max``).
    """
    values = np.asarray(list(data), dtype=np.float64)
    if values.size == 0:
        return metrics_dict
    metrics_dict[f"{name}_mean"] = float(np.mean(values))
    metrics_dict[f"{name}_std"] = float(np.std(values))
    metrics_dict[f"{name}_max"] = float(np.max(values))
    metrics_dict[f"{name}_min"] = float(np.min(values))
    return metrics_dict
