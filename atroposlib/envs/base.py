"""``BaseEnv``: the contract an environment implements.

Write an environment
--------------------
Subclass ``BaseEnv`` and implement:

* ``setup()``: load data, build anything the env needs (called once, before any rollout).
* ``get_next_item()``: the next item to roll out, or None to start no new rollout now.
* ``collect_trajectories(item)``: ``(group, backlog)``: a ``ScoredDataGroup`` (or a list of
  them, or None to send nothing) and items to roll out later. *Or* implement
  ``collect_trajectory(item)`` returning ``(ScoredDataItem | None, backlog)``; the default
  ``collect_trajectories`` runs it ``group_size`` times concurrently and builds the group.
* ``evaluate()``: run an evaluation; ``self.run_eval(jobs, metrics)`` is the usual body.

Optional hooks: ``config_init()`` (classmethod: default ``(env_config, server_configs)``),
``postprocess_histories(groups)``, ``cleanup()`` (after each item), ``wandb_log(metrics)``
(add your keys, then call ``super().wandb_log(metrics)``; or just call
``self.log_train_metric(name, value)`` anywhere), ``save_checkpoint(step, data)``.

Class attributes: ``name`` (file and W&B names; defaults the API name), ``env_config_cls``
(your ``BaseEnvConfig`` subclass), ``server_cls`` (the default ``APIServer`` means "choose
by ``server_type``"). Inside a rollout use ``self.server`` (a ``ServerManager``),
``self.tokenizer`` and ``self.config``.

Tokens and masks
----------------
A group holds, per sequence, ``tokens`` (the whole conversation) and ``masks`` (the same ids
where the trainer learns, ``-100`` on the prompt), plus ``scores``. The rollout toolkit in
:mod:`atroposlib.envs.rollout` makes them, from a token server (exact ids and ``logprobs``) or
from a plain OpenAI endpoint (re-tokenized, no logprobs), with one call::

    from atroposlib.envs.rollout import sample_chat_group

    async def collect_trajectories(self, item):
        messages = [{"role": "user", "content": item["question"]}]
        samples = await sample_chat_group(
            self, messages, n=self.config.group_size, max_tokens=256, temperature=1.0
        )  # list[Sample]: text, finish_reason, tokens, masks, logprobs, messages
        group = ScoredDataGroup(
            tokens=[s.tokens for s in samples],
            masks=[s.masks for s in samples],
            scores=[1.0 if item["answer"] in s.text else 0.0 for s in samples],
            messages=[s.messages for s in samples],
        )
        return group, []

For several turns (tool calls, games) a ``ChatSession`` from the same module keeps the
conversation and its tokens/masks across turns.

Run it with ``YourEnv.cli()``: ``python your_env.py serve|process|evaluate|check --help``.

Where the runtime lives
-----------------------
The runtime methods keep upstream's names and delegate to :mod:`~atroposlib.envs.runtime`
(the ``serve`` loop), :mod:`~atroposlib.envs.registration` (joining the run),
:mod:`~atroposlib.envs.group_sender` (checking and sending groups),
:mod:`~atroposlib.envs.wandb_logging` and :mod:`~atroposlib.envs.process` (``process`` and
``evaluate``), which call the env's methods through the instance: overrides take effect.
What ``serve`` guarantees:

* Registration with the trajectory API is retried until the trainer has started; a restarted
  API (the env id unknown) is re-registered transparently and nothing in flight is lost.
* When the API's queue holds ``max_batches_offpolicy`` batches, *new* rollouts pause;
  rollouts already running finish and are sent (sending waits out ``429 Retry-After``).
* A rollout that raises or exceeds ``worker_timeout`` is retried ``rollout_retries`` times,
  then dropped and logged with its traceback.
* Every dropped group is counted by reason (``drop_counts``) and logged to W&B.
* When the queued data covers ``total_steps``, the env stops its rollouts, disconnects from
  the API and ``env_manager()`` returns.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from atroposlib.envs import throttle
from atroposlib.envs.config import BaseEnvConfig, EvalHandlingEnum
from atroposlib.envs.eval import log_env_evaluation, run_env_eval
from atroposlib.envs.group_sender import GroupSender, group_from_trajectories
from atroposlib.envs.options import SERVER_MANAGER_OPTIONS
from atroposlib.envs.process import process, run_evaluate
from atroposlib.envs.registration import Registration
from atroposlib.envs.runtime import ServeLoop
from atroposlib.envs.selective import FlatItemFilter
from atroposlib.envs.sending import JsonlWriter, RolloutApiClient
from atroposlib.envs.server_handling.server_baseline import (
    APIServer,
    APIServerConfig,
    ReasoningConfig,
    ServerBaseline,
)
from atroposlib.envs.server_handling.server_manager import ServerManager, ServerManagerConfig
from atroposlib.envs.tokenizers import (
    load_tokenizer,
    resolve_tokenizer_name,
    with_server_tokenizers,
)
from atroposlib.envs.wandb_logging import WandbLogging
from atroposlib.schema import ScoredDataGroup, ScoredDataItem
from atroposlib.type_definitions import Item

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


class _Owned:
    """A ``BaseEnv`` attribute whose value lives on one of the env's runtime objects (named by
    ``owner``, e.g. ``_group_sender``): ``env.drop_counts`` reads and writes
    ``env._group_sender.drop_counts``. Upstream code keeps its attribute names; the state
    has one owner."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.name = ""

    def __set_name__(self, cls: type, name: str) -> None:
        self.name = name

    def __get__(self, env: Any, cls: type | None = None) -> Any:
        if env is None:
            return self
        try:
            owner = env.__dict__[self.owner]
        except KeyError:
            raise AttributeError(
                f"{type(env).__name__}.{self.name} is not set until BaseEnv.__init__ has run"
            ) from None
        return getattr(owner, self.name)

    def __set__(self, env: Any, value: Any) -> None:
        try:
            owner = env.__dict__[self.owner]
        except KeyError:
            raise AttributeError(
                f"{type(env).__name__}.{self.name} can be set once BaseEnv.__init__ has run "
                "(call super().__init__ first)"
            ) from None
        setattr(owner, self.name, value)


