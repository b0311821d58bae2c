"""Env metrics reach W&B (a real offline run, read back from its run file): the
``log_train_metric`` buffer and evaluation metrics, end to end in ``process`` and ``serve``."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.envs.helpers import (
    HERE,
    Trainer,
    env_environ,
    start_env,
    stop,
    wandb_offline_history,
)

METRICS_ENV = HERE / "metrics_env.py"


def _wandb_environ(tmp_path: Path) -> dict[str, str]:
    return {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}


def _values(rows: list[dict], suffix: str) -> list:
    return [v for row in rows for k, v in row.items() if k.endswith(suffix)]


@pytest.mark.slow
def test_train_metrics_are_averaged_per_log_and_cleared(tmp_path: Path, tiny_model_dir):
    """``process`` logs after each group: the mean of that rollout's three ``train/item``
    values (i, i+1, i+2 -> i+1), nothing left over from the group before."""
    proc = subprocess.run(
        [
            sys.executable,
            str(METRICS_ENV),
            "process",
            "--env.tokenizer_name",
            str(tiny_model_dir),
            "--env.total_steps",
            "3",
            "--env.max_num_workers",
            "1",
            "--env.use_wandb",
            "true",
            "--env.data_path_to_save_groups",
            str(tmp_path / "groups.jsonl"),
        ],
        capture_output=True,
        text=True,
        env=env_environ(**_wandb_environ(tmp_path), WANDB_PROJECT="test"),
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = wandb_offline_history(tmp_path)
    logged = [(row["_step"], row["train/item"]) for row in rows if "train/item" in row]
    assert logged == [(1, 1.0), (2, 2.0), (3, 3.0)]


@pytest.mark.slow
def test_eval_metrics_reach_wandb_once_in_serve(start_api, tiny_model_dir, tmp_path: Path):
    """``evaluate_log`` queues the eval's numbers for the next ``wandb_log``: each eval run's
    ``eval/run`` appears in exactly one W&B row (it was logged twice before), in order; text
    metrics are not sent to W&B."""
    api = start_api()
    trainer = Trainer(api.url, batch_size=4, max_token_len=512)
    trainer.register()
    proc = start_env(
        METRICS_ENV,
        "serve",
        "--env.rollout_server_url",
        api.url,
        "--env.tokenizer_name",
        str(tiny_model_dir),
        "--env.use_wandb",
        "true",
        "--env.steps_per_eval",
        "2",
        "--env.total_steps",
        "10",
        "--env.max_batches_offpolicy",
        "1",
        log=tmp_path / "env.log",
        extra_env=_wandb_environ(tmp_path),
    )
    try:
        # one trainer step at a time (the env stays at most one batch ahead), so the env sees
        # each step, evaluates at 2, 4, 6, 8 and logs to W&B in between
        for _ in range(10):
            trainer.pull(1, timeout=120)
            time.sleep(0.5)
        rc = proc.wait(60)
    finally:
        stop(proc)
        trainer.close()
    log = (tmp_path / "env.log").read_text()
    assert rc == 0, log[-3000:]
    rows = wandb_offline_history(tmp_path)
    runs = _values(rows, "eval/run")
    assert len(runs) >= 2, f"eval metrics missing in W&B: {rows}"
    assert runs == list(range(1, len(runs) + 1)), runs  # each eval logged once, in order
    assert not _values(rows, "eval/note")
    assert _values(rows, "train/item"), "the train metric buffer reached W&B too"
