"""``MathVerifyEnv``: math word problems graded with ``math-verify`` (GSM8K, MATH...).

Reward (as upstream's ``gsm8k_server``): +1 when the ``\\boxed{}`` answer after ``</think>``
equals the gold answer (math-verify), -1 otherwise; when a whole group is correct, a length
penalty scales scores down linearly above 50% of ``max_token_length``. Completions with fewer
than ``min_completion_tokens`` trainable tokens are dropped. Groups whose scores are all equal
are dropped only when ``ensure_scores_are_not_same`` is on. ``format_reward`` / ``box_reward``
add credit for a well-formed final answer, ``finish_reward`` for a reply that ends on its own.

A subclass says where the rows come from (``load_split``: ``[{"question", "answer"}]``) and
what the gold answer of a row is (``gold_for``); it may show worked examples
(``worked_examples`` / ``worked_answer``). The bundled ``environments/gsm8k_server.py`` and
``environments/math_server.py`` are such subclasses.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Iterable
from typing import Annotated, Any

from pydantic import Field, model_validator

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
from atroposlib.scoring import math as math_scoring

__all__ = ["SYSTEM_PROMPT", "MathVerifyEnv", "MathVerifyEnvConfig"]

SYSTEM_PROMPT = (
    "You are a deep thinking AI, you may use extremely long chains of thought "
    "to deeply consider the problem and deliberate with yourself via systematic "
    "reasoning processes to help come to a correct solution prior to answering. "
    "You should enclose your thoughts and internal monologue inside <think> </think> "
    "tags, and then provide your solution or response to the problem.\n\n"
    "You will then provide your answer like this: \\boxed{your answer here}\n"
    "It is important that you provide your answer in the correct format.\n"
    "If you do not, you will not receive credit for your answer.\n"
    "So please end your answer with \\boxed{your answer here}"
)
"""Upstream's GSM8K system prompt."""


