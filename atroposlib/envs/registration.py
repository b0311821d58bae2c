"""How an environment joins a run on the trajectory API (``run-api``) and follows it.

Behind ``BaseEnv``'s ``register_env``, ``get_server_info`` and ``get_status``:
``POST /register-env`` until the trainer has started, ``GET /info`` for the trainer's batch size
and length limit, ``GET /status-env`` for the queue and this env's weight, re-registration when
a restarted API forgot the env, and ``POST /disconnect-env`` on the way out. API outages are
waited out (``RolloutApiClient.request_json_patiently``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

from atroposlib.envs.sending import UnknownEnvError

if TYPE_CHECKING:
    from atroposlib.envs.base import BaseEnv

# a child of the logger upstream's envs configure (``atroposlib.envs.base``)
logger = logging.getLogger("atroposlib.envs.base.registration")

__all__ = ["Registration"]


class Registration:
    """The env's membership of a run (``env._registration``).

    Args:
        env: The environment; ``register_env`` and ``get_server_info`` are called through it
            on re-registration, so subclass overrides take effect.
    """

    def __init__(self, env: BaseEnv) -> None:
        self.env = env
        self._lock: asyncio.Lock | None = None
        # the run, as the API told it (``env.env_id`` and friends read these)
        self.env_id: int | None = None
        self.status_dict: dict[str, Any] | None = None
        self.curr_step = 0
        self.max_token_len = -1
        self.checkpoint_dir = ""
        self.checkpoint_interval = -1
        self.wandb_project: str | None = None
        self.wandb_group: str | None = None
        self.wandb_prepend: str | None = None
        self._sent_since_status = 0  # groups sent since the last /status-env

    def payload(self) -> dict[str, Any]:
        """The ``/register-env`` body."""
        config = self.env.config
        return {
            "max_token_length": config.max_token_length,
            "desired_name": self.env.display_name,
            "weight": config.inference_weight,
            "min_batch_allocation": config.min_batch_allocation,
            "group_size": config.group_size,
            # not in upstream (its run-api ignores it): this env answers evaluations a
            # trainer pins to a policy version (atroposlib.envs.pinned_eval)
            "eval_requests": True,
        }

    async def register(self) -> None:
        """``register_env``: POST until the API says ``success``, then take the env id, W&B
        prefix, starting step and checkpoint settings (and ``total_steps`` when unset)."""
        env = self.env
        waited = 0
        while True:
            data = await env.api.request_json_patiently(
                "POST", "/register-env", self.payload(), what="/register-env"
            )
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
        if env.config.total_steps == -1:
            env.config.total_steps = data.get("num_steps", -1)
            if env.config.total_steps == -1:
                raise ValueError(
                    "total_steps is -1 and the trainer registered no num_steps: set "
                    "--env.total_steps"
                )
        logger.info(
            "Registered env %s as id %s (%s): step %s, checkpoint_dir %r, interval %s",
            env.display_name,
            self.env_id,
            self.wandb_prepend,
            self.curr_step,
            self.checkpoint_dir,
            self.checkpoint_interval,
        )
        if self.curr_step > 0:
            env.load_checkpoint()

    async def reregister(self, stale_env_id: int | None) -> None:
        """Register again after the API forgot ``stale_env_id`` (restart without a store).
        Concurrent callers share one registration."""
        env = self.env
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.env_id != stale_env_id:
                return
            logger.warning(
                "The API does not know env id %s any more; registering again", stale_env_id
            )
            self.status_dict = None
            await env.register_env()
            await env.get_server_info()

    async def server_info(self) -> None:
        """``get_server_info``: the trainer's ``batch_size`` and ``max_token_len``."""
        env = self.env
        data = await env.api.request_json_patiently("GET", "/info", what="/info")
        if data.get("batch_size", -1) != -1:
            env.config.batch_size = data["batch_size"]
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
        if env.config.batch_size == -1:
            logger.warning("Batch size not set by config or server!")
        elif env.config.group_size > env.config.batch_size:
            raise ValueError(
                f"group_size ({env.config.group_size}) must not be larger than the trainer's "
                f"batch_size ({env.config.batch_size})"
            )

    async def poll_status(self) -> None:
        """``get_status``: ``GET /status-env`` (a JSON body, as upstream's API expects); update
        ``status_dict``, the worker cap and the env's inference weight."""
        env = self.env
        env_id = self.env_id
        body: dict[str, Any] = {"env_id": env_id}
        drops: dict[str, int] = {}
        for reason, count in Counter(env.drop_counts).most_common():
            # run-api takes up to 64 reasons of up to 64 characters (a custom reason may be
            # longer): the largest counts, names cut short
            name = str(reason)[:64]
            if count > 0 and (name in drops or len(drops) < 64):
                drops[name] = drops.get(name, 0) + int(count)
        if drops:
            # not in upstream (its API ignores the key): the groups this env dropped before
            # sending, by reason, so that a trainer waiting on run-api can say why nothing
            # comes (e.g. every group scored alike)
            body["dropped"] = drops
        try:
            status = await env.api.request_json_patiently(
                "GET", "/status-env", body, what="/status-env"
            )
        except UnknownEnvError:
            await self.reregister(env_id)
            return
        self.status_dict = status
        self._sent_since_status = 0
        env.max_num_workers = env._resolve_max_workers()
        weight = status.get("env_weight")
        if weight is not None:
            await env.server.update_weight(weight)

    async def disconnect(self) -> None:
        """``POST /disconnect-env`` (5 s, best effort: a failure is logged)."""
        env = self.env
        if self.env_id is None:
            return
        try:
            await env.api.request_json(
                "POST", "/disconnect-env", {"env_id": self.env_id}, timeout=5
            )
            logger.info("Disconnected env %s from the API", self.env_id)
        except Exception as exc:  # noqa: BLE001 - leaving anyway
            logger.warning("Could not disconnect from the API: %r", exc)
