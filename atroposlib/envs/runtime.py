"""The ``serve`` runtime: the loop that keeps an environment's rollouts running.

Behind ``BaseEnv``'s ``env_manager``, ``add_train_workers``, ``env_step_checks`` and
``handle_env``. :class:`ServeLoop` polls ``/status-env`` every ``STATUS_POLL_INTERVAL`` seconds
and wakes at once when a rollout finishes; on each pass it

* starts an eval or a checkpoint when the trainer crossed a multiple of ``steps_per_eval`` /
  ``checkpoint_interval``, and logs to W&B on a new step (``env_step_checks``);
* stops when the queued data covers ``total_steps``;
* unless the API's queue is full (``throttle.queue_is_full``), starts rollouts up to the cap
  (``add_train_workers``: retried items first, then the backlog, then ``get_next_item()``);
  the cap follows the measured acceptance rate (``throttle.acceptance_rate``: groups sent per
  finished rollout), so that enough rollouts are in flight to fill the window when most groups
  are dropped (as flat); the rollouts started beyond the plain cap (the surplus) are cancelled,
  their items kept to roll out again, once the queue is full;
* cancels rollouts older than ``worker_timeout`` (retried, then dropped as ``timeout``).

A rollout (``handle_env``) runs ``collect_trajectories`` and ``postprocess_histories``, then
``handle_send_to_api`` and ``cleanup``; one that raises is retried ``rollout_retries`` times,
then dropped as ``error`` with its traceback. Each rollout collects the policy versions of the
servers its requests went to (:mod:`~atroposlib.envs.server_handling.policy_version`); the
group sender stamps the lowest on groups that carry no ``policy_version`` of their own. The
decisions themselves are pure functions in :mod:`atroposlib.envs.throttle`. Every env hook is
called through ``env.``, so overrides apply.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import traceback
import uuid
from collections import deque
from functools import partial
from typing import TYPE_CHECKING, Any

from atroposlib.envs import throttle
from atroposlib.envs.config import EvalHandlingEnum
from atroposlib.envs.pinned_eval import pinned_evaluate
from atroposlib.envs.selective import next_rollout_item
from atroposlib.envs.server_handling.policy_version import end_rollout, start_rollout
from atroposlib.type_definitions import UUID, Item

if TYPE_CHECKING:
    from atroposlib.envs.base import BaseEnv

# a child of the logger upstream's envs configure (``atroposlib.envs.base``)
logger = logging.getLogger("atroposlib.envs.base.runtime")

__all__ = ["STATUS_POLL_INTERVAL", "ServeLoop", "record_failure"]

#: Seconds between two ``/status-env`` polls of the main loop.
STATUS_POLL_INTERVAL = 0.1


async def shutdown_env(env: BaseEnv) -> None:
    """The end of a command: ``env.close()`` (a failure is logged, not raised), then the
    inference servers' HTTP clients (aiohttp warns about unclosed sessions at exit)."""
    try:
        await env.close()
    except Exception:  # noqa: BLE001 - closing must not hide the command's own outcome
        logger.exception("%s.close() failed", type(env).__name__)
    close = getattr(env.server, "close", None)
    if close is not None:
        result = close()
        if inspect.isawaitable(result):
            await result


def record_failure(env: BaseEnv, item: Item, attempts: int, reason: str, detail: str) -> bool:
    """Count and log a failed rollout of ``item`` (its ``attempts``-th failure); whether it may
    be retried (``attempts <= rollout_retries``: counted in ``retried_rollouts``), else it is
    dropped (counted in ``drop_counts[reason]``)."""
    if attempts <= env.config.rollout_retries:
        env.retried_rollouts += 1
        logger.warning(
            "Rollout %s (attempt %d of %d); retrying:\n%s",
            reason,
            attempts,
            env.config.rollout_retries + 1,
            detail,
        )
        return True
    env.drop_counts[reason] += 1
    logger.error(
        "Rollout %s %d times; giving up on item %s:\n%s",
        reason,
        attempts,
        str(item)[:200],
        detail,
    )
    return False


