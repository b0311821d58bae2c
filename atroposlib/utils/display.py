"""Console display helpers for evaluation results."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["display_metrics_table", "format_metrics_table"]


def _fmt(value: Any) -> str:
    try:
        return f"{float(value):.4f}"
    except (TypeError, ValueError):
        return str(value)


def format_metrics_table(task_name: str, metrics: Mapping[str, Any]) -> str:
    """The metrics as an lm-eval-harness style markdown table (one row per metric)."""
    names = [str(k).replace("eval/", "").replace("_", " ") for k in metrics]
    values = [_fmt(v) for v in metrics.values()]
    w_group = max(len(task_name), len("Groups"))
    w_version, w_filter, w_nshot = len("Version"), len("Filter"), len("n-shot")
    w_metric = max([len("Metric"), *map(len, names)])
    w_dir, w_pm = 3, 3
    w_value = max([len("Value"), *map(len, values)])
    w_stderr = len("Stderr")
    lines = [
        f"|{'Groups':<{w_group}}|{'Version':<{w_version}}|{'Filter':<{w_filter}}"
        f"|{'n-shot':<{w_nshot}}|{'Metric':<{w_metric}}|{'':^{w_dir}}|{'Value':>{w_value}}"
        f"|{'':^{w_pm}}|{'Stderr':>{w_stderr}}|",
        f"|{'-' * w_group}|{'-' * w_version}|{'-' * w_filter}|{'-' * w_nshot}|{'-' * w_metric}"
        f"|{'-' * w_dir}|{'-' * (w_value - 1)}:|{'-' * w_pm}|{'-' * (w_stderr - 1)}:|",
    ]
    for key, name, value in zip(metrics, names, values, strict=True):
        direction = "↑" if "correct" in str(key) or "acc" in str(key) else ""
        lines.append(
            f"|{task_name:<{w_group}}|{1:<{w_version}}|{'none':<{w_filter}}|{'':<{w_nshot}}"
            f"|{name:<{w_metric}}|{direction:^{w_dir}}|{value:>{w_value}}|{'±':^{w_pm}}"
            f"|{'0.0000':>{w_stderr}}|"
        )
    return "\n".join(lines)


def display_metrics_table(
    task_name: str, metrics: Mapping[str, Any], start_time: float, end_time: float
) -> None:
    """Print the evaluation results of ``task_name`` as a markdown table, then the duration."""
    print(f"\nEvaluation Results: {task_name}")
    print(format_metrics_table(task_name, metrics))
    print(f"Evaluation completed in {end_time - start_time:.2f} seconds")
