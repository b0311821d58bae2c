"""The run's evaluation process (``example_trainer.eval_worker.EvalWorker``): the env is set up
once and evaluated as often as asked, each evaluation's files in its own folder; a failing
evaluation is reported and the next one runs; a worker that dies is reported with its log and
the next evaluation starts a new one."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from example_trainer.eval_worker import EvalWorker
from example_trainer.report import EvaluationError

REPO = Path(__file__).resolve().parents[2]
METRICS_ENV = REPO / "tests" / "envs" / "metrics_env.py"
FLAGS = [
    "--env.use_wandb",
    "false",
    "--openai.base_url",
    "http://127.0.0.1:9/v1",  # never called: these envs' evaluate() does not generate
    "--openai.model_name",
    "none",
    "--openai.health_check",
    "false",
]


def _worker(env_file: Path, tmp_path: Path, tokenizer: Path) -> EvalWorker:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    flags = [*FLAGS, "--env.tokenizer_name", str(tokenizer)]
    return EvalWorker(env_file, flags, tmp_path / "evaluator.log", cwd=REPO, env=env)


def _alive(pid: int) -> bool:
    done = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True)
    return bool(done.stdout.strip()) and not done.stdout.strip().startswith("Z")


def test_one_process_sets_the_env_up_once_and_evaluates_each_time(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    worker = _worker(METRICS_ENV, tmp_path, tiny_model_dir)
    try:
        first = worker.evaluate(tmp_path / "evals" / "before", timeout=300)
        assert worker.proc is not None
        pid = worker.proc.pid
        second = worker.evaluate(tmp_path / "evals" / "after", timeout=300)
        assert worker.proc is not None and worker.proc.pid == pid  # the same process
    finally:
        worker.close()
    # MetricsEnv counts its evaluate() calls from setup(): set up once, evaluated twice
    assert first["eval/run"] == 1.0 and second["eval/run"] == 2.0
    assert first["eval_seconds"] > 0
    for label in ("before", "after"):
        folder = tmp_path / "evals" / label
        assert (folder / "metrics.json").is_file()
        assert "data_dir_to_save_evals" in (folder / "evaluate_config.yaml").read_text()
        assert (folder / "evaluate.log").is_file()
    assert not _alive(pid)


def test_a_failing_evaluation_is_reported_and_the_next_runs(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    env_file = tmp_path / "flaky_env.py"
    env_file.write_text(
        "from tests.envs.metrics_env import MetricsEnv\n\n\n"
        "class FlakyEnv(MetricsEnv):\n"
        "    async def evaluate(self, *args, **kwargs):\n"
        "        if self.evals == 0:\n"
        "            self.evals += 1\n"
        "            raise RuntimeError('the grader broke')\n"
        "        await super().evaluate()\n"
        "        if self.evals == 3:\n"
        "            import os\n"
        "            os._exit(3)\n\n\n"
        "if __name__ == '__main__':\n"
        "    FlakyEnv.cli()\n"
    )
    worker = _worker(env_file, tmp_path, tiny_model_dir)
    try:
        with pytest.raises(EvaluationError, match="the grader broke"):
            worker.evaluate(tmp_path / "evals" / "first", timeout=300)
        assert (
            "RuntimeError: the grader broke"
            in (tmp_path / "evals" / "first" / "evaluate.log").read_text()
        )
        assert worker.evaluate(tmp_path / "evals" / "second", timeout=300)["eval/run"] == 2.0
        with pytest.raises(EvaluationError, match="exited with 3"):
            worker.evaluate(tmp_path / "evals" / "third", timeout=300)
        assert worker.proc is None
        # the next evaluation starts a new process, set up afresh (its first call fails again)
        with pytest.raises(EvaluationError, match="the grader broke"):
            worker.evaluate(tmp_path / "evals" / "fourth", timeout=300)
        assert worker.evaluate(tmp_path / "evals" / "fifth", timeout=300)["eval/run"] == 2.0
    finally:
        worker.close()
    assert worker.proc is None
