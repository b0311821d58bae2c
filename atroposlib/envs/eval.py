"""Evaluation output: ``metrics.json`` and ``samples.jsonl`` as upstream's ``evaluate_log``
writes them (the lighteval-like layout nous-evals reads), ``pass_at_k``, and the bodies of
``BaseEnv.evaluate_log`` and ``BaseEnv.run_eval`` (:func:`log_env_evaluation`,
:func:`run_env_eval`)."""

from __future__ import annotations

import inspect
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any

from atroposlib.envs.sending import JsonlWriter
from atroposlib.utils.concurrency import gather_bounded
from atroposlib.utils.display import display_metrics_table

if TYPE_CHECKING:
    from atroposlib.envs.base import BaseEnv

logger = logging.getLogger(__name__)


#: Set by a pinned evaluation (:mod:`.pinned_eval`) around ``env.evaluate()``: every metric
#: ``evaluate_log`` logs in that context is also appended here, so the evaluation's result does
#: not depend on ``env.eval_metrics``, which ``wandb_log`` empties whenever it logs.
EVAL_CAPTURE: ContextVar[list[tuple[str, Any]] | None] = ContextVar(
    "atropos_eval_capture", default=None
)

__all__ = [
    "EVAL_CAPTURE",
    "EVAL_ITEM_LIMIT",
    "evaluate_log",
    "log_env_evaluation",
    "pass_at_k",
    "run_env_eval",
]

#: When set, ``run_eval`` runs only the first N of its jobs (``check`` sets it, so that an
#: env's evaluation is exercised without running its whole held-out set).
EVAL_ITEM_LIMIT: ContextVar[int | None] = ContextVar("EVAL_ITEM_LIMIT", default=None)


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


def log_env_evaluation(
    env: BaseEnv,
    metrics: Mapping[str, Any],
    task_name: str | None = None,
    model_name: str | None = None,
    start_time: float | None = None,
    end_time: float | None = None,
    generation_parameters: Mapping[str, Any] | None = None,
    samples: Sequence[Mapping[str, Any]] | None = None,
    verbose: bool = True,
) -> None:
    """``BaseEnv.evaluate_log``: :func:`evaluate_log` into ``data_dir_to_save_evals`` with the
    env's defaults (task ``{name}_eval``; model: the config's ``model_name``, else the first
    server's; ``max_new_tokens`` from ``max_token_length``), and the numeric metrics queued in
    ``env.eval_metrics`` for the next ``wandb_log`` (logged once)."""
    env._evaluate_logged = True
    if task_name is None:
        task_name = f"{env.name or type(env).__name__}_eval"
    if model_name is None:
        model_name = getattr(env.config, "model_name", None)
        if model_name is None and env.server.servers:
            model_name = getattr(getattr(env.server.servers[0], "config", None), "model_name", None)
    params = {"max_new_tokens": env.config.max_token_length, **(generation_parameters or {})}
    if env.config.data_dir_to_save_evals is None:
        logger.warning("data_dir_to_save_evals is not set, skipping evaluation logging")
    else:
        evaluate_log(
            metrics,
            eval_dir=env.config.data_dir_to_save_evals,
            task_name=task_name,
            model_name=model_name,
            start_time=start_time,
            end_time=end_time,
            generation_parameters=params,
            samples=samples,
            verbose=verbose,
        )
    # logged to W&B by the next ``wandb_log`` (once; envs that also queue the same keys in
    # ``eval_metrics`` overwrite them, they are not logged twice)
    logged = [(k, v) for k, v in metrics.items() if isinstance(v, (int, float))]
    env.eval_metrics.extend(logged)
    captured = EVAL_CAPTURE.get()
    if captured is not None:  # a pinned evaluation collects its own result
        captured.extend(logged)


async def run_env_eval(
    env: BaseEnv,
    jobs: Iterable[Awaitable[dict[str, Any]]],
    metrics: Callable[[list[dict[str, Any]]], dict[str, float]],
    *,
    generation_parameters: dict[str, Any] | None = None,
    task_name: str | None = None,
    desc: str = "eval",
) -> dict[str, float]:
    """``BaseEnv.run_eval``: ``jobs`` at most ``max_eval_workers`` at a time (progress bar
    ``desc``), ``metrics(samples)``, then ``env.evaluate_log``; the metrics."""
    start = time.time()
    jobs = list(jobs)
    limit = EVAL_ITEM_LIMIT.get()
    if limit is not None and len(jobs) > limit:
        logger.info("evaluating %d of %d items (a check)", limit, len(jobs))
        for job in jobs[limit:]:
            if inspect.iscoroutine(job):
                job.close()  # never started
        jobs = jobs[:limit]
    samples = await gather_bounded(jobs, env.config.max_eval_workers, desc=desc)
    result = metrics(samples)
    await env.evaluate_log(
        result,
        task_name=task_name,
        samples=samples,
        start_time=start,
        end_time=time.time(),
        generation_parameters=generation_parameters,
    )
    return result
