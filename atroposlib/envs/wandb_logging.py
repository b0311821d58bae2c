"""An environment's Weights & Biases logging: the run, the rollout table, timing statistics and
the metric buffers, behind ``BaseEnv``'s ``setup_wandb``, ``add_rollouts_for_wandb``,
``create_rollout_table``, ``perf_stats``, ``wandb_log`` and ``log_train_metric``.

``BaseEnv`` keeps upstream's attributes (``rollouts_for_wandb``, ``eval_metrics``,
``completion_lengths``, the timing lists, ``wandb_prepend``...) because envs written for upstream
read and fill them; :class:`WandbLogging` owns the run object and the ``log_train_metric``
buffer. W&B trouble never stops rollouts: a run that cannot start leaves W&B off.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import string
from collections.abc import Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from atroposlib.schema import ScoredDataGroup
from atroposlib.utils.metrics import get_std_min_max_avg

if TYPE_CHECKING:
    from atroposlib.envs.base import BaseEnv

# a child of the logger upstream's envs configure (``atroposlib.envs.base``)
logger = logging.getLogger("atroposlib.envs.base.wandb")

__all__ = ["PERF_LISTS", "WandbLogging"]

#: ``train_perf/*`` statistics ``perf_stats`` reports: metric name -> ``BaseEnv`` list attribute.
PERF_LISTS = {
    "train_perf/task_duration": "task_duration",
    "train_perf/succeeded_task_duration": "succeeded_task_duration",
    "train_perf/failed_task_duration": "failed_task_duration",
    "train_perf/mainloop_timings": "mainloop_timings",
    "train_perf/workers_added_per_attempt": "workers_added_list",
}


class WandbLogging:
    """The W&B side of one environment (``env._wandb_logging``).

    Args:
        env: The environment; its overridable methods (``create_rollout_table``,
            ``perf_stats``) are called through it, so subclass overrides take effect.
    """

    def __init__(self, env: BaseEnv) -> None:
        self.env = env
        #: The ``wandb`` run, or None while W&B is off.
        self.run: Any = None
        #: ``log_train_metric``'s buffer: name -> values since the last ``wandb_log``.
        self.train_metrics: dict[str, list[float]] = {}
        # upstream's W&B buffers (``env.rollouts_for_wandb`` and friends read these): kept
        # rollouts, completion lengths, eval metrics ``(name, value)`` queued by
        # ``evaluate_log`` for the next log
        self.rollouts_for_wandb: list[list[tuple[str, float]]] = []
        self.completion_lengths: list[int] = []
        self.eval_metrics: list[tuple[str, Any]] = []
        self._evaluate_logged = False

    @property
    def active(self) -> bool:
        """Whether metrics go to W&B (``use_wandb`` and a started run)."""
        return bool(self.env.config.use_wandb) and self.run is not None

    def start(self, project: str | None, group: str | None, run_prefix: str) -> None:
        """Start a run named ``{run_prefix}-{date}-{6 letters}`` with the env config; on any
        failure log a warning and turn ``use_wandb`` off."""
        try:
            import wandb

            run_name = (
                f"{run_prefix}-{datetime.now().strftime('%Y-%m-%d')}-"
                f"{''.join(random.choices(string.ascii_lowercase, k=6))}"
            )
            self.run = wandb.init(
                name=run_name,
                project=project,
                group=group,
                config=self.env.config.model_dump(mode="json"),
                reinit=True,
            )
        except Exception as exc:  # noqa: BLE001 - W&B trouble must not stop rollouts
            logger.warning(
                "W&B could not start (%s: %s); continuing without it. Set WANDB_MODE=offline "
                "to log locally, or --env.use_wandb false to silence this.",
                type(exc).__name__,
                exc,
            )
            self.env.config.use_wandb = False
            self.run = None

    def finish(self) -> None:
        """Finish the run, if one is open (errors are logged at debug level)."""
        if self.run is None:
            return
        try:
            self.run.finish()
        except Exception as exc:  # noqa: BLE001
            logger.debug("wandb finish: %s", exc)
        self.run = None

    async def setup(self) -> None:
        """``setup_wandb``: wait for the trainer to register, then start a run in the project
        and group it set (``WANDB_PROJECT`` when it set none; no project at all: W&B off)."""
        env = self.env
        if not env.config.use_wandb:
            return
        while True:
            info = await env.api.request_json_patiently("GET", "/info", what="/info")
            if info.get("batch_size", -1) != -1:
                break
            logger.info("Waiting for the trainer to register before starting W&B")
            await asyncio.sleep(1.0)
        data = await env.api.request_json_patiently("GET", "/wandb_info", what="/wandb_info")
        env.wandb_group = data.get("group")
        env.wandb_project = data.get("project") or os.environ.get("WANDB_PROJECT")
        if env.wandb_project is None:
            logger.warning("The trainer set no W&B project and WANDB_PROJECT is unset: no W&B")
            env.config.use_wandb = False
            return
        self.start(env.wandb_project, env.wandb_group, env.display_name)

    def log_train_metric(self, name: str, value: float | Iterable[float]) -> None:
        """Buffer one value or several under ``name``."""
        values = [float(value)] if isinstance(value, (int, float)) else [float(v) for v in value]
        self.train_metrics.setdefault(name, []).extend(values)

    def add_rollouts(self, scored_data: ScoredDataGroup) -> None:
        """``add_rollouts_for_wandb``: keep the group's first decoded sequences and scores."""
        env = self.env
        num_keep = env.config.num_rollouts_per_group_for_logging
        tokens = scored_data["tokens"]
        num_keep = len(tokens) if num_keep == -1 else min(num_keep, len(tokens))
        self.rollouts_for_wandb.append(
            [(env.tokenizer.decode(tokens[i]), scored_data["scores"][i]) for i in range(num_keep)]
        )
        if len(self.rollouts_for_wandb) > env.config.num_rollouts_to_keep:
            self.rollouts_for_wandb.pop(0)

    def rollout_table(self, wandb_metrics: dict[str, Any]) -> dict[str, Any]:
        """``create_rollout_table``: add ``train/rollouts`` (text, score) when rollouts were
        kept."""
        if self.rollouts_for_wandb:
            import wandb

            table = wandb.Table(columns=["text", "score"])
            for group in self.rollouts_for_wandb:
                for text, score in group:
                    table.add_data(text, score)
            wandb_metrics["train/rollouts"] = table
        return wandb_metrics

    def perf_stats(self, metrics_dict: dict[str, Any]) -> dict[str, Any]:
        """``perf_stats``: timing statistics, item counts, drops and retries; resets the
        timing lists."""
        env = self.env
        for name, attr in PERF_LISTS.items():
            values = getattr(env, attr)
            if len(values) > 1:
                get_std_min_max_avg(name, values, metrics_dict)
            if attr == "succeeded_task_duration" and values:
                metrics_dict["train/items_sent_to_api"] = len(values)
            if attr == "failed_task_duration" and values:
                metrics_dict["train/items_rejected"] = len(values)
            setattr(env, attr, [])
        for reason, count in env.drop_counts.items():
            metrics_dict[f"train/dropped_{reason}"] = count
        metrics_dict["train/retried_rollouts"] = env.retried_rollouts
        selective = getattr(env, "flat_items", None)
        if selective is not None:
            metrics_dict["train/skipped_flat_items"] = selective.skipped
        return metrics_dict

    def _completion_length_stats(self, wandb_metrics: dict[str, Any]) -> None:
        env = self.env
        if not self.completion_lengths:
            return
        lengths = [float(x) for x in self.completion_lengths]
        mean = sum(lengths) / len(lengths)
        wandb_metrics["train/completion_lengths"] = mean
        wandb_metrics["train/completion_lengths_std"] = math.sqrt(
            sum((x - mean) ** 2 for x in lengths) / len(lengths)
        )
        wandb_metrics["train/completion_lengths_max"] = max(lengths)
        wandb_metrics["train/completion_lengths_min"] = min(lengths)
        if env.max_token_len > 0:
            # upstream's name: the fraction of completions above 95% of the budget
            wandb_metrics["train/completion_lengths_p95"] = sum(
                x > 0.95 * env.max_token_len for x in lengths
            ) / len(lengths)

    async def log(self, wandb_metrics: dict[str, Any] | None = None) -> None:
        """``wandb_log``: add the buffered train metrics (means), the queued eval metrics,
        completion lengths, the rollout table and ``perf_stats``; prefix with
        ``{wandb_prepend}_``, add the servers' metrics unprefixed and log at ``curr_step``.
        Every buffer is cleared, logged or not."""
        env = self.env
        wandb_metrics = {} if wandb_metrics is None else dict(wandb_metrics)
        for name, values in self.train_metrics.items():
            if values:
                wandb_metrics.setdefault(name, sum(values) / len(values))
        self.train_metrics = {}
        # the newest value of each queued eval metric (two evals between logs: the second's)
        for name, value in dict(self.eval_metrics).items():
            wandb_metrics.setdefault(name, value)
        self.eval_metrics = []
        server_metrics: dict[str, Any] = {}
        for i, server in enumerate(env.server.servers):
            metrics_fn = getattr(server, "wandb_metrics", None)
            if metrics_fn is not None:
                server_metrics.update(await metrics_fn({}, f"server_{i}") or {})
        self._completion_length_stats(wandb_metrics)
        if self.active:
            wandb_metrics = await env.create_rollout_table(wandb_metrics)
        wandb_metrics = env.perf_stats(wandb_metrics)
        self.rollouts_for_wandb = []
        self.completion_lengths = []
        if self.active:
            if env.wandb_prepend is not None:
                wandb_metrics = {f"{env.wandb_prepend}_{k}": v for k, v in wandb_metrics.items()}
            wandb_metrics.update(server_metrics)
            try:
                self.run.log(wandb_metrics, step=env.curr_step)
            except Exception as exc:  # noqa: BLE001
                logger.warning("W&B log failed: %s", exc)