class ServeLoop:
    """The ``serve`` runtime of one environment (``env._serve_loop``).

    Running rollouts are in ``self.workers`` (tasks) and ``self.running_items`` (uuid -> item,
    worker, start time, attempts, whether it is sending); the loop's own state is the queue
    of items to retry and the event that wakes it.
    """

    def __init__(self, env: BaseEnv) -> None:
        self.env = env
        # the rollouts (``env.workers`` and friends read these): running tasks, uuid ->
        # {item, worker, start_time, ...}, items to roll out later, the running eval
        self.workers: set[asyncio.Task] = set()
        self.running_items: dict[UUID, dict[str, Any]] = {}
        self.backlog: list[Item] = []
        self.eval_runner: asyncio.Task | None = None
        self.retried_rollouts = 0
        # timings for W&B, in seconds (``env.task_duration`` ...)
        self.task_duration: list[float] = []
        self.succeeded_task_duration: list[float] = []
        self.failed_task_duration: list[float] = []
        self.mainloop_timings: list[float] = []
        self.workers_added_list: list[int] = []
        #: Items to roll out again: ``(item, failed attempts so far)``.
        self.retry_queue: deque[tuple[Item, int]] = deque()
        self._wake: asyncio.Event | None = None
        #: Whether the queue (with what is in flight) covers total_steps: no new rollouts.
        self._enough_queued = False
        #: The evaluation pinned to a policy version that runs now, and the last one started.
        self.pinned_eval: asyncio.Task | None = None
        self._pinned_request: int | None = None
        #: ``env.groups_sent`` when each of the latest rollouts finished (the acceptance rate)
        self._sent_at_finish: deque[int] = deque(maxlen=throttle.ACCEPTANCE_WINDOW + 1)
        #: surplus rollouts cancelled because the queue was full
        self.cancelled_surplus = 0

    @property
    def acceptance(self) -> float:
        """Groups sent per finished rollout over the latest ones (1.0 before any finished)."""
        marks = self._sent_at_finish
        if len(marks) < 2:
            return 1.0
        return throttle.acceptance_rate(len(marks) - 1, marks[-1] - marks[0])

    def _rollout_finished(self) -> None:
        if not self._sent_at_finish:
            self._sent_at_finish.append(0)
        self._sent_at_finish.append(self.env.groups_sent)

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """``env_manager``: setup, W&B, register, then the main loop; always shuts down."""
        env = self.env
        try:
            await env.setup()
            await env.setup_wandb()
            await env.register_env()
            await env.get_server_info()
            await self._main_loop()
        finally:
            await self._shutdown()

    async def _main_loop(self) -> None:
        env = self.env
        self._wake = asyncio.Event()
        self._sent_at_finish.append(env.groups_sent)
        next_poll = 0.0
        last_loop_time: float | None = None
        while True:
            now = time.monotonic()
            if last_loop_time is not None:
                self.mainloop_timings.append(max(0.0, time.time() - last_loop_time))
            last_loop_time = time.time()
            if now >= next_poll:
                await env.get_status()
                next_poll = time.monotonic() + STATUS_POLL_INTERVAL
                await env.env_step_checks()
            if self._trained_enough():
                logger.info("The trainer reached total_steps=%d; stopping", env.config.total_steps)
                return
            enough = self._should_stop()
            if enough != self._enough_queued:
                self._enough_queued = enough
                if enough:
                    logger.info(
                        "Enough data for total_steps=%d is queued or trained on; making no more "
                        "and waiting for the trainer to take it (more is made if the API drops "
                        "queued groups, e.g. as stale)",
                        env.config.total_steps,
                    )
                else:
                    logger.info(
                        "The queue no longer holds enough for total_steps=%d (groups were "
                        "dropped); making more",
                        env.config.total_steps,
                    )
            if not enough and not self._is_paused(self._effective_status()):
                await env.add_train_workers()
            else:
                self._cancel_surplus()
            self._reap_timeouts()
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.0, next_poll - time.monotonic()))
            except asyncio.TimeoutError:
                pass

    async def _shutdown(self) -> None:
        """Cancel rollouts and the eval, stop the sender, disconnect, close every client."""
        env = self.env
        tasks = list(self.workers)
        for task in tasks:
            task.cancel()
        for runner in (self.eval_runner, self.pinned_eval):
            if runner is not None and not runner.done():
                runner.cancel()
                tasks.append(runner)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self.workers = set()
        self.running_items = {}
        if env.eval_metrics and env.config.use_wandb:
            # an eval that finished after the last step's log still reaches W&B
            try:
                await env.wandb_log({})
            except Exception as exc:  # noqa: BLE001 - W&B trouble must not block shutdown
                logger.debug("final wandb_log: %s", exc)
        await env._group_sender.close()
        await env._registration.disconnect()
        if env._api is not None:
            await env._api.aclose()
        if env.jsonl_writer is not None:
            env.jsonl_writer.close()
        try:
            await shutdown_env(env)
        except Exception as exc:  # noqa: BLE001
            logger.debug("closing servers: %s", exc)
        env._wandb_logging.finish()
        selective = getattr(env, "flat_items", None)
        skipped = "" if selective is None else f", {selective.skipped} items skipped (flat)"
        logger.info(
            "Env stopped: %d groups sent, %d rollouts retried, %d surplus rollouts cancelled "
            "(queue full), dropped: %s%s",
            env.groups_sent,
            self.retried_rollouts,
            self.cancelled_surplus,
            dict(env.drop_counts) or "none",
            skipped,
        )

    # ------------------------------------------------------------------ decisions

    def _effective_status(self) -> dict[str, Any]:
        env = self.env
        status = dict(env.status_dict or {})
        status.setdefault("current_step", env.curr_step)
        status.setdefault("queue_size", 0)
        # groups sent since the last poll are in the queue even if the poll does not say so
        status["queue_size"] = int(status["queue_size"]) + env._sent_since_status
        return status

    def _is_paused(self, status: dict[str, Any]) -> bool:
        env = self.env
        if env.status_dict is None:
            return True
        return throttle.queue_is_full(
            status,
            env.config.group_size,
            env.config.batch_size,
            env.config.max_batches_offpolicy,
            env.config.min_batch_allocation,
            env.derived_batch_size,
        )

    def _trained_enough(self) -> bool:
        """Whether the trainer has taken total_steps batches (the env's work is done)."""
        env = self.env
        if env.status_dict is None or env.config.batch_size <= 0:
            return False
        return int(env.status_dict.get("current_step", 0)) >= env.config.total_steps

    def _should_stop(self) -> bool:
        """Whether the queue plus the trained steps cover total_steps (upstream's stop rule;
        here the env stops *making* rollouts then, and exits once the trainer got there)."""
        env = self.env
        if env.status_dict is None or env.config.batch_size <= 0:
            return False
        projected = throttle.projected_step(
            self._effective_status(), env.config.group_size, env.config.batch_size
        )
        return projected >= env.config.total_steps

    def _worker_cap(self) -> int | None:
        """How many rollouts may run now; None while an eval holds training back."""
        caps = self._worker_caps()
        return None if caps is None else caps[1]

    def _worker_caps(self) -> tuple[int, int] | None:
        """The plain cap (one rollout per missing group) and the cap at the measured acceptance
        rate; None while an eval holds training back."""
        env = self.env
        cap = env.max_num_workers
        if self.eval_runner is not None and not self.eval_runner.done():
            if env.config.eval_handling == EvalHandlingEnum.STOP_TRAIN:
                return None
            if env.config.eval_handling == EvalHandlingEnum.LIMIT_TRAIN:
                cap = int(cap * env.config.eval_limit_ratio)
        if env.config.batch_size <= 0 or env.status_dict is None:
            return cap, cap
        status = self._effective_status()
        plain, scaled = (
            min(
                cap,
                throttle.train_worker_cap(
                    cap,
                    status,
                    env.config.group_size,
                    env.config.batch_size,
                    env.config.max_batches_offpolicy,
                    env.config.min_batch_allocation,
                    env.derived_batch_size,
                    acceptance,
                ),
            )
            for acceptance in (1.0, self.acceptance)
        )
        return plain, max(plain, scaled)

    # ------------------------------------------------------------------ the hooks' bodies

    async def add_train_workers(self) -> None:
        """``add_train_workers``: start rollouts up to the current cap."""
        env = self.env
        caps = self._worker_caps()
        if caps is None:
            return
        plain, cap = caps
        added = 0
        while len(self.workers) < cap:
            if self.retry_queue:
                item, attempts = self.retry_queue.popleft()
            elif self.backlog:
                item, attempts = self.backlog.pop(), 0
            else:
                item, attempts = await next_rollout_item(env), 0
                if item is None:
                    break
            self._spawn(item, attempts, surplus=len(self.workers) >= plain)
            added += 1
        if added:
            self.workers_added_list.append(added)

    async def env_step_checks(self) -> None:
        """``env_step_checks``: eval / checkpoint on crossed multiples, W&B on a new step."""
        env = self.env
        if env.status_dict is None:
            return
        self._start_pinned_eval(env.status_dict.get("eval_request"))
        new_step = int(env.status_dict["current_step"])
        if new_step == env.curr_step:
            return
        old_step = env.curr_step
        if throttle.crossed_multiple(old_step, new_step, env.config.steps_per_eval):
            pinned = self.pinned_eval is not None and not self.pinned_eval.done()
            if pinned:
                logger.info("Step %d: a pinned evaluation runs; no step evaluation", new_step)
            elif self.eval_runner is None or self.eval_runner.done():
                logger.info("Step %d: starting evaluate()", new_step)
                self.eval_runner = asyncio.create_task(env.evaluate())
                self.eval_runner.add_done_callback(_log_eval_result)
            else:
                logger.warning(
                    "The previous eval is still running; skipping the eval at step %d", new_step
                )
        if throttle.crossed_multiple(old_step, new_step, env.checkpoint_interval):
            env.save_checkpoint((new_step // env.checkpoint_interval) * env.checkpoint_interval)
        env.curr_step = new_step
        if env.items_sent_this_step >= env.config.min_items_sent_before_logging:
            env.items_sent_this_step = 0
            await env.wandb_log({})

    def _start_pinned_eval(self, request: Any) -> None:
        """Start the evaluation a trainer pinned to a policy version (``/status-env``'s
        ``eval_request``), once per request, never two at a time (module
        :mod:`~atroposlib.envs.pinned_eval`)."""
        if not isinstance(request, dict) or "request_id" not in request:
            return
        if request["request_id"] == self._pinned_request:
            return
        if self.pinned_eval is not None and not self.pinned_eval.done():
            return
        if self.eval_runner is not None and not self.eval_runner.done():
            return  # the step evaluation finishes first
        self._pinned_request = request["request_id"]
        logger.info(
            "Evaluation %s pinned to policy version %s requested",
            request["request_id"],
            request.get("policy_version"),
        )
        self.pinned_eval = asyncio.create_task(pinned_evaluate(self.env, request))
        self.pinned_eval.add_done_callback(_log_eval_result)

    async def handle_env(self, item_uuid: str) -> Any:
        """``handle_env``: collect, postprocess, send and clean up one running item (with the
        policy versions of its requests collected, for the group sender to stamp)."""
        token = start_rollout()
        try:
            return await self._handle_env(item_uuid)
        finally:
            end_rollout(token)

    async def _handle_env(self, item_uuid: str) -> Any:
        env = self.env
        entry = self.running_items.get(item_uuid)
        if entry is None:
            logger.warning("item %s not found", item_uuid)
            return None
        item = entry["item"]
        start = time.time()
        try:
            to_postprocess, to_backlog = await env.collect_trajectories(item)
            if to_backlog:
                self.backlog.extend(to_backlog)
            if to_postprocess:
                to_postprocess = await env.postprocess_histories(to_postprocess)
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
                self.succeeded_task_duration.append(duration)
                await env.handle_send_to_api(to_postprocess, item)
            else:
                self.failed_task_duration.append(duration)
            await env.cleanup()
        finally:
            self.running_items.pop(item_uuid, None)
        return to_postprocess

    # ------------------------------------------------------------------ workers

    def _spawn(self, item: Item, attempts: int = 0, surplus: bool = False) -> None:
        """Start a rollout of ``item``; ``surplus``: started beyond the plain cap (for the
        acceptance rate), cancelled if the queue fills first."""
        env = self.env
        item_uuid = str(uuid.uuid4())
        task = asyncio.create_task(env.handle_env(item_uuid))
        self.running_items[item_uuid] = {
            "item": item,
            "worker": task,
            "start_time": time.time(),
            "attempts": attempts,
            "sending": False,
            "surplus": surplus,
        }
        self.workers.add(task)
        task.add_done_callback(partial(self._worker_done, item))

    def _worker_done(self, item: Item, task: asyncio.Task) -> None:
        self.workers.discard(task)
        if not task.cancelled():
            self._rollout_finished()
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            self.env.drop_counts["error"] += 1
            logger.error("Rollout worker failed", exc_info=(type(exc), exc, exc.__traceback__))
        if self._wake is not None:
            self._wake.set()

    def _retry_or_drop(self, entry: dict[str, Any], reason: str, detail: str) -> None:
        attempts = entry["attempts"] + 1
        if record_failure(self.env, entry["item"], attempts, reason, detail):
            self.retry_queue.append((entry["item"], attempts))

    def _reap_timeouts(self) -> None:
        env = self.env
        timeout = env.config.worker_timeout
        if timeout <= 0:
            return
        now = time.time()
        for item_uuid, entry in list(self.running_items.items()):
            if entry["sending"] or now - entry["start_time"] <= timeout:
                continue
            self.running_items.pop(item_uuid, None)
            entry["worker"].cancel()
            self.workers.discard(entry["worker"])
            self._rollout_finished()  # a rollout that yielded nothing
            self._retry_or_drop(
                entry, "timeout", f"no result after {now - entry['start_time']:.1f}s"
            )

    def _cancel_surplus(self) -> None:
        """The queue is full: cancel the rollouts started beyond the plain cap that are not
        sending yet, and keep their items to roll out first when rollouts start again."""
        cancelled = 0
        for item_uuid, entry in list(self.running_items.items()):
            if not entry.get("surplus") or entry["sending"]:
                continue
            self.running_items.pop(item_uuid, None)
            entry["worker"].cancel()
            self.workers.discard(entry["worker"])
            self.retry_queue.appendleft((entry["item"], entry["attempts"]))
            cancelled += 1
        if cancelled:
            self.cancelled_surplus += cancelled
            logger.debug(
                "The queue is full: cancelled %d surplus rollout(s) (acceptance rate %.2f); "
                "their items are rolled out again later",
                cancelled,
                self.acceptance,
            )


def _log_eval_result(task: asyncio.Task) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        logger.error("evaluate() failed", exc_info=(type(exc), exc, exc.__traceback__))
