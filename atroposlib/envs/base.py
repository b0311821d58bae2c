"""``BaseEnv``: the contract an environment implements, and the runtime that serves it.

Write an environment
--------------------
Subclass ``BaseEnv`` and implement:

* ``setup()``: load data, build anything the env needs (called once, before any rollout).
* ``get_next_item()``: the next item to roll out, or None to start no new rollout now.
* ``collect_trajectories(item)``: ``(group, backlog)``: a ``ScoredDataGroup`` (or a list of
  them, or None to send nothing) and items to roll out later. *Or* implement
  ``collect_trajectory(item)`` returning ``(ScoredDataItem | None, backlog)``; the default
  ``collect_trajectories`` runs it ``group_size`` times concurrently and builds the group.
* ``evaluate()``: run an evaluation, usually ending with ``self.evaluate_log(...)``.

Optional hooks: ``config_init()`` (classmethod: default ``(env_config, server_configs)``),
``postprocess_histories(groups)``, ``cleanup()`` (after each item), ``wandb_log(metrics)``
(add your keys, then call ``super().wandb_log(metrics)``), ``save_checkpoint(step, data)``.

Class attributes: ``name`` (file and W&B names; defaults the API name), ``env_config_cls``
(your ``BaseEnvConfig`` subclass), ``server_cls`` (the default ``APIServer`` means "choose
by ``server_type``").

Inside a rollout use ``self.server`` (a ``ServerManager``: ``chat_completion``,
``completion``, ``managed_server(...)``), ``self.tokenizer`` and ``self.config``.

Run it with ``YourEnv.cli()``: ``python your_env.py serve|process|evaluate --help``.

What the runtime guarantees (``serve``)
---------------------------------------
* Registration with the trajectory API is retried until the trainer has started; a restarted
  API (the env id unknown) is re-registered transparently and nothing in flight is lost.
* When the API's queue holds ``max_batches_offpolicy`` batches, *new* rollouts pause;
  rollouts already running finish and are sent (sending waits out ``429 Retry-After``).
* A rollout that raises or exceeds ``worker_timeout`` is retried ``rollout_retries`` times,
  then counted (``self.drop_counts``) and logged with its traceback.
* Every dropped group is counted by reason (``drop_counts``) and logged to W&B.
* When the queued data covers ``total_steps``, the env stops its rollouts, disconnects from
  the API and ``env_manager()`` returns.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import string
import time
import traceback
import uuid
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from atroposlib.envs import throttle
from atroposlib.envs.config import BaseEnvConfig, EvalHandlingEnum
from atroposlib.envs.eval import evaluate_log as _evaluate_log
from atroposlib.envs.options import SERVER_MANAGER_OPTIONS
from atroposlib.envs.sending import (
    ApiRefused,
    JsonlWriter,
    RolloutApiClient,
    UnknownEnvError,
    encode_json_body,
)
from atroposlib.envs.server_handling.server_baseline import (
    APIServer,
    APIServerConfig,
    ReasoningConfig,
    ServerBaseline,
)
from atroposlib.envs.server_handling.server_manager import ServerManager, ServerManagerConfig
from atroposlib.schema import ITEM_KEYS, REQUIRED_KEYS, ScoredDataGroup, ScoredDataItem
from atroposlib.type_definitions import UUID, Item
from atroposlib.utils.concurrency import gather_bounded
from atroposlib.utils.metrics import get_std_min_max_avg

logger = logging.getLogger(__name__)

__all__ = [
    "APIServer",
    "APIServerConfig",
    "BaseEnv",
    "BaseEnvConfig",
    "EvalHandlingEnum",
    "ScoredDataGroup",
    "ScoredDataItem",
    "ServerBaseline",
    "ServerManager",
    "ServerManagerConfig",
]


#: ``tokenizer_name`` that means atropos-serve's bundled SmolLM2-135M-Instruct tokenizer.
SMOLLM2_ALIAS = "SmolLM2-135M-Instruct"
#: Seconds between two ``/status-env`` polls of the main loop.
STATUS_POLL_INTERVAL = 0.1
#: Most groups per ``/scored_data_list`` request when sends are coalesced.
MAX_GROUPS_PER_POST = 64


class _StopServing(Exception):
    """Raised inside the main loop when the env has produced enough data."""


class BaseEnv(ABC):
    """Base class of every environment (see the module docstring for the contract)."""

    #: Used for process-mode file names, the W&B run name and the default ``wandb_name``.
    name: str | None = None
    #: The config class of this env (``config_init`` returns an instance of it).
    env_config_cls: type[BaseEnvConfig] = BaseEnvConfig
    #: Server client class; the abstract ``APIServer`` means "choose by ``server_type``".
    server_cls: type[APIServer] = APIServer

    def __init__(
        self,
        config: BaseEnvConfig,
        server_configs: ServerBaseline | APIServerConfig | list[APIServerConfig],
        slurm: bool = False,
        testing: bool = False,
    ) -> None:
        self.config = config
        self.items_sent_this_step = 0
        self.eval_runner: asyncio.Task | None = None
        self.workers_added_list: list[int] = []
        self.succeeded_task_duration: list[float] = []
        self.failed_task_duration: list[float] = []
        self.task_duration: list[float] = []
        self.mainloop_timings: list[float] = []
        self.task_successful: list[int] = []
        self.last_loop_time: float | None = None
        self.last_completed_item: Item = None
        options = SERVER_MANAGER_OPTIONS.get() or {}
        self.tokenizer = self._load_tokenizer(config.tokenizer_name)
        self.server = ServerManager(
            self._with_server_tokenizers(server_configs),
            slurm=slurm,
            testing=testing,
            server_class=self.server_cls,
            reasoning_config=ReasoningConfig(
                enabled=config.thinking_mode,
                effort=config.reasoning_effort,
                max_tokens=config.max_reasoning_tokens,
            ),
            max_n_completions=options.get("max_n_completions", 8),
            proxy_url=options.get("proxy_url"),
        )
        self.workers: set[asyncio.Task] = set()
        self.eval_workers: set[asyncio.Task] = set()
        self.backlog: list[Item] = []
        self.rollouts_for_wandb: list[list[tuple[str, float]]] = []
        #: Evaluation metrics ``(name, value)`` waiting for the next ``wandb_log`` (upstream's
        #: attribute; ``evaluate_log`` fills it, ``wandb_log`` logs and clears it).
        self.eval_metrics: list[tuple[str, Any]] = []
        #: Training metrics buffered by ``log_train_metric``: name -> values since last log.
        self._train_metrics: dict[str, list[float]] = {}
        self.running_items: dict[UUID, dict[str, Any]] = {}
        self.wandb_project: str | None = None
        self.wandb_group: str | None = None
        self.curr_step = 0
        self.max_token_len = -1
        self.completion_lengths: list[int] = []
        self.max_num_workers = self._resolve_max_workers()
        self.wandb_prepend: str | None = None
        self.checkpoint_dir = ""
        self.checkpoint_interval = -1
        self.env_id: int | None = None
        self.status_dict: dict[str, Any] | None = None
        #: Why work was dropped: reason -> count (``error``, ``timeout``, ``group_size``,
        #: ``same_scores``, ``too_long``, ``malformed``, ``send_failed``, ``refused``).
        self.drop_counts: Counter[str] = Counter()
        self._flat_report = (time.monotonic(), 0)  # when flat groups were last reported, count
        #: Rollouts retried after an error or a timeout.
        self.retried_rollouts = 0
        self.groups_sent = 0
        self._retry_queue: deque[tuple[Item, int]] = deque()
        self._wake: asyncio.Event | None = None
        self._api: RolloutApiClient | None = None
        self._register_lock: asyncio.Lock | None = None
        self._send_pending: list[tuple[list[dict], asyncio.Future]] = []
        self._sender_task: asyncio.Task | None = None
        self._sent_since_status = 0
        self._wandb_run: Any = None
        self._evaluate_logged = False
        self.jsonl_writer: JsonlWriter | None = None
        if config.data_path_to_save_groups is not None:
            path = _free_path(Path(config.data_path_to_save_groups))
            if str(path) != config.data_path_to_save_groups:
                logger.info(
                    "Changed data path to %s because %s already exists.",
                    path,
                    config.data_path_to_save_groups,
                )
            path.parent.mkdir(parents=True, exist_ok=True)
            self.config.data_path_to_save_groups = str(path)
            self.jsonl_writer = JsonlWriter(path)

    # ------------------------------------------------------------------ construction helpers

    @staticmethod
    def _resolve_tokenizer_name(name: str) -> str:
        if name == SMOLLM2_ALIAS:
            # the model atropos-serve ships with: its local tokenizer, no Hub access needed
            from atroposlib.inference.assets import smollm2_tokenizer_dir

            return str(smollm2_tokenizer_dir())
        return name

    def _load_tokenizer(self, name: str) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self._resolve_tokenizer_name(name))

    def _with_server_tokenizers(self, server_configs: Any) -> Any:
        """Token-level servers (vllm, sglang, trl) with ``tokenizer_name`` "none" use the
        env's tokenizer instead of loading one named after ``model_name`` (often a served
        alias such as "tiny" that is no tokenizer at all)."""
        env_tokenizer = self._resolve_tokenizer_name(self.config.tokenizer_name)

        def fix(cfg: Any) -> Any:
            if not isinstance(cfg, ServerBaseline) or cfg.server_type == "openai":
                return cfg
            name = cfg.tokenizer_name
            if name == "none":
                return cfg.model_copy(update={"tokenizer_name": env_tokenizer})
            if name == SMOLLM2_ALIAS:
                return cfg.model_copy(update={"tokenizer_name": self._resolve_tokenizer_name(name)})
            return cfg

        if isinstance(server_configs, list):
            return [fix(c) for c in server_configs]
        return fix(server_configs)

    def _resolve_max_workers(self) -> int:
        if self.config.max_num_workers == -1:
            return self.config.max_num_workers_per_node * max(1, len(self.server.servers))
        return self.config.max_num_workers

    @property
    def derived_batch_size(self) -> int:
        """This env's share of a batch (``batch_size`` scaled by the unallocated fraction
        plus its own minimum allocation)."""
        return throttle.derived_batch_size(
            self.config.batch_size, self.status_dict, self.config.min_batch_allocation
        )

    @property
    def api(self) -> RolloutApiClient:
        """The trajectory-API client (created on first use)."""
        if self._api is None:
            self._api = RolloutApiClient(self.config.rollout_server_url)
        return self._api

    @property
    def display_name(self) -> str:
        """``wandb_name``, else the class ``name``, else the class's Python name."""
        return self.config.wandb_name or self.name or type(self).__name__

    # ------------------------------------------------------------------ the contract

    @classmethod
    def config_init(cls) -> tuple[BaseEnvConfig, ServerBaseline | list[APIServerConfig]]:
        """Default ``(env_config, server_configs)`` of this env; the CLI layers YAML and
        flags on top."""
        return cls.env_config_cls(), ServerBaseline()

    async def setup(self) -> None:
        """Prepare the env (load datasets...). Called once before anything else."""
        raise NotImplementedError("Setup method must be implemented in subclass")

    @abstractmethod
    async def get_next_item(self) -> Item:
        """The next item to roll out; None means "nothing now" (spawning stops until the
        next loop iteration)."""
        raise NotImplementedError("get_next_item must be implemented in subclass")

    @abstractmethod
    async def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """Run an evaluation (every ``steps_per_eval`` trainer steps in ``serve``, once in
        ``evaluate``). Report with ``self.evaluate_log(metrics, samples=...)``, or return
        a dict of metrics and the ``evaluate`` command logs it."""
        raise NotImplementedError("Evaluate method must be implemented in subclass")

    async def collect_trajectory(self, item: Item) -> tuple[ScoredDataItem | None, list[Item]]:
        """One trajectory for ``item``: ``(ScoredDataItem or None, backlog items)``."""
        raise NotImplementedError(
            "Implement collect_trajectory or collect_trajectories in your environment"
        )

    async def collect_trajectories(
        self, item: Item
    ) -> tuple[ScoredDataGroup | list[ScoredDataGroup | None] | None, list[Item]]:
        """A group for ``item``: by default ``group_size`` concurrent ``collect_trajectory``
        calls. Trajectories that came back None are left out; optional per-sequence keys are
        kept only when every trajectory has them (so lists stay aligned with ``tokens``)."""
        results = await asyncio.gather(
            *(self.collect_trajectory(item) for _ in range(self.config.group_size))
        )
        backlog: list[Item] = []
        items: list[ScoredDataItem] = []
        for result in results:
            if not isinstance(result, tuple) or len(result) != 2:
                raise ValueError(
                    "collect_trajectory must return (ScoredDataItem | None, backlog), got "
                    f"{type(result).__name__}"
                )
            scored, more = result
            backlog.extend(more or [])
            if scored is None:
                continue
            if not isinstance(scored, dict):
                raise ValueError(
                    "collect_trajectory must return a ScoredDataItem (a dict) or None, got "
                    f"{type(scored).__name__}"
                )
            items.append(scored)
        if not items:
            return None, backlog
        group: ScoredDataGroup = {
            "tokens": [it["tokens"] for it in items],
            "masks": [it["masks"] for it in items],
            "scores": [it["scores"] for it in items],
        }
        for key in ITEM_KEYS:
            values = [it.get(key) for it in items]
            if all(v is not None for v in values):
                group[key] = values
        overrides: dict[str, Any] = {}
        for it in items:
            overrides.update(it.get("group_overrides") or {})
        group["group_overrides"] = overrides
        if len(items) != self.config.group_size and "group_size" not in overrides:
            overrides["group_size"] = len(items)
        return group, backlog

    async def postprocess_histories(
        self, trajectories: ScoredDataGroup | list[ScoredDataGroup | None] | None
    ) -> ScoredDataGroup | list[ScoredDataGroup | None] | None:
        """Change groups after collection (identity by default)."""
        return trajectories

    async def cleanup(self) -> None:
        """Called after each item's rollout finished (nothing by default)."""
        return None

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint_path(self, step: int) -> Path:
        return (
            Path(self.checkpoint_dir)
            / "env_checkpoints"
            / str(self.wandb_prepend)
            / f"step-{step}.json"
        )

    def load_checkpoint(self) -> None:
        """Restore attributes saved by ``save_checkpoint`` at ``curr_step`` (if any)."""
        path = self._checkpoint_path(self.curr_step)
        if path.exists():
            for key, value in json.loads(path.read_text()).items():
                setattr(self, key, value)
            logger.info("Loaded env checkpoint %s", path)

    def save_checkpoint(self, step: int, data: dict[str, Any] | None = None) -> None:
        """Write ``data`` (attributes to restore) for ``step``; nothing when ``data`` is None.
        Subclasses override this to pass their state."""
        if data is None:
            return
        path = self._checkpoint_path(step)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
        logger.info("Saved env checkpoint %s", path)

    # ------------------------------------------------------------------ metrics

    def log_train_metric(self, name: str, value: float | Iterable[float]) -> None:
        """Buffer a training metric (one value or several); the next ``wandb_log`` logs the
        mean of everything buffered under ``name`` since the last one, then clears it.

        Use the full key, e.g. ``self.log_train_metric("train/percent_correct", 1.0)``; this
        replaces the "buffer, average, clear, ``super().wandb_log``" override."""
        values = [float(value)] if isinstance(value, (int, float)) else [float(v) for v in value]
        self._train_metrics.setdefault(name, []).extend(values)

    async def run_eval(
        self,
        jobs: Iterable[Awaitable[dict[str, Any]]],
        metrics: Callable[[list[dict[str, Any]]], dict[str, float]],
        *,
        generation_parameters: dict[str, Any] | None = None,
        task_name: str | None = None,
        desc: str = "eval",
    ) -> dict[str, float]:
        """The usual ``evaluate`` body: run ``jobs`` (one per eval item, each returning a
        sample dict) at most ``max_eval_workers`` at a time with a progress bar, reduce the
        samples with ``metrics``, write them with ``evaluate_log`` (which also queues them for
        W&B, once) and return the metrics."""
        start = time.time()
        samples = await gather_bounded(list(jobs), self.config.max_eval_workers, desc=desc)
        result = metrics(samples)
        await self.evaluate_log(
            result,
            task_name=task_name,
            samples=samples,
            start_time=start,
            end_time=time.time(),
            generation_parameters=generation_parameters,
        )
        return result

    # ------------------------------------------------------------------ W&B

    def _wandb_init(self, project: str | None, group: str | None, run_prefix: str) -> None:
        try:
            import wandb

            run_name = (
                f"{run_prefix}-{datetime.now().strftime('%Y-%m-%d')}-"
                f"{''.join(random.choices(string.ascii_lowercase, k=6))}"
            )
            self._wandb_run = wandb.init(
                name=run_name,
                project=project,
                group=group,
                config=self.config.model_dump(mode="json"),
                reinit=True,
            )
        except Exception as exc:  # noqa: BLE001 - W&B trouble must not stop rollouts
            logger.warning(
                "W&B could not start (%s: %s); continuing without it. Set WANDB_MODE=offline "
                "to log locally, or --env.use_wandb false to silence this.",
                type(exc).__name__,
                exc,
            )
            self.config.use_wandb = False
            self._wandb_run = None

    async def setup_wandb(self) -> None:
        """Start W&B with the project and group the trainer registered (waits for the trainer
        to register). Without a project from the trainer, ``WANDB_PROJECT`` is used; without
        either, W&B stays off for this run."""
        if not self.config.use_wandb:
            return
        while True:
            info = await self.api.request_json_patiently("GET", "/info", what="/info")
            if info.get("batch_size", -1) != -1:
                break
            logger.info("Waiting for the trainer to register before starting W&B")
            await asyncio.sleep(1.0)
        data = await self.api.request_json_patiently("GET", "/wandb_info", what="/wandb_info")
        self.wandb_group = data.get("group")
        self.wandb_project = data.get("project") or os.environ.get("WANDB_PROJECT")
        if self.wandb_project is None:
            logger.warning("The trainer set no W&B project and WANDB_PROJECT is unset: no W&B")
            self.config.use_wandb = False
            return
        self._wandb_init(self.wandb_project, self.wandb_group, self.display_name)

    async def add_rollouts_for_wandb(
        self, scored_data: ScoredDataGroup | list[ScoredDataGroup], item: Item = None
    ) -> None:
        """Keep the first ``num_rollouts_per_group_for_logging`` decoded sequences of the
        group (with scores) for the W&B rollout table (the last ``num_rollouts_to_keep``
        groups are kept)."""
        num_keep = self.config.num_rollouts_per_group_for_logging
        tokens = scored_data["tokens"]
        num_keep = len(tokens) if num_keep == -1 else min(num_keep, len(tokens))
        self.rollouts_for_wandb.append(
            [(self.tokenizer.decode(tokens[i]), scored_data["scores"][i]) for i in range(num_keep)]
        )
        if len(self.rollouts_for_wandb) > self.config.num_rollouts_to_keep:
            self.rollouts_for_wandb.pop(0)

    async def create_rollout_table(self, wandb_metrics: dict[str, Any]) -> dict[str, Any]:
        """Add the ``train/rollouts`` table (text, score) when rollouts were kept."""
        if self.rollouts_for_wandb:
            import wandb

            table = wandb.Table(columns=["text", "score"])
            for group in self.rollouts_for_wandb:
                for text, score in group:
                    table.add_data(text, score)
            wandb_metrics["train/rollouts"] = table
        return wandb_metrics

    def perf_stats(self, metrics_dict: dict[str, Any]) -> dict[str, Any]:
        """Add timing statistics (``train_perf/*``) and item counts, then reset them."""
        for name, attr in (
            ("train_perf/task_duration", "task_duration"),
            ("train_perf/succeeded_task_duration", "succeeded_task_duration"),
            ("train_perf/failed_task_duration", "failed_task_duration"),
            ("train_perf/mainloop_timings", "mainloop_timings"),
            ("train_perf/workers_added_per_attempt", "workers_added_list"),
        ):
            values = getattr(self, attr)
            if len(values) > 1:
                get_std_min_max_avg(name, values, metrics_dict)
            if attr == "succeeded_task_duration" and values:
                metrics_dict["train/items_sent_to_api"] = len(values)
            if attr == "failed_task_duration" and values:
                metrics_dict["train/items_rejected"] = len(values)
            setattr(self, attr, [])
        for reason, count in self.drop_counts.items():
            metrics_dict[f"train/dropped_{reason}"] = count
        metrics_dict["train/retried_rollouts"] = self.retried_rollouts
        return metrics_dict

    async def wandb_log(self, wandb_metrics: dict[str, Any] | None = None) -> None:
        """Log ``wandb_metrics`` plus the env's own metrics to W&B at ``curr_step``.

        Subclasses add their keys, then call ``super().wandb_log(wandb_metrics)``. Env keys
        are prefixed ``{wandb_prepend}_``; every server's metrics are added unprefixed.
        Buffers are cleared even when W&B is off.
        """
        wandb_metrics = {} if wandb_metrics is None else dict(wandb_metrics)
        for name, values in self._train_metrics.items():
            if values:
                wandb_metrics.setdefault(name, sum(values) / len(values))
        self._train_metrics = {}
        for name, value in self.eval_metrics:
            wandb_metrics.setdefault(name, value)
        self.eval_metrics = []
        server_metrics: dict[str, Any] = {}
        for i, server in enumerate(self.server.servers):
            metrics_fn = getattr(server, "wandb_metrics", None)
            if metrics_fn is not None:
                server_metrics.update(await metrics_fn({}, f"server_{i}") or {})
        if self.completion_lengths:
            lengths = [float(x) for x in self.completion_lengths]
            mean = sum(lengths) / len(lengths)
            wandb_metrics["train/completion_lengths"] = mean
            wandb_metrics["train/completion_lengths_std"] = math.sqrt(
                sum((x - mean) ** 2 for x in lengths) / len(lengths)
            )
            wandb_metrics["train/completion_lengths_max"] = max(lengths)
            wandb_metrics["train/completion_lengths_min"] = min(lengths)
            if self.max_token_len > 0:
                # upstream's name: the fraction of completions above 95% of the budget
                wandb_metrics["train/completion_lengths_p95"] = sum(
                    x > 0.95 * self.max_token_len for x in lengths
                ) / len(lengths)
        if self.config.use_wandb and self._wandb_run is not None:
            wandb_metrics = await self.create_rollout_table(wandb_metrics)
        wandb_metrics = self.perf_stats(wandb_metrics)
        self.rollouts_for_wandb = []
        self.completion_lengths = []
        if self.config.use_wandb and self._wandb_run is not None:
            if self.wandb_prepend is not None:
                wandb_metrics = {f"{self.wandb_prepend}_{k}": v for k, v in wandb_metrics.items()}
            wandb_metrics.update(server_metrics)
            try:
                self._wandb_run.log(wandb_metrics, step=self.curr_step)
            except Exception as exc:  # noqa: BLE001
                logger.warning("W&B log failed: %s", exc)

    # ------------------------------------------------------------------ evaluation output

    async def evaluate_log(
        self,
        metrics: dict[str, Any],
        task_name: str | None = None,
        model_name: str | None = None,
        start_time: float | None = None,
        end_time: float | None = None,
        generation_parameters: dict[str, Any] | None = None,
        samples: list[dict[str, Any]] | None = None,
        verbose: bool = True,
    ) -> None:
        """Write ``metrics.json`` (and ``samples.jsonl``) to ``data_dir_to_save_evals``.

        ``task_name`` defaults to ``{name}_eval``; ``model_name`` to the config's
        ``model_name`` or the first server's; ``generation_parameters`` are laid over
        ``{"max_new_tokens": max_token_length}``. The numeric metrics are queued in
        ``eval_metrics`` for the next ``wandb_log`` (logged once).
        """
        self._evaluate_logged = True
        if task_name is None:
            task_name = f"{self.name or type(self).__name__}_eval"
        if model_name is None:
            model_name = getattr(self.config, "model_name", None)
            if model_name is None and self.server.servers:
                model_name = getattr(
                    getattr(self.server.servers[0], "config", None), "model_name", None
                )
        params = {"max_new_tokens": self.config.max_token_length, **(generation_parameters or {})}
        if self.config.data_dir_to_save_evals is None:
            logger.warning("data_dir_to_save_evals is not set, skipping evaluation logging")
        else:
            _evaluate_log(
                metrics,
                eval_dir=self.config.data_dir_to_save_evals,
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
        self.eval_metrics.extend((k, v) for k, v in metrics.items() if isinstance(v, (int, float)))

    # ------------------------------------------------------------------ API: registration

    async def _register_env(self) -> dict[str, Any]:
        payload = {
            "max_token_length": self.config.max_token_length,
            "desired_name": self.display_name,
            "weight": self.config.inference_weight,
            "min_batch_allocation": self.config.min_batch_allocation,
            "group_size": self.config.group_size,
        }
        return await self.api.request_json_patiently(
            "POST", "/register-env", payload, what="/register-env"
        )

    async def register_env(self) -> None:
        """Join the run: POST ``/register-env`` until the API says ``success`` (it answers
        "wait" until the trainer has fetched its first batch). API outages are waited out."""
        waited = 0
        while True:
            data = await self._register_env()
            if data.get("status") == "success":
                break
            if waited % 10 == 0:
                logger.info("Waiting to register the env (API status: %s)", data.get("status"))
            waited += 1
            await asyncio.sleep(1.0)
        self.env_id = data["env_id"]
        self.wandb_prepend = data.get("wandb_name")
        self.curr_step = data.get("starting_step", 0)
        self.checkpoint_dir = data.get("checkpoint_dir") or ""
        self.checkpoint_interval = data.get("checkpoint_interval", -1)
        if self.config.total_steps == -1:
            self.config.total_steps = data.get("num_steps", -1)
            if self.config.total_steps == -1:
                raise ValueError(
                    "total_steps is -1 and the trainer registered no num_steps: set "
                    "--env.total_steps"
                )
        logger.info(
            "Registered env %s as id %s (%s): step %s, checkpoint_dir %r, interval %s",
            self.display_name,
            self.env_id,
            self.wandb_prepend,
            self.curr_step,
            self.checkpoint_dir,
            self.checkpoint_interval,
        )
        if self.curr_step > 0:
            self.load_checkpoint()

    async def _reregister(self, stale_env_id: int | None) -> None:
        """Register again after the API forgot ``stale_env_id`` (restart without a store).
        Concurrent callers share one registration."""
        if self._register_lock is None:
            self._register_lock = asyncio.Lock()
        async with self._register_lock:
            if self.env_id != stale_env_id:
                return
            logger.warning(
                "The API does not know env id %s any more; registering again", stale_env_id
            )
            self.status_dict = None
            await self.register_env()
            await self.get_server_info()

    async def get_server_info(self) -> None:
        """Read the trainer's ``batch_size`` and ``max_token_len`` from ``/info``."""
        data = await self.api.request_json_patiently("GET", "/info", what="/info")
        if data.get("batch_size", -1) != -1:
            self.config.batch_size = data["batch_size"]
        if data.get("max_token_len", -1) != -1:
            self.max_token_len = data["max_token_len"]
        if data.get("batch_size", -1) != -1 and data.get("max_token_len", -1) <= 0:
            # A registered trainer sent max_token_len <= 0: upstream's way of asking for no
            # length limit. Kept (upstream trainers may rely on it), but said once, not silently.
            logger.warning(
                "the trainer registered max_token_len=%s: no length limit is applied, groups of "
                "any length are sent (upstream's 'ignore max length'); set the trainer's maximum "
                "sequence length to a positive number to have overlong groups dropped here",
                data.get("max_token_len"),
            )
        if self.config.batch_size == -1:
            logger.warning("Batch size not set by config or server!")
        elif self.config.group_size > self.config.batch_size:
            raise ValueError(
                f"group_size ({self.config.group_size}) must not be larger than the trainer's "
                f"batch_size ({self.config.batch_size})"
            )

    async def get_status(self) -> None:
        """Poll ``/status-env`` (GET with a JSON body, as upstream's API expects), update
        ``status_dict``, the worker cap and this env's inference weight."""
        env_id = self.env_id
        try:
            status = await self.api.request_json_patiently(
                "GET", "/status-env", {"env_id": env_id}, what="/status-env"
            )
        except UnknownEnvError:
            await self._reregister(env_id)
            return
        self.status_dict = status
        self._sent_since_status = 0
        self.max_num_workers = self._resolve_max_workers()
        weight = status.get("env_weight")
        if weight is not None:
            await self.server.update_weight(weight)

    async def _disconnect(self) -> None:
        if self.env_id is None:
            return
        try:
            await self.api.request_json(
                "POST", "/disconnect-env", {"env_id": self.env_id}, timeout=5
            )
            logger.info("Disconnected env %s from the API", self.env_id)
        except Exception as exc:  # noqa: BLE001 - leaving anyway
            logger.warning("Could not disconnect from the API: %r", exc)

    # ------------------------------------------------------------------ API: sending

    async def handle_send_to_api(
        self,
        scored_data: ScoredDataGroup | list[ScoredDataGroup | None] | None,
        item: Item = None,
        do_send_to_api: bool = True,
        abort_on_any_max_length_exceeded: bool = True,
    ) -> list[ScoredDataGroup]:
        """Check groups, record them (W&B buffer, JSONL file) and send the valid ones.

        Checks, in order (a failing group is dropped and counted in ``drop_counts``):
        ``tokens``/``masks``/``scores`` present and of equal length (``malformed``); size equal
        to ``group_overrides.group_size`` or ``config.group_size`` (``group_size``); not all
        scores identical when ``ensure_scores_are_not_same`` and the group has 2+ sequences
        (``same_scores``); no sequence of ``max_token_len`` tokens or more when the trainer set
        one and ``abort_on_any_max_length_exceeded`` (``too_long``).

        Returns:
            The valid groups (sent when ``do_send_to_api``; a failed send is counted as
            ``send_failed`` or ``refused`` and logged, never raised).
        """
        was_list = isinstance(scored_data, list)
        groups = scored_data if was_list else [scored_data]
        valid: list[ScoredDataGroup] = []
        for group in groups:
            if group is None:
                continue
            reason = self._check_group(group, abort_on_any_max_length_exceeded)
            if reason is not None:
                self.drop_counts[reason] += 1
                continue
            for key in ("ref_logprobs", "overrides", "group_overrides"):
                group.setdefault(key, None)
            group.setdefault("distill_token_ids", None)
            group.setdefault("distill_logprobs", None)
            if self.config.include_messages and group.get("messages") is None:
                group["messages"] = [
                    [{"role": "user", "content": self.tokenizer.decode(seq)}]
                    for seq in group["tokens"]
                ]
            if self.config.use_wandb and self._wandb_run is not None:
                await self.add_rollouts_for_wandb(group, item)
            if self.jsonl_writer is not None:
                # the trainer step the group was made at, for the rollout page's headers
                self.jsonl_writer.write({**group, "step": self.curr_step})
            valid.append(group)
        if valid and do_send_to_api:
            self.items_sent_this_step += len(valid)
            payload: Any = valid[0] if not was_list and len(valid) == 1 else valid
            try:
                await self._send_scored_data_to_api(payload)
            except Exception as exc:  # noqa: BLE001 - counted and logged, never raised
                self._log_send_failure(exc, len(valid))
        return valid

    def _check_group(self, group: dict, abort_on_too_long: bool) -> str | None:
        tokens = group.get("tokens")
        if not isinstance(tokens, list) or not tokens:
            logger.warning("Dropping a group without tokens: %s", str(group)[:200])
            return "malformed"
        for key in REQUIRED_KEYS[1:]:  # masks, scores: one entry per token list
            values = group.get(key)
            if not isinstance(values, list) or len(values) != len(tokens):
                logger.warning(
                    "Dropping a group whose %r (%s) does not match its %d token lists",
                    key,
                    "missing" if values is None else f"{len(values)} entries",
                    len(tokens),
                )
                return "malformed"
        overrides = group.get("group_overrides") or {}
        expected = overrides.get("group_size", self.config.group_size)
        if len(tokens) != expected:
            logger.warning(
                "Dropping a group of %d sequences (expected group_size %d)", len(tokens), expected
            )
            return "group_size"
        scores = group["scores"]
        if self.config.ensure_scores_are_not_same and len(scores) > 1 and len(set(scores)) == 1:
            logger.debug("Dropping a group whose scores are all %s", scores[0])
            self._report_flat_groups()
            return "same_scores"
        for mask in group["masks"]:
            self.completion_lengths.append(sum(1 for m in mask if m != -100))
        if self.max_token_len > 0 and abort_on_too_long:
            longest = max(len(seq) for seq in tokens)
            if longest >= self.max_token_len:
                logger.warning(
                    "Dropping a group with a sequence of %d tokens (trainer max_token_len %d)",
                    longest,
                    self.max_token_len,
                )
                return "too_long"
        return None

    def _report_flat_groups(self, every: float = 30.0) -> None:
        """At most every ``every`` seconds, say how many groups were dropped for scoring
        alike: while most are, a trainer waits long for each batch and this is why."""
        since, reported = self._flat_report
        now, total = time.monotonic(), self.drop_counts["same_scores"] + 1
        if now - since >= every:
            logger.info(
                "%d group(s) dropped in the last %.0f s: all replies scored alike, no learning "
                "signal (ensure_scores_are_not_same); %d sent so far",
                total - reported,
                now - since,
                self.groups_sent,
            )
            self._flat_report = (now, total)

    def _log_send_failure(self, exc: BaseException, n_groups: int) -> None:
        if isinstance(exc, ApiRefused):
            self.drop_counts["refused"] += n_groups
            logger.error("The API refused %d group(s): %s", n_groups, exc)
        else:
            self.drop_counts["send_failed"] += n_groups
            logger.error(
                "Failed to send %d group(s): %s",
                n_groups,
                exc,
                exc_info=(type(exc), exc, exc.__traceback__),
            )

    async def _send_scored_data_to_api(self, scored_data: dict | list[dict]) -> None:
        """Send one group (``/scored_data``) or several (``/scored_data_list``), stamped with
        ``env_id``. Concurrent sends are coalesced into one request.

        Raises:
            ApiRefused: The API refused the data (4xx).
            TimeoutError: The API stayed unreachable, failing or full for ``send_timeout``.
        """
        groups = scored_data if isinstance(scored_data, list) else [scored_data]
        future = asyncio.get_running_loop().create_future()
        self._send_pending.append((groups, future))
        if self._sender_task is None or self._sender_task.done():
            self._sender_task = asyncio.create_task(self._sender_loop())
        await future

    async def _sender_loop(self) -> None:
        while self._send_pending:
            take: list[tuple[list[dict], asyncio.Future]] = []
            n = 0
            while self._send_pending and (
                not take or n + len(self._send_pending[0][0]) <= MAX_GROUPS_PER_POST
            ):
                entry = self._send_pending.pop(0)
                take.append(entry)
                n += len(entry[0])
            if len(take) > 1 and await self._try_post_once([g for gs, _ in take for g in gs]):
                for _, fut in take:
                    _settle(fut, None)
                self._count_sent(n)
                continue
            # one submission, or a combined request the API did not take at once (full queue,
            # refused data, outage): each submission on its own, with full retry handling, so
            # one bad group or a queue too small for the whole list never holds up the rest
            for groups, fut in take:
                try:
                    await self._post_groups(groups)
                except Exception as exc:  # noqa: BLE001 - handed to the waiting worker
                    _settle(fut, exc)
                else:
                    _settle(fut, None)
                    self._count_sent(len(groups))

    def _count_sent(self, n_groups: int) -> None:
        self.groups_sent += n_groups
        self._sent_since_status += n_groups

    async def _try_post_once(self, groups: list[dict]) -> bool:
        """One ``/scored_data_list`` attempt with no retry; whether the API took it."""
        for group in groups:
            group["env_id"] = self.env_id
        body, headers = encode_json_body(groups)
        try:
            resp = await self.api.client.post("/scored_data_list", content=body, headers=headers)
        except httpx.TransportError:
            return False
        return resp.status_code < 300

    async def _post_groups(self, groups: list[dict]) -> None:
        deadline = time.monotonic() + self.config.send_timeout
        while True:
            env_id = self.env_id
            for group in groups:
                group["env_id"] = env_id
            path = "/scored_data" if len(groups) == 1 else "/scored_data_list"
            payload = groups[0] if len(groups) == 1 else groups
            try:
                await self.api.send(path, payload, max(1.0, deadline - time.monotonic()))
                return
            except UnknownEnvError:
                if time.monotonic() > deadline:
                    raise TimeoutError("the API kept forgetting this env") from None
                await self._reregister(env_id)

    # ------------------------------------------------------------------ rollouts

    def _spawn(self, item: Item, attempts: int = 0) -> None:
        item_uuid = str(uuid.uuid4())
        task = asyncio.create_task(self.handle_env(item_uuid))
        self.running_items[item_uuid] = {
            "item": item,
            "worker": task,
            "start_time": time.time(),
            "attempts": attempts,
            "sending": False,
        }
        self.workers.add(task)
        task.add_done_callback(partial(self._worker_done, item))

    def _worker_done(self, item: Item, task: asyncio.Task) -> None:
        self.workers.discard(task)
        if task.cancelled():
            pass
        elif task.exception() is not None:
            exc = task.exception()
            self.drop_counts["error"] += 1
            logger.error("Rollout worker failed", exc_info=(type(exc), exc, exc.__traceback__))
        elif task.result():
            self.last_completed_item = item
        if self._wake is not None:
            self._wake.set()

    def _retry_or_drop(self, entry: dict[str, Any], reason: str, detail: str) -> None:
        attempts = entry["attempts"] + 1
        if attempts <= self.config.rollout_retries:
            self.retried_rollouts += 1
            logger.warning(
                "Rollout %s (attempt %d of %d); retrying:\n%s",
                reason,
                attempts,
                self.config.rollout_retries + 1,
                detail,
            )
            self._retry_queue.append((entry["item"], attempts))
        else:
            self.drop_counts[reason] += 1
            logger.error(
                "Rollout %s %d times; giving up on item %s:\n%s",
                reason,
                attempts,
                str(entry["item"])[:200],
                detail,
            )

    async def handle_env(self, item_uuid: str) -> ScoredDataGroup | list | None:
        """Roll out one running item: collect, postprocess, send, clean up.

        An exception in collection or postprocessing retries the item (up to
        ``rollout_retries`` times), then counts it as ``error`` with its traceback.
        """
        entry = self.running_items.get(item_uuid)
        if entry is None:
            logger.warning("item %s not found", item_uuid)
            return None
        item = entry["item"]
        start = time.time()
        try:
            to_postprocess, to_backlog = await self.collect_trajectories(item)
            if to_backlog:
                self.backlog.extend(to_backlog)
            if to_postprocess:
                to_postprocess = await self.postprocess_histories(to_postprocess)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - retried, then counted with the traceback
            self.running_items.pop(item_uuid, None)
            self._retry_or_drop(entry, "error", traceback.format_exc())
            self.failed_task_duration.append(time.time() - start)
            return None
        duration = max(0.0, time.time() - start)
        self.task_duration.append(duration)
        entry["sending"] = True
        try:
            if to_postprocess:
                self.task_successful.append(1)
                self.succeeded_task_duration.append(duration)
                await self.handle_send_to_api(to_postprocess, item)
            else:
                self.task_successful.append(0)
                self.failed_task_duration.append(duration)
            await self.cleanup()
        finally:
            self.running_items.pop(item_uuid, None)
        return to_postprocess

    def _reap_timeouts(self) -> None:
        timeout = self.config.worker_timeout
        if timeout <= 0:
            return
        now = time.time()
        for item_uuid, entry in list(self.running_items.items()):
            if entry["sending"] or now - entry["start_time"] <= timeout:
                continue
            self.running_items.pop(item_uuid, None)
            entry["worker"].cancel()
            self.workers.discard(entry["worker"])
            self._retry_or_drop(
                entry, "timeout", f"no result after {now - entry['start_time']:.1f}s"
            )

    def _effective_status(self) -> dict[str, Any]:
        status = dict(self.status_dict or {})
        status.setdefault("current_step", self.curr_step)
        status.setdefault("queue_size", 0)
        # groups sent since the last poll are in the queue even if the poll does not say so
        status["queue_size"] = int(status["queue_size"]) + self._sent_since_status
        return status

    def _is_paused(self, status: dict[str, Any]) -> bool:
        if self.status_dict is None:
            return True
        return throttle.queue_is_full(
            status,
            self.config.group_size,
            self.config.batch_size,
            self.config.max_batches_offpolicy,
            self.config.min_batch_allocation,
            self.derived_batch_size,
        )

    async def add_train_workers(self) -> None:
        """Start rollouts up to the current cap (retried items first, then the backlog
        (newest first), then ``get_next_item()``). Never cancels running ones."""
        status = self._effective_status()
        cap = self.max_num_workers
        if self.eval_runner is not None and not self.eval_runner.done():
            if self.config.eval_handling == EvalHandlingEnum.STOP_TRAIN:
                return
            if self.config.eval_handling == EvalHandlingEnum.LIMIT_TRAIN:
                cap = int(cap * self.config.eval_limit_ratio)
        if self.config.batch_size > 0:
            cap = min(
                cap,
                throttle.train_worker_cap(
                    cap,
                    status,
                    self.config.group_size,
                    self.config.batch_size,
                    self.config.max_batches_offpolicy,
                    self.config.min_batch_allocation,
                    self.derived_batch_size,
                )
                if self.status_dict is not None
                else cap,
            )
        added = 0
        while len(self.workers) < cap:
            if self._retry_queue:
                item, attempts = self._retry_queue.popleft()
            elif self.backlog:
                item, attempts = self.backlog.pop(), 0
            else:
                item, attempts = await self.get_next_item(), 0
                if item is None:
                    break
            self._spawn(item, attempts)
            added += 1
        if added:
            self.workers_added_list.append(added)

    async def env_step_checks(self) -> None:
        """On a new trainer step: start an eval or a checkpoint when a multiple of
        ``steps_per_eval`` / ``checkpoint_interval`` was crossed, and log to W&B."""
        if self.status_dict is None:
            return
        new_step = int(self.status_dict["current_step"])
        if new_step == self.curr_step:
            return
        old_step = self.curr_step
        if throttle.crossed_multiple(old_step, new_step, self.config.steps_per_eval):
            if self.eval_runner is None or self.eval_runner.done():
                logger.info("Step %d: starting evaluate()", new_step)
                self.eval_runner = asyncio.create_task(self.evaluate())
                self.eval_runner.add_done_callback(_log_eval_result)
            else:
                logger.warning(
                    "The previous eval is still running; skipping the eval at step %d", new_step
                )
        if throttle.crossed_multiple(old_step, new_step, self.checkpoint_interval):
            self.save_checkpoint((new_step // self.checkpoint_interval) * self.checkpoint_interval)
        self.curr_step = new_step
        if self.items_sent_this_step >= self.config.min_items_sent_before_logging:
            self.items_sent_this_step = 0
            await self.wandb_log({})

    def _should_stop(self) -> bool:
        if self.status_dict is None or self.config.batch_size <= 0:
            return False
        projected = throttle.projected_step(
            self._effective_status(), self.config.group_size, self.config.batch_size
        )
        return projected >= self.config.total_steps

    async def env_manager(self) -> None:
        """``serve``: setup, W&B, register, then roll out until ``total_steps`` is covered.
        Returns after disconnecting from the API; always stops its rollouts and clients."""
        try:
            await self.setup()
            await self.setup_wandb()
            await self.register_env()
            await self.get_server_info()
            await self._main_loop()
        finally:
            await self._shutdown()

    async def _main_loop(self) -> None:
        self._wake = asyncio.Event()
        next_poll = 0.0
        while True:
            now = time.monotonic()
            if self.last_loop_time is not None:
                self.mainloop_timings.append(max(0.0, time.time() - self.last_loop_time))
            self.last_loop_time = time.time()
            if now >= next_poll:
                await self.get_status()
                next_poll = time.monotonic() + STATUS_POLL_INTERVAL
                await self.env_step_checks()
            if self._should_stop():
                logger.info(
                    "Enough data for total_steps=%d is queued or trained on; stopping",
                    self.config.total_steps,
                )
                return
            if not self._is_paused(self._effective_status()):
                await self.add_train_workers()
            self._reap_timeouts()
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.0, next_poll - time.monotonic()))
            except asyncio.TimeoutError:
                pass

    async def _shutdown(self) -> None:
        tasks = list(self.workers)
        for task in tasks:
            task.cancel()
        if self.eval_runner is not None and not self.eval_runner.done():
            self.eval_runner.cancel()
            tasks.append(self.eval_runner)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self.workers = set()
        self.running_items = {}
        if self._sender_task is not None and not self._sender_task.done():
            self._sender_task.cancel()
            await asyncio.gather(self._sender_task, return_exceptions=True)
        await self._disconnect()
        if self._api is not None:
            await self._api.aclose()
        if self.jsonl_writer is not None:
            self.jsonl_writer.close()
        close = getattr(self.server, "close", None)
        if close is not None:
            try:
                await close()
            except Exception as exc:  # noqa: BLE001
                logger.debug("closing servers: %s", exc)
        if self._wandb_run is not None:
            try:
                self._wandb_run.finish()
            except Exception as exc:  # noqa: BLE001
                logger.debug("wandb finish: %s", exc)
            self._wandb_run = None
        logger.info(
            "Env stopped: %d groups sent, %d rollouts retried, dropped: %s",
            self.groups_sent,
            self.retried_rollouts,
            dict(self.drop_counts) or "none",
        )

    # ------------------------------------------------------------------ process / evaluate

    async def process_manager(self) -> None:
        """``process``: roll out ``n_groups_to_process`` groups (default ``total_steps``)
        without API or trainer, write them to ``data_path_to_save_groups`` and the matching
        ``.html``, with a progress bar. Up to ``max_num_workers`` items run at once."""
        from tqdm import tqdm

        from atroposlib.frontend.jsonl2html import generate_html

        await self.setup()
        if self.config.use_wandb:
            self._wandb_init(
                os.environ.get("WANDB_PROJECT"), self.wandb_group, self.name or "process"
            )
        target = getattr(self, "n_groups_to_process", self.config.total_steps)
        group_size = getattr(self, "group_size_to_process", self.config.group_size)
        self.config.group_size = group_size
        self.curr_step = 0
        done = 0
        failures = 0
        max_failures = max(10, target * (self.config.rollout_retries + 1))
        running: set[asyncio.Task] = set()
        exhausted = False
        bar = tqdm(total=target, desc=f"{self.name or type(self).__name__}", unit="group")
        try:
            while done < target:
                while not exhausted and len(running) < min(self.max_num_workers, target - done):
                    item = await self.get_next_item()
                    if item is None:
                        exhausted = True
                        break
                    running.add(asyncio.create_task(self._process_one(item)))
                if not running:
                    break
                finished, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    written = task.result()
                    if written and done < target:
                        done += 1
                        self.curr_step = done
                        bar.update(1)
                        await self.wandb_log()
                    elif not written:
                        failures += 1
                if failures > max_failures:
                    logger.error("Giving up after %d items produced no valid group", failures)
                    break
        finally:
            for task in running:
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)
            bar.close()
            if self.jsonl_writer is not None:
                self.jsonl_writer.close()
            if self._wandb_run is not None:
                self._wandb_run.finish()
                self._wandb_run = None
            # the servers' HTTP clients (aiohttp warns about unclosed sessions at exit)
            close = getattr(self.server, "close", None)
            if close is not None:
                await close()
        logger.info("Processed %d of %d groups", done, target)
        path = self.config.data_path_to_save_groups
        if path is not None and Path(path).exists():
            html = generate_html(path)
            print(f"Wrote {done} groups to {path} and {html}")

    async def _process_one(self, item: Item) -> int:
        for attempt in range(self.config.rollout_retries + 1):
            try:
                groups, _ = await self.collect_trajectories(item)
                if not groups:
                    return 0
                groups = await self.postprocess_histories(groups)
                valid = await self.handle_send_to_api(
                    groups, item, do_send_to_api=False, abort_on_any_max_length_exceeded=False
                )
                return len(valid)
            except Exception:  # noqa: BLE001
                self._retry_or_drop(
                    {"item": item, "attempts": attempt}, "error", traceback.format_exc()
                )
                if attempt >= self.config.rollout_retries:
                    return 0
        return 0

    async def _run_evaluate(self) -> None:
        """``evaluate``: ``setup()`` then ``evaluate()``; a returned metrics dict that the env
        did not log itself goes through ``evaluate_log``."""
        await self.setup()
        start = time.time()
        result = await self.evaluate()
        if isinstance(result, dict) and result and not self._evaluate_logged:
            await self.evaluate_log(result, start_time=start, end_time=time.time())
        close = getattr(self.server, "close", None)
        if close is not None:
            await close()

    # ------------------------------------------------------------------ CLI

    @classmethod
    def cli(cls) -> None:
        """Command line: ``python env.py serve|process|evaluate [--env.X v] [--openai.X v]
        [--config f.yaml] [--slurm] [--testing]`` (``--help`` lists every flag)."""
        from atroposlib.envs.cli import run_cli

        raise SystemExit(run_cli(cls))


def _free_path(path: Path) -> Path:
    """``path``, or the first of ``stem_1``, ``stem_2``... that does not exist."""
    candidate, counter = path, 1
    while candidate.exists():
        candidate = path.with_stem(f"{path.stem}_{counter}")
        counter += 1
    return candidate


def _settle(future: asyncio.Future, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)


def _log_eval_result(task: asyncio.Task) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        logger.error("evaluate() failed", exc_info=(type(exc), exc, exc.__traceback__))
