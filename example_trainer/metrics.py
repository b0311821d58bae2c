"""Where training metrics go: a rich progress line, ``metrics.jsonl`` and (optionally) W&B;
and the staleness of a batch (:func:`staleness_metrics`)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def staleness_metrics(policy_versions: Sequence[int | None], step: int) -> dict[str, float]:
    """How far behind the trainer the groups of a batch were made, as TRL counts it: for each
    group with a ``policy_version``, the version of the weights about to be trained on the batch
    of ``step`` (``step - 1``: the trainer has taken ``step - 1`` steps) minus the version whose
    weights generated it. 0 is on-policy, as run-api's ``--max-staleness`` counts.

    Returns ``staleness_mean`` and ``staleness_max`` over the versioned groups (left out when
    none has a version: groups from upstream envs carry none) and ``versioned_group_fraction``.
    """
    behind = [step - 1 - v for v in policy_versions if v is not None]
    metrics = {"versioned_group_fraction": len(behind) / max(len(policy_versions), 1)}
    if behind:
        metrics["staleness_mean"] = sum(behind) / len(behind)
        metrics["staleness_max"] = float(max(behind))
    return metrics


class TrainingLogger:
    """Logs one dict of metrics per step to the console, ``metrics.jsonl`` and W&B.

    Args:
        total_steps: steps of the whole run (for the progress bar).
        start_step: the step a resumed run starts from.
        metrics_path: JSON-lines file, one object per step (appended).
        progress: live progress bar; otherwise one plain line per step.
        wandb_run: an initialised ``wandb`` run, or None.
    """

    def __init__(
        self,
        total_steps: int,
        start_step: int,
        metrics_path: Path,
        *,
        progress: bool = True,
        wandb_run: Any | None = None,
    ) -> None:
        self.console = Console(stderr=True)
        self.metrics_path = metrics_path
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self._start_step = start_step
        self._started = time.monotonic()
        self.wandb_run = wandb_run
        self._progress = None
        if progress and self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]GRPO"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                TextColumn("{task.description}"),
                console=self.console,
            )
            self._task = self._progress.add_task(
                "waiting for the first batch", total=total_steps, completed=start_step
            )
            self._progress.start()

    def status(self, message: str) -> None:
        """A short note (e.g. 'waiting for a batch') in the progress line."""
        if self._progress is not None:
            self._progress.update(self._task, description=message)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record the metrics of ``step``."""
        record = {"step": step, "time": time.time(), **metrics}
        with open(self.metrics_path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        line = (
            f"step {step}  loss {metrics['loss']:+.3e}  reward {metrics['reward_mean']:+.3f}  "
            + (
                f"{metrics['computed_tokens_per_s']:.0f} computed tok/s"
                + (f" (mfu {metrics['mfu']:.0%})" if "mfu" in metrics else "")
                if "computed_tokens_per_s" in metrics
                else f"{metrics['batch_tokens_per_s']:.0f} batch tok/s"
                if "batch_tokens_per_s" in metrics
                else "no optimizer step"
            )
            + f"  sync {metrics['sync_seconds']:.2f} s"
            + (
                f"  checkpoint {metrics['checkpoint_seconds']:.2f} s"
                if "checkpoint_seconds" in metrics
                else ""
            )
            + (
                f"  stale {metrics['staleness_mean']:.1f}/{metrics['staleness_max']:.0f}"
                if "staleness_mean" in metrics
                else ""
            )
        )
        if self._progress is not None:
            self._progress.update(self._task, completed=step, description=line)
        else:
            done = step - self._start_step
            eta = (time.monotonic() - self._started) / max(done, 1) * (self.total_steps - step)
            self.console.print(
                f"[{step}/{self.total_steps}, ETA {_clock(eta)}] {line}",
                highlight=False,
                soft_wrap=True,
            )
        if self.wandb_run is not None:
            self.wandb_run.log({f"train/{k}": v for k, v in metrics.items()}, step=step)

    def log_eval(self, step: int, results: dict[str, Any]) -> dict[str, float]:
        """Record the results of an evaluation pinned to ``step``'s weights (``GET
        /eval-results``): one record with ``step``, ``eval_policy_version`` and
        ``eval/<env>/<metric>`` per env that reported (refusals and failures are logged with
        their reason). Returns the flat metrics."""
        flat: dict[str, float] = {}
        for report in results.get("reports", []):
            name = report.get("env_name") or f"env{report.get('env_id')}"
            if report.get("status") == "done":
                for key, value in report.get("metrics", {}).items():
                    flat[f"eval/{name}/{key.removeprefix('eval/')}"] = float(value)
            else:
                self.console.print(
                    f"evaluation of step {step}: {name} {report.get('status')}: "
                    f"{report.get('reason', '')}",
                    highlight=False,
                )
        missing = sorted(set(results.get("expected", [])) - {r.get("env_id") for r in
                                                            results.get("reports", [])})  # fmt: skip
        record = {
            "step": step,
            "time": time.time(),
            "eval_policy_version": results.get("policy_version"),
            "eval_request_id": results.get("request_id"),
            **({"eval_missing_envs": missing} if missing else {}),
            **flat,
        }
        with open(self.metrics_path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if flat:
            shown = ", ".join(f"{k} {v:.3f}" for k, v in sorted(flat.items()))
            self.console.print(
                f"evaluation of step {step} (policy version {results.get('policy_version')}): "
                f"{shown}",
                highlight=False,
            )
        if self.wandb_run is not None and flat:
            self.wandb_run.log({**flat, "eval/policy_version": results.get("policy_version")})
        return flat

    def close(self) -> None:
        """Stop the live display and finish the W&B run."""
        if self._progress is not None:
            self._progress.stop()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