class BaseEnv(ABC):
    """Base class of every environment (see the module docstring for the contract)."""

    #: Used for process-mode file names, the W&B run name and the default ``wandb_name``.
    name: str | None = None
    #: The config class of this env (``config_init`` returns an instance of it).
    env_config_cls: type[BaseEnvConfig] = BaseEnvConfig
    #: Server client class; the abstract ``APIServer`` means "choose by ``server_type``".
    server_cls: type[APIServer] = APIServer
    #: The inference servers ``config_init`` gives (copied each time), e.g.
    #: ``local_server_configs()`` for the embedded ``atropos-serve``; None: upstream's
    #: ``ServerBaseline()``.
    default_server_configs: list[APIServerConfig] | ServerBaseline | None = None

    # Upstream's runtime attributes, readable and writable on the env as upstream code uses
    # them; their values live on the runtime object that owns them.
    # the run, as the API told it (registration.py)
    env_id = _Owned("_registration")
    status_dict = _Owned("_registration")
    curr_step = _Owned("_registration")
    max_token_len = _Owned("_registration")
    checkpoint_dir = _Owned("_registration")
    checkpoint_interval = _Owned("_registration")
    wandb_project = _Owned("_registration")
    wandb_group = _Owned("_registration")
    wandb_prepend = _Owned("_registration")
    _sent_since_status = _Owned("_registration")
    # rollouts and their timings (runtime.py)
    workers = _Owned("_serve_loop")
    running_items = _Owned("_serve_loop")
    backlog = _Owned("_serve_loop")
    eval_runner = _Owned("_serve_loop")
    retried_rollouts = _Owned("_serve_loop")
    task_duration = _Owned("_serve_loop")
    succeeded_task_duration = _Owned("_serve_loop")
    failed_task_duration = _Owned("_serve_loop")
    mainloop_timings = _Owned("_serve_loop")
    workers_added_list = _Owned("_serve_loop")
    # what was sent and dropped (group_sender.py)
    drop_counts = _Owned("_group_sender")
    groups_sent = _Owned("_group_sender")
    items_sent_this_step = _Owned("_group_sender")
    _flat_report = _Owned("_group_sender")
    # W&B buffers (wandb_logging.py)
    rollouts_for_wandb = _Owned("_wandb_logging")
    completion_lengths = _Owned("_wandb_logging")
    eval_metrics = _Owned("_wandb_logging")
    _evaluate_logged = _Owned("_wandb_logging")

    def __init__(
        self,
        config: BaseEnvConfig,
        server_configs: ServerBaseline | APIServerConfig | list[APIServerConfig],
        slurm: bool = False,
        testing: bool = False,
    ) -> None:
        self.config = config
        options = SERVER_MANAGER_OPTIONS.get() or {}
        self.tokenizer = load_tokenizer(config.tokenizer_name)
        self.server = ServerManager(
            with_server_tokenizers(server_configs, config.tokenizer_name),
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
        # the runtime, in its own modules; each owns its state (below, the upstream attribute
        # names that read and write it) and calls this env's methods through ``self``
        self._registration = Registration(self)
        self._group_sender = GroupSender(self)
        self._wandb_logging = WandbLogging(self)
        self._serve_loop = ServeLoop(self)
        self.max_num_workers = self._resolve_max_workers()
        self._api: RolloutApiClient | None = None
        #: Where ``process`` (or ``serve`` with ``data_path_to_save_groups``) writes groups.
        self.jsonl_writer: JsonlWriter | None = None
        if config.data_path_to_save_groups is not None:
            self.jsonl_writer = JsonlWriter.at_free_path(config.data_path_to_save_groups)
            self.config.data_path_to_save_groups = str(self.jsonl_writer.path)

    # ------------------------------------------------------------------ construction helpers

    #: ``tokenizer_name`` -> what ``AutoTokenizer.from_pretrained`` gets (tokenizers.py).
    _resolve_tokenizer_name = staticmethod(resolve_tokenizer_name)

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
        flags on top. By default: ``env_config_cls()`` (defaults live on the config class)
        and ``default_server_configs``; upstream-style envs override this instead."""
        servers = cls.default_server_configs
        if servers is None:
            return cls.env_config_cls(), ServerBaseline()
        if isinstance(servers, list):
            return cls.env_config_cls(), [s.model_copy(deep=True) for s in servers]
        return cls.env_config_cls(), servers.model_copy(deep=True)

    async def setup(self) -> None:
        """Prepare the env (load datasets...). Called once before anything else."""
        raise NotImplementedError("Setup method must be implemented in subclass")

    @abstractmethod
    async def get_next_item(self) -> Item:
        """The next item to roll out; None means "nothing now" (spawning stops until the
        next loop iteration)."""
        raise NotImplementedError("get_next_item must be implemented in subclass")

    @property
    def flat_items(self) -> FlatItemFilter | None:
        """The selective-rollout state (items on a flat streak, items skipped), or None when
        ``flat_item_retry_prob`` is off."""
        prob = self.config.flat_item_retry_prob
        current = self.__dict__.get("_flat_items")
        if prob is None:
            return None
        if current is None or current.retry_prob != prob:
            current = self.__dict__["_flat_items"] = FlatItemFilter(prob)
        return current

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
        return group_from_trajectories(results, self.config.group_size)

    async def postprocess_histories(
        self, trajectories: ScoredDataGroup | list[ScoredDataGroup | None] | None
    ) -> ScoredDataGroup | list[ScoredDataGroup | None] | None:
        """Change groups after collection (identity by default)."""
        return trajectories

    async def cleanup(self) -> None:
        """Called after each item's rollout finished (nothing by default)."""
        return None

    async def close(self) -> None:
        """Release what ``setup`` acquired (servers or sessions it started, connections);
        called once when ``serve``, ``process``, ``evaluate`` or ``check`` ends, after the last
        rollout and before the inference clients close. Nothing by default."""
        return None

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint_path(self, step: int) -> Path:
        folder = Path(self.checkpoint_dir) / "env_checkpoints" / str(self.wandb_prepend)
        return folder / f"step-{step}.json"

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

    # ------------------------------------------------------------------ metrics and evaluation

    def log_train_metric(self, name: str, value: float | Iterable[float]) -> None:
        """Buffer a training metric (one value or several); the next ``wandb_log`` logs the
        mean of everything buffered under ``name`` since the last one, then clears it.

        Use the full key, e.g. ``self.log_train_metric("train/percent_correct", 1.0)``; this
        replaces the "buffer, average, clear, ``super().wandb_log``" override."""
        self._wandb_logging.log_train_metric(name, value)

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
        return await run_env_eval(
            self,
            jobs,
            metrics,
            generation_parameters=generation_parameters,
            task_name=task_name,
            desc=desc,
        )

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
        log_env_evaluation(
            self,
            metrics,
            task_name=task_name,
            model_name=model_name,
            start_time=start_time,
            end_time=end_time,
            generation_parameters=generation_parameters,
            samples=samples,
            verbose=verbose,
        )

    # ------------------------------------------------------------------ W&B (wandb_logging.py)

    async def setup_wandb(self) -> None:
        """Start W&B with the project and group the trainer registered (waits for the trainer
        to register). Without a project from the trainer, ``WANDB_PROJECT`` is used; without
        either, W&B stays off for this run."""
        await self._wandb_logging.setup()

    async def add_rollouts_for_wandb(
        self, scored_data: ScoredDataGroup | list[ScoredDataGroup], item: Item = None
    ) -> None:
        """Keep the group's first ``num_rollouts_per_group_for_logging`` decoded sequences
        and scores for the W&B rollout table (of the last ``num_rollouts_to_keep`` groups)."""
        self._wandb_logging.add_rollouts(scored_data)

    async def create_rollout_table(self, wandb_metrics: dict[str, Any]) -> dict[str, Any]:
        """Add the ``train/rollouts`` table (text, score) when rollouts were kept."""
        return self._wandb_logging.rollout_table(wandb_metrics)

    def perf_stats(self, metrics_dict: dict[str, Any]) -> dict[str, Any]:
        """Add timing statistics (``train_perf/*``) and item counts, then reset them."""
        return self._wandb_logging.perf_stats(metrics_dict)

    async def wandb_log(self, wandb_metrics: dict[str, Any] | None = None) -> None:
        """Log ``wandb_metrics`` plus the env's own metrics to W&B at ``curr_step`` (env keys
        prefixed ``{wandb_prepend}_``, the servers' unprefixed); buffers are cleared even when
        W&B is off. Subclasses add their keys, then call ``super().wandb_log(wandb_metrics)``."""
        await self._wandb_logging.log(wandb_metrics)

    # ------------------------------------------------------------------ the API (registration.py)

    async def register_env(self) -> None:
        """Join the run: POST ``/register-env`` until the API says ``success`` (it answers
        "wait" until the trainer has fetched its first batch). API outages are waited out."""
        await self._registration.register()

    async def get_server_info(self) -> None:
        """Read the trainer's ``batch_size`` and ``max_token_len`` from ``/info``."""
        await self._registration.server_info()

    async def get_status(self) -> None:
        """Poll ``/status-env`` (GET with a JSON body, as upstream's API expects), update
        ``status_dict``, the worker cap and this env's inference weight."""
        await self._registration.poll_status()

    # ------------------------------------------------------------------ sending (group_sender.py)

    async def handle_send_to_api(
        self,
        scored_data: ScoredDataGroup | list[ScoredDataGroup | None] | None,
        item: Item = None,
        do_send_to_api: bool = True,
        abort_on_any_max_length_exceeded: bool = True,
    ) -> list[ScoredDataGroup]:
        """Check groups, record them (W&B buffer, JSONL file) and send the valid ones; the
        valid groups. A group that fails a check (``GroupSender.check_group``: malformed,
        wrong size, all scores alike, too long unless ``abort_on_any_max_length_exceeded`` is
        off) is dropped and counted in ``drop_counts``; a failed send is counted and logged,
        never raised."""
        return await self._group_sender.handle(
            scored_data, item, do_send_to_api, abort_on_any_max_length_exceeded
        )

    def _check_group(self, group: dict, abort_on_too_long: bool) -> str | None:
        return self._group_sender.check_group(group, abort_on_too_long)

    # ------------------------------------------------------------------ serve (runtime.py)

    async def env_manager(self) -> None:
        """``serve``: setup, W&B, register, then roll out until ``total_steps`` is covered.
        Returns after disconnecting from the API; always stops its rollouts and clients."""
        await self._serve_loop.run()

    async def add_train_workers(self) -> None:
        """Start rollouts up to the current cap (retried items first, then the backlog
        (newest first), then ``get_next_item()``). Never cancels running ones."""
        await self._serve_loop.add_train_workers()

    async def env_step_checks(self) -> None:
        """On a new trainer step: start an eval or a checkpoint when a multiple of
        ``steps_per_eval`` / ``checkpoint_interval`` was crossed, and log to W&B."""
        await self._serve_loop.env_step_checks()

    async def handle_env(self, item_uuid: str) -> ScoredDataGroup | list | None:
        """Roll out one running item: collect, postprocess, send, clean up. An exception in
        collection or postprocessing retries the item (up to ``rollout_retries`` times), then
        counts it as ``error`` with its traceback."""
        return await self._serve_loop.handle_env(item_uuid)

    # ------------------------------------------------------------------ process / evaluate

    async def process_manager(self) -> None:
        """``process``: roll out ``n_groups_to_process`` groups (default ``total_steps``)
        without API or trainer, write them to ``data_path_to_save_groups`` and the matching
        ``.html``, with a progress bar. Up to ``max_num_workers`` items run at once."""
        await process(self)

    async def _run_evaluate(self) -> None:
        await run_evaluate(self)

    @classmethod
    def cli(cls) -> None:
        """Command line: ``python env.py serve|process|evaluate|check [--env.X v] [--openai.X v]
        [--config f.yaml] [--slurm] [--testing]`` (``--help`` lists every flag)."""
        from atroposlib.envs.cli import run_cli

        raise SystemExit(run_cli(cls))
