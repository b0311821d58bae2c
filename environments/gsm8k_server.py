"""GSM8K: grade-school math, answers verified with ``math-verify`` (upstream's ``gsm8k_server``).

Reward (as upstream, see ``atroposlib.envs.math_verify_env``): +1 when the ``\\boxed{}`` answer
after ``</think>`` equals the gold answer (math-verify), -1 otherwise; when a whole group is
correct, a length penalty scales scores down linearly above 50% of ``max_token_length``.
Completions with fewer than ``min_completion_tokens`` trainable tokens are dropped. Groups whose
scores are all equal are dropped only when ``ensure_scores_are_not_same`` is on (upstream always
dropped them, so ``group_size=1`` never produced data; ``process`` turns the check off).

Data: the copy of GSM8K bundled with the repository (``environments/data/gsm8k``, train / test,
MIT, the same rows as the Hub's ``gsm8k``/``main``) by default, so nothing is downloaded;
``--env.dataset_path hub`` loads ``load_dataset("gsm8k", "main")`` as upstream did, and any other
``--env.dataset_path`` reads a local folder with ``train.jsonl`` and ``test.jsonl`` (or one JSONL
file used for both), rows ``{"question", "answer": "... #### N"}``.

    run-api --port 8000 &  atropos-serve --port 9001 &
    python environments/gsm8k_server.py process --env.total_steps 4 --env.use_wandb false
    python environments/gsm8k_server.py evaluate --env.max_eval_items 50 --env.use_wandb false \\
        --env.data_dir_to_save_evals evals/gsm8k
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import Field

from atroposlib.envs.math_verify_env import MathVerifyEnv, MathVerifyEnvConfig
from atroposlib.scoring import math as math_scoring
from atroposlib.utils.data import load_rows

BUNDLED_GSM8K = Path(__file__).resolve().parent / "data" / "gsm8k"
"""GSM8K shipped with the repository (train.jsonl, test.jsonl; MIT, see its README)."""

_CALCULATOR = re.compile(r"<<[^>]*>>")


def worked_solution(answer: str) -> str:
    """A GSM8K reference solution as a model should write it: the steps without the
    dataset's ``<<48/2=24>>`` calculator notes, then ``The answer is \\boxed{N}.``"""
    steps, _, final = answer.rpartition("####")
    steps = _CALCULATOR.sub("", steps).strip()
    return f"{steps}\nThe answer is \\boxed{{{final.strip()}}}."


def few_shot_examples(rows: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """The ``count`` rows with the shortest solutions (ties: dataset order), for worked
    examples: short ones teach a short answer and cost the fewest prompt tokens."""
    if count <= 0:
        return []
    ranked = sorted(range(len(rows)), key=lambda i: (len(rows[i]["answer"]), i))
    return [rows[i] for i in ranked[:count]]


class GSM8kEnvConfig(MathVerifyEnvConfig):
    """Settings of the GSM8K environment."""

    dataset_path: str | None = Field(
        default=None,
        description="GSM8K to use: a folder with train.jsonl/test.jsonl or one JSONL file "
        "(rows {question, answer}); 'hub' for load_dataset('gsm8k', 'main'); default: the copy "
        "bundled in environments/data/gsm8k",
    )


class GSM8kEnv(MathVerifyEnv):
    """GSM8K with math-verify rewards (+1 / -1, length penalty when all are right)."""

    name = "gsm8k"
    env_config_cls = GSM8kEnvConfig

    def load_split(self, split: str) -> list[dict[str, Any]]:
        """``[{question, answer}]`` for ``train`` or ``test``."""
        if self.config.dataset_path == "hub":
            from datasets import load_dataset

            return [dict(row) for row in load_dataset("gsm8k", "main", split=split)]
        return load_rows(self.config.dataset_path or BUNDLED_GSM8K, split)

    def gold_for(self, item: dict[str, Any]) -> str:
        """The gold answer of a row: the number after ``####``."""
        return math_scoring.gsm8k_gold_answer(item["answer"])

    def worked_examples(self, train: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The ``few_shot`` shortest training solutions."""
        return few_shot_examples(train, self.config.few_shot)

    def worked_answer(self, row: dict[str, Any]) -> str:
        return worked_solution(row["answer"])


if __name__ == "__main__":
    GSM8kEnv.cli()
