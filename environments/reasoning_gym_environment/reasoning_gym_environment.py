"""Reasoning Gym: procedural reasoning tasks generated offline (upstream's ``ReasoningGymEnv``).

Items come from ``reasoning-gym`` generators (``basic_arithmetic``, ``gsm_symbolic``,
``chain_sum``, ``leg_counting``... 106 of them, ``--env.tasks``; ``all`` picks every one), one
fresh seeded item per rollout, so a run needs no dataset download at all. Evaluation uses a fixed
set of ``num_eval_samples_per_task`` items per task generated from ``eval_seed``.

Reward (0 to 1, as upstream): the task's own ``score_answer``, taking the better of two formats
of the extracted answer -- the bare answer and the answer wrapped in ``<answer>`` tags (task
verifiers differ in which they expect). The answer is the content of the single ``<answer>`` tag
outside ``<think>`` (two or more such tags score 0, as upstream); upstream gives 0 when there is
no tag at all, we fall back to the ``\\boxed{}`` answer, the last "answer is ..." statement or
else the last non-empty line unless
``require_answer_tags`` is on (small models rarely use the tags). When every completion of a
group scores at least 0.5, scores are scaled down linearly above 75% of ``max_token_length``
(upstream's penalty); a completion cut off by the length limit gets ``set_advantage_to_zero``
when ``mask_too_long_completions`` is on.

    run-api --port 8000 &  atropos-serve --port 9001 &
    python environments/reasoning_gym_environment/reasoning_gym_environment.py process \\
        --env.tasks basic_arithmetic,gsm_symbolic --env.total_steps 4 --env.use_wandb false
    python environments/reasoning_gym_environment/reasoning_gym_environment.py evaluate \\
        --env.tasks basic_arithmetic --env.num_eval_samples_per_task 20 --env.use_wandb false
"""

from __future__ import annotations

import difflib
import logging
import random
import re
from typing import Any

from pydantic import Field, field_validator

from atroposlib.envs.base import BaseEnv, ScoredDataGroup
from atroposlib.envs.config import LocalEnvConfig
from atroposlib.envs.rollout import (
    Sample,
    apply_length_penalty,
    eval_completion,
    group_from_samples,
    sample_chat_group,
)
from atroposlib.envs.server_handling.server_baseline import local_server_configs
from atroposlib.scoring.math import extract_boxed, strip_think

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_TASKS",
    "ReasoningGymEnv",
    "ReasoningGymEnvConfig",
    "extract_answer",
    "known_tasks",
    "score_answer",
]

SYSTEM_PROMPT = (
    "You are a deep thinking AI, you may use extremely long chains of thought to deeply consider "
    "the problem and deliberate with yourself via systematic reasoning processes to help come to "
    "a correct solution prior to answering. You should enclose your thoughts and internal "
    "monologue inside <think> </think> tags, and then provide your solution or response to the "
    "problem. After your thinking, make sure to clearly provide your final answer inside "
    "<answer></answer> tags. You can provide context, explanation, etc before and after your "
    "answer tags/answer, but you must provide a single answer and place it inside <answer> tags."
)

DEFAULT_TASKS = ["basic_arithmetic", "chain_sum", "gsm_symbolic", "leg_counting", "gcd"]

_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL | re.IGNORECASE)
_ANSWER_STATEMENT = re.compile(r"\banswer\s*(?:is|:|=)\s*:?\s*([^\n]+)", re.IGNORECASE)
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)