class MathVerifyEnvConfig(LocalEnvConfig):
    """Settings of the math-verify environments (upstream's GSM8K defaults)."""

    group_size: int = 8
    use_wandb: bool = True
    total_steps: int = 1000
    batch_size: int = 12
    steps_per_eval: int = 100
    # greedy evaluations run 64 at a time (upstream: 16), so replies of up to a few hundred
    # tokens decode as one batch (64 GSM8K test problems on the embedded server: 67 s at 16,
    # 50 s at 64; the gsm8k-format recipe's 200-problem evaluations moved little)
    max_eval_workers: int = 64

    dataset_path: str | None = Field(
        default=None,
        description="Local data: a folder with train.jsonl/test.jsonl or one JSONL file",
    )
    max_eval_items: int = Field(
        default=-1, description="Evaluate on the first N test rows (-1: all of them)"
    )
    temperature: float = Field(default=1.0, ge=0.0, description="Sampling temperature (train)")
    final_temperature: float | None = Field(
        default=None,
        ge=0.0,
        description="Anneal the training temperature linearly from temperature (groups sampled "
        "before the trainer's first step) to this one (groups for its last step, total_steps); "
        "None keeps temperature throughout. A greedy evaluation falls into loops that sampling "
        "escapes, so training sees them only at a low temperature, while a low temperature at "
        "the start leaves most groups scoring alike. Not in the gsm8k-format recipe: 0.4 to "
        "0.2 did worse there than either temperature held (example_trainer/README.md)",
    )
    eval_temperature: float = Field(
        default=0.0, ge=0.0, description="Sampling temperature for evaluate()"
    )
    temperatures: list[Annotated[float, Field(ge=0.0)]] | None = Field(
        default=None,
        min_length=1,
        description="Sample each training group at several temperatures: group_size split "
        "evenly among them, in order (e.g. [0.3, 0.5]: half the replies at each; 0 is "
        "greedy). Each reply is sent with its own temperature (the group's overrides), so the "
        "trainer scales its logits by it. A low temperature samples the loops a greedy "
        "evaluation falls into, a higher one keeps groups scoring differently. Replaces "
        "temperature; not with final_temperature. Not in the gsm8k-format recipe: [0.3, 0.5] "
        "took one seed over the bar and left two under it (example_trainer/README.md)",
    )
    min_completion_tokens: int = Field(
        default=10, ge=0, description="Drop completions with fewer trainable tokens (upstream: 10)"
    )
    refill_short: int = Field(
        default=2,
        ge=0,
        description="Rounds of new replies sampled for those dropped as too short "
        "(min_completion_tokens), so that a group keeps group_size replies. A short group packs "
        "into a batch of whole groups only beside other short ones (a batch of 32 from groups "
        "of 16 never takes a group of 15): it waited in run-api's queue until the run ended. "
        "0: upstream's behaviour, the group is sent short (group_overrides.group_size)",
    )
    length_penalty: bool = Field(
        default=True, description="Penalise long answers when the whole group is correct"
    )
    system_prompt: str = Field(
        default=SYSTEM_PROMPT, description="System prompt ('' sends no system message)"
    )
    prompt_suffix: str = Field(
        default="",
        description="Appended to every question in the user turn, e.g. a format instruction "
        "('\\n\\nWrite the final answer as \\boxed{N}.')",
    )
    max_answer_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Generation budget per reply (tokens); default: max_token_length (upstream)",
    )
    eval_max_answer_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Generation budget of evaluate()'s replies; default: max_answer_tokens "
        "(the training budget). Not in the gsm8k-format recipe: training at 96 tokens for a "
        "128-token evaluation stalled there (example_trainer/README.md)",
    )
    format_reward: float = Field(
        default=0.0,
        description="Added to the score of a reply whose final answer is well formed, right or "
        "wrong: it ended within the budget with exactly one \\boxed{}, holding a number",
    )
    box_reward: float = Field(
        default=0.0,
        description="Added to the score of a reply that ended within the budget with exactly one "
        "complete \\boxed{...} holding a digit, number or not (a first step toward "
        "format_reward's well-formed answer; \\boxed{N} copied from an instruction earns none)",
    )
    finish_reward: float = Field(
        default=0.0,
        description="Added to the score of a reply that ended on its own within the budget "
        "(finish_reason 'stop', not cut off), whatever its answer: a signal against replies "
        "that loop until the budget runs out, and one that splits groups whose replies all "
        "miss the answer. Not in the gsm8k-format recipe: there a run learned to finish "
        "without a box (0.0% well-formed) and then had no signal left",
    )
    strict_answer: bool = Field(
        default=False,
        description="Count a reply right only when its final answer is well formed (it ended "
        "within the budget with exactly one \\boxed{} holding a number: format_reward's rule). "
        "Off (upstream), a right number in any box counts, also in a reply that the budget cut "
        "off while it repeated boxes, so a loop that boxes a number from the question scores "
        "above a well-formed wrong answer when that number happens to be the answer",
    )
    format_min_tokens: int = Field(
        default=0,
        ge=0,
        description="format_reward, box_reward and finish_reward only for replies of at least "
        "this many tokens: a bare \\boxed{} guess without the working earns no format credit",
    )
    few_shot: int = Field(
        default=0,
        ge=0,
        le=8,
        description="Worked examples shown before each question as earlier chat turns: the "
        "shortest solutions of the train split, ending in \\boxed{N} (never asked themselves)",
    )
    seed: int = Field(default=42, description="Shuffle seed of the training set")

    @model_validator(mode="after")
    def _one_temperature_schedule(self) -> MathVerifyEnvConfig:
        if self.temperatures is not None and self.final_temperature is not None:
            raise ValueError(
                "temperatures and final_temperature both set: a group is sampled at the listed "
                "temperatures or at one annealed temperature, not both"
            )
        return self


