"""Evaluation output: ``metrics.json`` and ``samples.jsonl`` as upstream's ``evaluate_log``
writes them (the lighteval-like layout nous-evals reads), and ``pass_at_k``."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from atroposlib.envs.sending import JsonlWriter
from atroposlib.utils.display import display_metrics_table

logger = logging.getLogger(__name__)

__all__ = ["evaluate_log", "pass_at_k"]


def pass_at_k(m: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``m`` samples of which ``c`` are correct."""
    if m - c < k:
        return 1.0
    prod = 1.0
    for i in range(m - c + 1, m + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def evaluate_log(
    metrics: Mapping[str, Any],
    eval_dir: str | os.PathLike[str] | None = None,
    task_name: str | None = None,
    model_name: str | None = None,
    start_time: float | None = None,
    end_time: float | None = None,
    generation_parameters: Mapping[str, Any] | None = None,
    samples: Sequence[Mapping[str, Any]] | None = None,
    verbose: bool = True,
) -> Path | None:
    """Write ``{eval_dir}/metrics.json`` (and ``samples.jsonl`` when ``samples`` is given).

    ``metrics.json`` is ``{"config_general": {model_name, total_evaluation_time_seconds (a
    string), generation_parameters}, "results": {"atropos|{task}|0": metrics, "all":
    metrics}}``. With ``verbose`` the metrics are printed as a markdown table.

    Returns:
        The path of ``metrics.json``, or None when ``eval_dir`` is None (a warning is logged).
    """
    if eval_dir is None:
        logger.warning("eval_dir is not set, skipping evaluation logging")
        return None
    out = Path(eval_dir)
    out.mkdir(parents=True, exist_ok=True)
    task_name = task_name or "eval"
    now = time.time()
    start_time = now if start_time is None else start_time
    end_time = now if end_time is None else end_time
    metrics = dict(metrics)
    if verbose:
        display_metrics_table(task_name, metrics, start_time, end_time)
    result = {
        "config_general": {
            "model_name": model_name,
            "total_evaluation_time_seconds": str(end_time - start_time),
            "generation_parameters": dict(generation_parameters or {}),
        },
        "results": {f"atropos|{task_name}|0": metrics, "all": metrics},
    }
    path = out / "metrics.json"
    path.write_text(json.dumps(result, indent=2, default=str), encoding="utf-8")
    logger.info("Evaluation results saved to %s", path)
    if samples:
        writer = JsonlWriter(out / "samples.jsonl")
        try:
            for sample in samples:
                writer.write(sample)
        finally:
            writer.close()
        logger.info("Evaluation samples saved to %s", out / "samples.jsonl")
    return path
