"""MATH-style problems (competition math, LaTeX answers) verified with ``math-verify``.

Same scoring as ``gsm8k_server`` (``atroposlib.envs.math_verify_env``: +1 / -1, length penalty
when all are right), with gold answers that are LaTeX expressions (``\\frac{1}{2}``,
``3\\sqrt{2}``...). Data: upstream trains on ``zwhe99/DeepMath-103K`` (``question``,
``final_answer``) and evaluates on ``HuggingFaceH4/MATH-500`` (``problem``, ``answer``) from the
Hub; ``--env.dataset_path`` reads a local folder with ``train.jsonl``/``test.jsonl`` (or one
file) whose rows carry a problem field and an answer field (``question_field`` /
``answer_field``).

    python environments/math_server.py process --env.dataset_path my_math/ --env.total_steps 4
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from atroposlib.envs.math_verify_env import MathVerifyEnv, MathVerifyEnvConfig
from atroposlib.utils.data import load_rows


class MathEnvConfig(MathVerifyEnvConfig):
    """Settings of the MATH-style environment."""

    question_field: str = Field(default="problem", description="Row field holding the problem")
    answer_field: str = Field(default="answer", description="Row field holding the final answer")
    train_dataset: str = Field(
        default="zwhe99/DeepMath-103K", description="Hub training set (without dataset_path)"
    )
    eval_dataset: str = Field(
        default="HuggingFaceH4/MATH-500", description="Hub eval set (without dataset_path)"
    )


class MathEnv(MathVerifyEnv):
    """Competition math with math-verify rewards."""

    name = "math"
    env_config_cls = MathEnvConfig

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


if __name__ == "__main__":
    MathEnv.cli()
