"""An environment's side of evaluations pinned to a policy version.

A trainer asks run-api for an evaluation of the weights of version ``v``
(:mod:`atroposlib.api.evals`). An env that registered with ``"eval_requests": true`` (every
env of this library does) finds the request in its ``/status-env`` reply; the serve loop then
runs :func:`pinned_evaluate`:

1. every inference server of the env must serve version ``v`` (``GET /policy_version``): while
   one is behind, the env waits (up to ``eval_version_wait`` seconds, logging what it waits
   for); if one is ahead, or reports no version, the env refuses (the result would belong to
   other weights);
2. it runs the env's own ``evaluate()`` and collects the metrics it logs (``evaluate_log`` /
   ``eval_metrics``);
3. it checks that the servers still serve ``v`` (a sync during the evaluation mixes versions:
   refused), then reports to ``POST /eval-result``: ``done`` with the metrics, ``refused`` or
   ``failed`` with the reason. The metrics also go to W&B with the env's next log, with
   ``eval/policy_version``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING, Any

from atroposlib.envs.eval import EVAL_CAPTURE

if TYPE_CHECKING:
    from atroposlib.envs.base import BaseEnv

logger = logging.getLogger("atroposlib.envs.base.pinned_eval")

__all__ = ["pinned_evaluate", "server_versions"]


async def server_versions(env: BaseEnv, fresh: bool = False) -> list[int | None]:
    """The policy version each of the env's inference servers serves now. ``fresh``: ask each
    server once more instead of using a value learned in the last second."""
    versions = []
    for server in env.server.servers:
        tracker = server._policy_tracker()
        if fresh and tracker.supported is not False:
            await tracker._fetch()
            versions.append(tracker.value if tracker.supported is not False else None)
        else:
            versions.append(await tracker.current())
    return versions


def _report(request: dict[str, Any], env: BaseEnv, status: str, **extra: Any) -> dict[str, Any]:
    return {
        "request_id": request["request_id"],
        "env_id": env.env_id,
        "policy_version": request["policy_version"],
        "status": status,
        **extra,
    }


async def pinned_evaluate(env: BaseEnv, request: dict[str, Any]) -> dict[str, Any]:
    """Run one pinned evaluation (module docstring) and report it; returns the report."""
    version = int(request["policy_version"])
    report = await _evaluate_at(env, request, version)
    log = logger.info if report["status"] == "done" else logger.warning
    log(
        "Evaluation %s of policy version %d: %s%s",
        request["request_id"],
        version,
        report["status"],
        f" ({report['reason']})" if report.get("reason") else "",
    )
    await env.api.request_json_patiently("POST", "/eval-result", report, what="/eval-result")
    return report


async def _evaluate_at(env: BaseEnv, request: dict[str, Any], version: int) -> dict[str, Any]:
    deadline = time.monotonic() + env.config.eval_version_wait
    announced = False
    while True:
        versions = await server_versions(env)
        missing = [i for i, v in enumerate(versions) if v is None]
        if missing:
            return _report(
                request, env, "refused",
                reason=f"inference server {missing[0]} reports no policy version "
                "(GET /policy_version): cannot tell which weights it serves",
            )  # fmt: skip
        ahead = [(i, v) for i, v in enumerate(versions) if v is not None and v > version]
        if ahead:
            i, v = ahead[0]
            return _report(
                request, env, "refused",
                reason=f"inference server {i} already serves policy version {v}",
            )  # fmt: skip
        if all(v == version for v in versions):
            break
        if time.monotonic() > deadline:
            return _report(
                request, env, "refused",
                reason=f"inference servers still at policy versions {versions} after "
                f"{env.config.eval_version_wait:.0f} s (eval_version_wait)",
            )  # fmt: skip
        if not announced:
            logger.info(
                "Evaluation %s: waiting for the inference servers to serve policy version %d "
                "(now %s)",
                request["request_id"],
                version,
                versions,
            )
            announced = True
        await asyncio.sleep(0.5)

    started = time.monotonic()
    # what evaluate() logs through evaluate_log is captured; an env that appends to
    # self.eval_metrics itself is read from that buffer (the list as it was when the evaluation
    # started, plus a new one if wandb_log emptied it meanwhile)
    captured: list[tuple[str, Any]] = []
    buffer, first = env.eval_metrics, len(env.eval_metrics)
    token = EVAL_CAPTURE.set(captured)
    try:
        await env.evaluate()
    except Exception as exc:  # noqa: BLE001 - reported to the trainer, not raised in the loop
        logger.error("evaluate() failed", exc_info=True)
        return _report(request, env, "failed", reason=f"evaluate() raised {exc!r}")
    finally:
        EVAL_CAPTURE.reset(token)
    logged = captured or buffer[first:] + (
        [] if env.eval_metrics is buffer else list(env.eval_metrics)
    )
    seconds = time.monotonic() - started
    after = await server_versions(env, fresh=True)
    if any(v != version for v in after):
        return _report(
            request, env, "refused", seconds=seconds,
            reason=f"the servers' weights changed during the evaluation (now versions "
            f"{after}); its result mixes versions",
        )  # fmt: skip
    metrics = {
        str(k): float(v)
        for k, v in logged
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }
    if not metrics:
        return _report(
            request, env, "failed", seconds=seconds,
            reason="evaluate() logged no metrics (call self.evaluate_log(...) or append to "
            "self.eval_metrics)",
        )  # fmt: skip
    env.eval_metrics.append(("eval/policy_version", version))
    return _report(request, env, "done", metrics=metrics, seconds=seconds)
