"""The ``process`` and ``evaluate`` commands: an environment without a trainer.

``process`` (``BaseEnv.process_manager``) rolls out ``n_groups_to_process`` groups (default
``total_steps``), at most ``max_num_workers`` items at once, writes each valid group to
``data_path_to_save_groups`` and renders the matching ``.html`` at the end; no API is involved.
``evaluate`` runs ``setup()`` then ``evaluate()`` once. Env hooks are called through ``env.``,
so overrides apply.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from atroposlib.envs.runtime import record_failure, shutdown_env
from atroposlib.envs.selective import next_rollout_item
from atroposlib.type_definitions import Item

if TYPE_CHECKING:
    from atroposlib.envs.base import BaseEnv

# a child of the logger upstream's envs configure (``atroposlib.envs.base``)
logger = logging.getLogger("atroposlib.envs.base.process")

__all__ = ["process", "run_evaluate"]


async def process(env: BaseEnv) -> None:
    """``process_manager``: the groups are written by ``handle_send_to_api(...,
    do_send_to_api=False)``; a progress bar counts them, W&B (when on) logs after each. Gives
    up after ``max(10, target * (rollout_retries + 1))`` items produced no valid group."""
    from tqdm import tqdm

    from atroposlib.frontend.jsonl2html import generate_html

    await env.setup()
    if env.config.use_wandb:
        env._wandb_logging.start(
            os.environ.get("WANDB_PROJECT"), env.wandb_group, env.name or "process"
        )
    target = getattr(env, "n_groups_to_process", env.config.total_steps)
    group_size = getattr(env, "group_size_to_process", env.config.group_size)
    env.config.group_size = group_size
    env.curr_step = 0
    done = 0
    failures = 0
    max_failures = max(10, target * (env.config.rollout_retries + 1))
    running: set[asyncio.Task] = set()
    exhausted = False
    bar = tqdm(total=target, desc=f"{env.name or type(env).__name__}", unit="group")
    try:
        while done < target:
            while not exhausted and len(running) < min(env.max_num_workers, target - done):
                item = await next_rollout_item(env)
                if item is None:
                    exhausted = True
                    break
                running.add(asyncio.create_task(_process_one(env, item)))
            if not running:
                break
            finished, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                written = task.result()
                if written and done < target:
                    done += 1
                    env.curr_step = done
                    bar.update(1)
                    await env.wandb_log()
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
        if env.jsonl_writer is not None:
            env.jsonl_writer.close()
        env._wandb_logging.finish()
        await shutdown_env(env)
    logger.info("Processed %d of %d groups", done, target)
    path = env.config.data_path_to_save_groups
    if path is not None and Path(path).exists():
        html = generate_html(path)
        print(f"Wrote {done} groups to {path} and {html}")


async def _process_one(env: BaseEnv, item: Item) -> int:
    """Roll out ``item`` (retried ``rollout_retries`` times); how many groups were written."""
    for attempt in range(env.config.rollout_retries + 1):
        try:
            groups, _ = await env.collect_trajectories(item)
            if not groups:
                return 0
            groups = await env.postprocess_histories(groups)
            valid = await env.handle_send_to_api(
                groups, item, do_send_to_api=False, abort_on_any_max_length_exceeded=False
            )
            return len(valid)
        except Exception:  # noqa: BLE001
            if not record_failure(env, item, attempt + 1, "error", traceback.format_exc()):
                return 0
    return 0


async def run_evaluate(env: BaseEnv) -> None:
    """``evaluate``: ``setup()`` then ``evaluate()``; a returned metrics dict that the env did
    not log itself goes through ``evaluate_log``."""
    try:
        await env.setup()
        start = time.time()
        result = await env.evaluate()
        if isinstance(result, dict) and result and not env._evaluate_logged:
            await env.evaluate_log(result, start_time=start, end_time=time.time())
    finally:
        await shutdown_env(env)
