"""MATH-style problems (competition math, LaTeX answers) verified with ``math-verify``.

Same scoring as :mod:`gsm8k_server` (+1 / -1, length penalty when all are right), with gold
answers that are LaTeX expressions (``\\frac{1}{2}``, ``3\\sqrt{2}``...). Data: upstream trains on
``zwhe99/DeepMath-103K`` (``question``, ``final_answer``) and evaluates on
``HuggingFaceH4/MATH-500`` (``problem``, ``answer``) from the Hub; ``--env.dataset_path`` reads a
local folder with ``train.jsonl``/``test.jsonl`` (or one file) whose rows carry a problem field
and an answer field (``question_field`` / ``answer_field``).

    python environments/math_server.py process --env.dataset_path my_math/ --env.total_steps 4
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

from pydantic import Field

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gsm8k_server import GSM8kEnv, GSM8kEnvConfig, load_rows  # noqa: E402


class MathEnvConfig(GSM8kEnvConfig):
    """Settings of the MATH-style environment."""

    question_field: str = Field(default="problem", description="Row field holding the problem")
    answer_field: str = Field(default="answer", description="Row field holding the final answer")
    train_dataset: str = Field(
        default="zwhe99/DeepMath-103K", description="Hub training set (without dataset_path)"
    )
    eval_dataset: str = Field(
        default="HuggingFaceH4/MATH-500", description="Hub eval set (without dataset_path)"
    )


class MathEnv(GSM8kEnv):
    """Competition math with math-verify rewards."""

    name = "math"
    env_config_cls = MathEnvConfig

    @classmethod
    def config_init(cls):
        config, servers = super().config_init()
        return MathEnvConfig(**{**config.model_dump(), "wandb_name": "math"}), servers

    def _normalise(self, row: dict[str, Any]) -> dict[str, Any]:
        cfg = self.config
        question = row.get(cfg.question_field, row.get("question"))
        answer = row.get(cfg.answer_field, row.get("final_answer"))
        if question is None or answer is None:
            raise ValueError(
                f"row lacks question_field {cfg.question_field!r} or answer_field "
                f"{cfg.answer_field!r}: keys are {sorted(row)}"
            )
        return {"question": str(question), "answer": str(answer)}

    def load_split(self, split: str) -> list[dict[str, Any]]:
        if self.config.dataset_path:
            rows = load_rows(self.config.dataset_path, split)
        else:
            from datasets import load_dataset

            name = self.config.train_dataset if split == "train" else self.config.eval_dataset
            rows = [
                dict(r) for r in load_dataset(name, split="train" if split == "train" else "test")
            ]
        return [self._normalise(r) for r in rows]

    def gold_for(self, item: dict[str, Any]) -> str:
        return item["answer"]

    async def setup(self) -> None:
        self.train = self.load_split("train")
        random.Random(self.config.seed).shuffle(self.train)
        test = self.load_split("test")
        if self.config.max_eval_items >= 0:
            test = test[: self.config.max_eval_items]
        self.test = [{"question": r["question"], "gold_answer": r["answer"]} for r in test]
        self.iter = 0


if __name__ == "__main__":
    MathEnv.cli()