class MathVerifyEnv(BaseEnv):
    """Math problems with math-verify rewards (+1 / -1, length penalty when all are right)."""

    env_config_cls = MathVerifyEnvConfig
    default_server_configs = local_server_configs(num_requests_for_eval=64)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.iter = 0
        self.examples: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ data

    def load_split(self, split: str) -> list[dict[str, Any]]:
        """``[{"question", "answer", ...}]`` for ``train`` or ``test``."""
        raise NotImplementedError

    def gold_for(self, item: dict[str, Any]) -> str:
        """The gold answer of a row (what math-verify compares the reply with)."""
        raise NotImplementedError

    def worked_examples(self, train: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Training rows shown as worked examples before every question (never asked);
        none by default."""
        return []

    def worked_answer(self, row: dict[str, Any]) -> str:
        """The assistant turn of a worked example."""
        raise NotImplementedError

    async def setup(self) -> None:
        self.train = self.load_split("train")
        # worked examples: the same for every seed, so evaluations stay comparable
        self.examples = self.worked_examples(self.train)
        shown = {row["question"] for row in self.examples}
        self.train = [row for row in self.train if row["question"] not in shown]
        random.Random(self.config.seed).shuffle(self.train)
        test = self.load_split("test")
        if self.config.max_eval_items >= 0:
            test = test[: self.config.max_eval_items]
        self.test = [
            {"question": row["question"], "gold_answer": self.gold_for(row)} for row in test
        ]
        self.iter = 0

    async def get_next_item(self) -> dict[str, Any]:
        row = self.train[self.iter % len(self.train)]
        self.iter += 1
        return row

    def save_checkpoint(self, step: int, data: dict[str, Any] | None = None) -> None:
        data = dict(data or {})
        data["iter"] = self.iter
        super().save_checkpoint(step, data)

    @property
    def budget(self) -> int:
        """Tokens a training reply may have."""
        return self.config.max_answer_tokens or self.config.max_token_length

    @property
    def eval_budget(self) -> int:
        """Tokens an evaluation reply may have."""
        return self.config.eval_max_answer_tokens or self.budget

    def messages_for(self, question: str) -> list[dict[str, str]]:
        """The chat sent to the model: system prompt, worked examples, the question (with
        ``prompt_suffix``)."""
        messages = []
        if self.config.system_prompt:
            messages.append({"role": "system", "content": self.config.system_prompt})
        suffix = self.config.prompt_suffix
        for row in self.examples:
            messages.append({"role": "user", "content": row["question"] + suffix})
            messages.append({"role": "assistant", "content": self.worked_answer(row)})
        messages.append({"role": "user", "content": question + suffix})
        return messages

    # ------------------------------------------------------------------ rollouts

    async def collect_trajectories(
        self, item: dict[str, Any]
    ) -> tuple[ScoredDataGroup | None, list]:
        messages = self.messages_for(item["question"])
        samples = await self.sample_replies(messages, self.group_temperatures())
        samples = await self.refill_short_samples(messages, samples)
        # each sample records the temperature it was drawn at (Sample.generation_params), and
        # the group carries it (per sequence when they differ), so the trainer scales its
        # logits by it
        return self.score_samples(samples, self.gold_for(item)), []

    async def sample_replies(
        self, messages: list[dict[str, Any]], pairs: Iterable[tuple[float, int]]
    ) -> list[Sample]:
        """Replies to ``messages``: for each ``(temperature, count)`` pair, ``count`` of them
        sampled at that temperature, all requests at once."""
        draws = [
            sample_chat_group(
                self, messages, n=count, max_tokens=self.budget, temperature=temperature
            )
            for temperature, count in pairs
        ]
        return [sample for drawn in await asyncio.gather(*draws) for sample in drawn]

    async def refill_short_samples(
        self, messages: list[dict[str, Any]], samples: list[Sample]
    ) -> list[Sample]:
        """``samples`` with each reply under ``min_completion_tokens`` replaced by a new one
        sampled at the same temperature, for up to ``refill_short`` rounds (replies still short
        after them are dropped by :meth:`score_samples`). Counted as ``train/refilled``."""
        minimum = self.config.min_completion_tokens
        refilled = 0
        for _ in range(self.config.refill_short):
            short = [s for s in samples if s.trainable_tokens < minimum]
            if not short:
                break
            default = self.sampling_temperature()
            temperatures = Counter(
                float(s.generation_params.get("temperature", default)) for s in short
            )
            kept = [s for s in samples if s.trainable_tokens >= minimum]
            samples = kept + await self.sample_replies(messages, temperatures.items())
            refilled += len(short)
        self.log_train_metric("train/refilled", [float(refilled)])
        return samples

    def sampling_temperature(self) -> float:
        """The training temperature now: ``temperature``, or on the way to
        ``final_temperature`` as the trainer's step (``curr_step``) nears ``total_steps``."""
        cfg = self.config
        if cfg.final_temperature is None:
            return cfg.temperature
        done = min(1.0, max(0, self.curr_step) / max(1, cfg.total_steps - 1))
        return cfg.temperature + (cfg.final_temperature - cfg.temperature) * done

    def group_temperatures(self) -> list[tuple[float, int]]:
        """``(temperature, replies)`` pairs a training group is sampled as: ``temperatures``
        sharing ``group_size`` evenly (the first ones take the remainder), or
        ``group_size`` replies at :meth:`sampling_temperature`. Logs ``train/temperature``
        (the mean over the group's replies)."""
        size = self.config.group_size
        if self.config.temperatures is None:
            pairs = [(self.sampling_temperature(), size)]
        else:
            share, extra = divmod(size, len(self.config.temperatures))
            pairs = [(t, share + (i < extra)) for i, t in enumerate(self.config.temperatures)]
            pairs = [(t, n) for t, n in pairs if n > 0]
        self.log_train_metric("train/temperature", sum(t * n for t, n in pairs) / max(1, size))
        return pairs

    def _score_sample(self, sample: Sample, gold_parsed: Any) -> float:
        """1 for the right answer (a well-formed one with ``strict_answer``), -1 otherwise,
        plus format credit for a reply of enough tokens: finished (``finish_reward``), and with
        exactly one box (``box_reward``, ``format_reward``)."""
        parsed = math_scoring.parse_response(sample.text)
        right = math_scoring.verify_answer(parsed, gold_parsed)
        if right and self.config.strict_answer:
            right = math_scoring.final_boxed_number(sample.text, sample.finish_reason) is not None
        score = 1.0 if right else -1.0
        if sample.trainable_tokens < self.config.format_min_tokens:
            return score
        if sample.finish_reason == "stop":  # not cut off ("length") or aborted
            score += self.config.finish_reward
        box = math_scoring.final_box(sample.text, sample.finish_reason)
        if box is not None:
            if math_scoring.number_in_box(box) is not None:
                score += self.config.format_reward
            if any(c.isdigit() for c in box):
                score += self.config.box_reward
        return score

    def score_samples(self, samples: list[Sample], gold: str) -> ScoredDataGroup | None:
        """Upstream's GSM8K scoring of one group; None when nothing is left to train on."""
        gold_parsed = math_scoring.parse_gold(gold)
        if not gold_parsed:
            return None  # an unparseable gold answer teaches nothing
        kept = [s for s in samples if s.trainable_tokens >= self.config.min_completion_tokens]
        if not kept:
            return None
        group = group_from_samples(
            kept,
            [self._score_sample(s, gold_parsed) for s in kept],
            group_size=self.config.group_size,
        )
        cfg = self.config
        best = 1.0 + cfg.format_reward + cfg.box_reward + cfg.finish_reward
        self.log_train_metric(
            "train/percent_correct", [1.0 if s == best else 0.0 for s in group["scores"]]
        )
        if self.config.length_penalty:
            apply_length_penalty(self, group, full_score=best)
        # a group whose scores are all equal is dropped (and counted) by BaseEnv when
        # ensure_scores_are_not_same is on
        return group

    # ------------------------------------------------------------------ evaluation

    async def rollout_and_score_eval(self, question: str, gold: str) -> dict[str, Any]:
        """One greedy answer to a test question, scored 1/0."""
        messages = self.messages_for(question)
        text, finish = await eval_completion(
            self, messages, self.eval_budget, self.config.eval_temperature
        )
        parsed = math_scoring.parse_response(text)
        correct = math_scoring.verify_answer(parsed, math_scoring.parse_gold(gold))
        return {
            "messages": [*messages, {"role": "assistant", "content": text}],
            "question": question,
            "gold_answer": gold,
            "model_parsed": str(parsed) if parsed else None,
            "boxed_number": math_scoring.final_boxed_number(text, finish),
            "score": int(correct),
            "correct": correct,
            "finish_reason": finish,
        }

    @staticmethod
    def summarize_eval(samples: list[dict[str, Any]]) -> dict[str, float]:
        """The evaluation metrics of the scored test answers."""
        n = max(1, len(samples))
        return {
            "eval/percent_correct": sum(s["score"] for s in samples) / n,
            "eval/num_items": float(len(samples)),
            # well-formed final answers: the reply ended within the budget with exactly one
            # \boxed{} and a number in it (\boxed{N} or a box repeated until cut off is not one)
            "eval/percent_boxed": sum(s["boxed_number"] is not None for s in samples) / n,
            "eval/percent_finished": sum(s["finish_reason"] != "length" for s in samples) / n,
        }

    async def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        return await self.run_eval(
            [self.rollout_and_score_eval(t["question"], t["gold_answer"]) for t in self.test],
            self.summarize_eval,
            generation_parameters={
                "temperature": self.config.eval_temperature,
                "max_tokens": self.eval_budget,
            },
        )