def known_tasks() -> list[str]:
    """Every reasoning-gym generator name."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def extract_answer(text: str | None, *, require_tags: bool = False) -> str | None:
    """The answer a completion commits to, or None.

    The content of the single ``<answer>`` tag outside ``<think>`` blocks (None when there are
    two or more, as upstream); without a tag, unless ``require_tags``, the ``\\boxed{}`` answer
    after ``</think>``, else what follows its last "answer is" / "answer:", else its last
    non-empty line.
    """
    if not text:
        return None
    outside = _THINK_BLOCK.sub("", text)
    tags = _ANSWER_TAG.findall(outside)
    if len(tags) > 1:
        return None
    if tags:
        return tags[0].strip()
    if _ANSWER_TAG.search(text):  # a tag only inside <think>: upstream still takes the last one
        return _ANSWER_TAG.findall(text)[-1].strip()
    if require_tags:
        return None
    body = strip_think(text)
    if "<think>" in body:  # never closed: nothing was committed to
        return None
    boxed = extract_boxed(body)
    if boxed is not None:
        return boxed.strip() or None
    statements = _ANSWER_STATEMENT.findall(body)
    if statements:
        return statements[-1].strip().rstrip(".").strip() or None
    lines = [line.strip() for line in body.strip().splitlines() if line.strip()]
    if not lines:
        return None
    return lines[-1].rstrip(".").strip() or None


def score_answer(dataset: Any, entry: dict[str, Any], answer: str | None) -> float:
    """The task's ``score_answer`` for ``answer``, the better of the bare and the
    ``<answer>``-tagged form, clamped to 0..1 (a verifier that raises scores 0)."""
    if answer is None:
        return 0.0
    best = 0.0
    for form in (answer, f"<answer>{answer}</answer>"):
        try:
            value = float(dataset.score_answer(answer=form, entry=entry))
        except Exception:
            value = 0.0
        best = max(best, min(1.0, max(0.0, value)))
    return best


class ReasoningGymEnvConfig(LocalEnvConfig):
    """Settings of the reasoning-gym environment."""

    group_size: int = 8
    use_wandb: bool = True
    total_steps: int = 250
    batch_size: int = 12
    steps_per_eval: int = 25
    max_token_length: int = 1024

    tasks: list[str] = Field(
        default_factory=lambda: list(DEFAULT_TASKS),
        validate_default=True,
        description="reasoning-gym tasks to draw from: a list or 'a,b,c'; 'all' for every task",
    )
    seed: int = Field(default=42, description="Seed of the training item generator")
    eval_seed: int = Field(default=123, description="Seed of the fixed evaluation set")
    num_eval_samples_per_task: int = Field(
        default=5, ge=1, description="Evaluation items generated per task"
    )
    require_answer_tags: bool = Field(
        default=False,
        description="Score 0 without an <answer> tag (upstream); off: fall back to \\boxed{} "
        "or the last line",
    )
    mask_too_long_completions: bool = Field(
        default=True, description="Zero the advantage of completions cut off by the length limit"
    )
    length_penalty_threshold: float = Field(
        default=0.75,
        gt=0.0,
        lt=1.0,
        description="All-correct groups: penalise tokens above this share of max_token_length",
    )
    min_completion_tokens: int = Field(
        default=10, ge=0, description="Drop completions with fewer trainable tokens (upstream 10)"
    )
    temperature: float = Field(default=1.0, ge=0.0, description="Sampling temperature (train)")
    eval_temperature: float = Field(default=0.1, ge=0.0, description="Temperature for evaluate")
    system_prompt: str = Field(default=SYSTEM_PROMPT, description="System prompt")

    @field_validator("tasks", mode="before")
    @classmethod
    def _check_tasks(cls, value: Any) -> list[str]:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
            raise ValueError("must be a list of task names or 'a,b,c'")
        # the CLI hands a list of words: `--env.tasks a b`, `--env.tasks a,b` or both
        value = [t.strip() for word in value for t in word.split(",") if t.strip()]
        known = known_tasks()
        if value == ["all"]:
            return known
        if not value:
            raise ValueError("needs at least one task")
        for task in value:
            if task not in known:
                close = difflib.get_close_matches(task, known, n=3)
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise ValueError(
                    f"unknown reasoning-gym task {task!r}{hint}; {len(known)} tasks exist, "
                    "e.g. basic_arithmetic, gsm_symbolic, chain_sum"
                )
        return value


class ReasoningGymEnv(BaseEnv):
    """reasoning-gym tasks scored by each task's own verifier."""

    name = "reasoning_gym"
    env_config_cls = ReasoningGymEnvConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.iter = 0
        self.rng = random.Random(self.config.seed)
        self.test: list[tuple[dict[str, Any], Any]] = []

    default_server_configs = local_server_configs()

    # ------------------------------------------------------------------ data

    @staticmethod
    def make_item(task: str, seed: int) -> tuple[dict[str, Any], Any]:
        """One generated item of ``task`` and the dataset object that scores it."""
        import reasoning_gym

        dataset = reasoning_gym.create_dataset(task, size=1, seed=seed)
        return dataset[0], dataset

    async def setup(self) -> None:
        self.iter = 0
        self.rng = random.Random(self.config.seed)
        self.test = []
        for task in self.config.tasks:
            import reasoning_gym

            dataset = reasoning_gym.create_dataset(
                task, size=self.config.num_eval_samples_per_task, seed=self.config.eval_seed
            )
            self.test.extend((dataset[i], dataset) for i in range(len(dataset)))

    async def get_next_item(self) -> dict[str, Any]:
        task = self.rng.choice(self.config.tasks)
        entry, dataset = self.make_item(task, self.config.seed + self.iter)
        self.iter += 1
        return {"task": task, "entry": entry, "dataset": dataset}

    def save_checkpoint(self, step: int, data: dict[str, Any] | None = None) -> None:
        data = dict(data or {})
        data["iter"] = self.iter
        super().save_checkpoint(step, data)

    def messages_for(self, entry: dict[str, Any]) -> list[dict[str, str]]:
        """The chat sent to the model."""
        return [
            {"role": "system", "content": self.config.system_prompt},
            {"role": "user", "content": entry["question"]},
        ]

    # ------------------------------------------------------------------ scoring

    def score_text(self, text: str, entry: dict[str, Any], dataset: Any) -> float:
        """The reward of one completion (0..1)."""
        answer = extract_answer(text, require_tags=self.config.require_answer_tags)
        return score_answer(dataset, entry, answer)

    def score_samples(
        self, samples: list[Sample], entry: dict[str, Any], dataset: Any
    ) -> ScoredDataGroup | None:
        """One group's ScoredDataGroup; None when nothing is left to train on."""
        kept = [s for s in samples if s.trainable_tokens >= self.config.min_completion_tokens]
        if not kept:
            return None
        group = group_from_samples(
            kept,
            [self.score_text(s.text, entry, dataset) for s in kept],
            group_size=self.config.group_size,
        )
        mask_too_long = self.config.mask_too_long_completions
        group["overrides"] = [
            {"set_advantage_to_zero": True} if mask_too_long and s.finish_reason == "length" else {}
            for s in kept
        ]
        self.log_train_metric(
            "train/percent_correct", [1.0 if s >= 0.5 else 0.0 for s in group["scores"]]
        )
        # every answer at least half right: prefer the shorter ones
        apply_length_penalty(
            self, group, full_score=0.5, threshold=self.config.length_penalty_threshold
        )
        return group  # a flat group is dropped (and counted) by the sender

    async def collect_trajectories(
        self, item: dict[str, Any]
    ) -> tuple[ScoredDataGroup | None, list]:
        samples = await sample_chat_group(
            self,
            self.messages_for(item["entry"]),
            n=self.config.group_size,
            max_tokens=self.config.max_token_length,
            temperature=self.config.temperature,
        )
        return self.score_samples(samples, item["entry"], item["dataset"]), []

    # ------------------------------------------------------------------ evaluation

    async def rollout_and_score_eval(self, entry: dict[str, Any], dataset: Any) -> dict[str, Any]:
        """One answer to a fixed eval item, scored by the task."""
        messages = self.messages_for(entry)
        text, finish = await eval_completion(
            self, messages, self.config.max_token_length, self.config.eval_temperature
        )
        answer = extract_answer(text, require_tags=self.config.require_answer_tags)
        score = score_answer(dataset, entry, answer)
        return {
            "messages": [*messages, {"role": "assistant", "content": text}],
            "task": entry.get("metadata", {}).get("source_dataset", "unknown"),
            "question": entry["question"],
            "expected_answer": str(entry.get("answer", "")),
            "extracted_answer": answer,
            "score": score,
            "correct": score >= 0.5,
            "finish_reason": finish,
        }

    def summarize_eval(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        """Mean task score (``eval/percent_correct``, upstream's key), share of answers at least
        0.5, share with an extractable answer, share using ``<answer>`` tags, and the mean
        score per task."""
        n = max(1, len(samples))
        metrics = {
            "eval/percent_correct": sum(s["score"] for s in samples) / n,
            "eval/percent_at_least_half": sum(s["correct"] for s in samples) / n,
            "eval/percent_answered": sum(s["extracted_answer"] is not None for s in samples) / n,
            "eval/percent_answer_tags": sum(
                extract_answer(s["messages"][-1]["content"], require_tags=True) is not None
                for s in samples
            )
            / n,
            "eval/num_items": float(len(samples)),
        }
        for task in self.config.tasks:
            scores = [s["score"] for s in samples if s["task"] == task]
            if scores:
                metrics[f"eval/{task}/score"] = sum(scores) / len(scores)
        return metrics

    async def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        return await self.run_eval(
            [self.rollout_and_score_eval(entry, ds) for entry, ds in self.test],
            self.summarize_eval,
            generation_parameters={
                "temperature": self.config.eval_temperature,
                "max_tokens": self.config.max_token_length,
            },
        )


if __name__ == "__main__":
    ReasoningGymEnv.cli()
