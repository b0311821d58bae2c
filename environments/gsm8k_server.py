"""GSM8K: grade-school math, answers verified with ``math-verify`` (upstream's ``gsm8k_server``).

Reward (as upstream): +1 when the ``\\boxed{}`` answer after ``</think>`` equals the gold answer
(math-verify), -1 otherwise; when a whole group is correct, a length penalty scales scores down
linearly above 50% of ``max_token_length``. Completions with fewer than
``min_completion_tokens`` trainable tokens are dropped. Groups whose scores are all equal are
dropped only when ``ensure_scores_are_not_same`` is on (upstream always dropped them, so
``group_size=1`` never produced data; ``process`` turns the check off).

Data: the copy of GSM8K bundled with the repository (``environments/data/gsm8k``, train / test,
MIT, the same rows as the Hub's ``gsm8k``/``main``) by default, so nothing is downloaded;
``--env.dataset_path hub`` loads ``load_dataset("gsm8k", "main")`` as upstream did, and any other
``--env.dataset_path`` reads a local folder with ``train.jsonl`` and ``test.jsonl`` (or one JSONL
file used for both), rows ``{"question", "answer": "... #### N"}``.

    run-api --port 8000 &  atropos-serve --port 9001 &
    python environments/gsm8k_server.py process --env.total_steps 4 --env.use_wandb false
    python environments/gsm8k_server.py evaluate --env.max_eval_items 50 --env.use_wandb false \\
        --env.data_dir_to_save_evals evals/gsm8k

``sample_chat_group`` and ``load_rows`` are shared with the other dataset environments.
"""

from __future__ import annotations

import json
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup
from atroposlib.scoring import math as math_scoring
from atroposlib.scoring.rewards import length_penalty_scores
from atroposlib.utils.concurrency import gather_bounded
from atroposlib.utils.tokenize_for_trainer import tokenize_for_trainer

BUNDLED_GSM8K = Path(__file__).resolve().parent / "data" / "gsm8k"
"""GSM8K shipped with the repository (train.jsonl, test.jsonl; MIT, see its README)."""

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


# ----------------------------------------------------------------------------- shared helpers


@dataclass
class Sample:
    """One sampled completion, ready to score: text, and the trainer's view of it."""

    text: str
    finish_reason: str
    tokens: list[int]
    masks: list[int]
    logprobs: list[float] | None
    messages: list[dict[str, str]]

    @property
    def trainable_tokens(self) -> int:
        """Number of positions the trainer learns from."""
        return sum(1 for m in self.masks if m != -100)


async def sample_chat_group(
    env: BaseEnv,
    messages: list[dict[str, str]],
    *,
    n: int,
    max_tokens: int,
    temperature: float,
) -> list[Sample]:
    """``n`` completions of ``messages``, with exact tokens/masks/logprobs from a token server
    (``ManagedServer``, server_type vllm/sglang/trl, atropos-serve) or, for plain OpenAI
    endpoints, re-tokenized locally with ``tokenize_for_trainer`` (no logprobs)."""
    kwargs = {"messages": messages, "n": n, "max_tokens": max_tokens, "temperature": temperature}
    server = env.server.servers[0] if env.server.servers else None
    samples: list[Sample] = []
    if getattr(server, "provides_token_logprobs", False):
        async with env.server.managed_server(tokenizer=env.tokenizer) as managed:
            reply = await managed.chat_completion(**kwargs)
            nodes = managed.get_state()["nodes"]
        for choice, node in zip(reply.choices, nodes, strict=True):
            text = choice.message.content or ""
            samples.append(
                Sample(
                    text,
                    choice.finish_reason or "",
                    list(node.tokens),
                    list(node.masked_tokens),
                    list(node.logprobs),
                    [*messages, {"role": "assistant", "content": text}],
                )
            )
        return samples
    reply = await env.server.chat_completion(**kwargs)
    for choice in reply.choices:
        text = choice.message.content or ""
        chat = [*messages, {"role": "assistant", "content": text}]
        out = tokenize_for_trainer(env.tokenizer, chat, finish_reason=choice.finish_reason or "")
        samples.append(
            Sample(text, choice.finish_reason or "", out["tokens"], out["masks"], None, chat)
        )
    return samples


async def eval_completion(
    env: BaseEnv, messages: list[dict[str, str]], max_tokens: int, temperature: float
) -> tuple[str, str]:
    """One evaluation completion: ``(text, finish_reason)``."""
    reply = await env.server.chat_completion(
        messages=messages, n=1, max_tokens=max_tokens, temperature=temperature, split="eval"
    )
    choice = reply.choices[0]
    return choice.message.content or "", choice.finish_reason or ""


def load_rows(path: str | Path, split: str) -> list[dict[str, Any]]:
    """Rows of a local dataset: ``path`` is a JSONL file, or a folder holding ``{split}.jsonl``.

    Raises FileNotFoundError naming the path, ValueError naming the line of bad JSON.
    """
    path = Path(path)
    file = path / f"{split}.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"dataset_path: no such file {file}")
    rows = []
    with file.open() as fh:
        for number, line in enumerate(fh, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"dataset_path: {file} line {number}: {exc}") from exc
    return rows


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


def token_server_config(**overrides: Any) -> list[APIServerConfig]:
    """The default server: the embedded atropos-serve on localhost:9001 (SmolLM2)."""
    config = {
        "model_name": "SmolLM2-135M-Instruct",
        "base_url": "http://localhost:9001/v1",
        "api_key": "x",
        "server_type": "vllm",
        "num_requests_for_eval": 32,
        "timeout": 600,
    }
    config.update(overrides)
    return [APIServerConfig(**config)]


# ----------------------------------------------------------------------------- the environment


class GSM8kEnvConfig(BaseEnvConfig):
    """Settings of the GSM8K environment."""

    dataset_path: str | None = Field(
        default=None,
        description="GSM8K to use: a folder with train.jsonl/test.jsonl or one JSONL file "
        "(rows {question, answer}); 'hub' for load_dataset('gsm8k', 'main'); default: the copy "
        "bundled in environments/data/gsm8k",
    )
    max_eval_items: int = Field(
        default=-1, description="Evaluate on the first N test rows (-1: all of them)"
    )
    temperature: float = Field(default=1.0, ge=0.0, description="Sampling temperature (train)")
    eval_temperature: float = Field(
        default=0.0, ge=0.0, description="Sampling temperature for evaluate()"
    )
    min_completion_tokens: int = Field(
        default=10, ge=0, description="Drop completions with fewer trainable tokens (upstream: 10)"
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
    format_min_tokens: int = Field(
        default=0,
        ge=0,
        description="format_reward and box_reward only for replies of at least this many "
        "tokens: a bare \\boxed{} guess without the working earns no format credit",
    )
    few_shot: int = Field(
        default=0,
        ge=0,
        le=8,
        description="Worked examples shown before each question as earlier chat turns: the "
        "shortest solutions of the train split, ending in \\boxed{N} (never asked themselves)",
    )
    seed: int = Field(default=42, description="Shuffle seed of the training set")


class GSM8kEnv(BaseEnv):
    """GSM8K with math-verify rewards (+1 / -1, length penalty when all are right)."""

    name = "gsm8k"
    env_config_cls = GSM8kEnvConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.iter = 0
        self.percent_correct_buffer: list[float] = []
        self.eval_metrics: list[tuple[str, float]] = []

    @classmethod
    def config_init(cls) -> tuple[GSM8kEnvConfig, list[APIServerConfig]]:
        env_config = GSM8kEnvConfig(
            tokenizer_name="SmolLM2-135M-Instruct",
            group_size=8,
            use_wandb=True,
            rollout_server_url="http://localhost:8000",
            total_steps=1000,
            batch_size=12,
            steps_per_eval=100,
            max_token_length=2048,
            wandb_name="gsm8k",
        )
        return env_config, token_server_config()

    # ------------------------------------------------------------------ data

    def load_split(self, split: str) -> list[dict[str, Any]]:
        """``[{question, answer}]`` for ``train`` or ``test``."""
        if self.config.dataset_path == "hub":
            from datasets import load_dataset

            return [dict(row) for row in load_dataset("gsm8k", "main", split=split)]
        return load_rows(self.config.dataset_path or BUNDLED_GSM8K, split)

    async def setup(self) -> None:
        self.train = self.load_split("train")
        # worked examples: the same for every seed, so evaluations stay comparable
        self.examples = few_shot_examples(self.train, self.config.few_shot)
        shown = {row["question"] for row in self.examples}
        self.train = [row for row in self.train if row["question"] not in shown]
        random.Random(self.config.seed).shuffle(self.train)
        test = self.load_split("test")
        if self.config.max_eval_items >= 0:
            test = test[: self.config.max_eval_items]
        self.test = [
            {
                "question": row["question"],
                "gold_answer": math_scoring.gsm8k_gold_answer(row["answer"]),
            }
            for row in test
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
        """Tokens a reply may have."""
        return self.config.max_answer_tokens or self.config.max_token_length

    def messages_for(self, question: str) -> list[dict[str, str]]:
        """The chat sent to the model: system prompt, worked examples, the question (with
        ``prompt_suffix``)."""
        messages = []
        if self.config.system_prompt:
            messages.append({"role": "system", "content": self.config.system_prompt})
        suffix = self.config.prompt_suffix
        for row in getattr(self, "examples", []):
            messages.append({"role": "user", "content": row["question"] + suffix})
            messages.append({"role": "assistant", "content": worked_solution(row["answer"])})
        messages.append({"role": "user", "content": question + suffix})
        return messages

    def gold_for(self, item: dict[str, Any]) -> str:
        """The gold answer of a training row."""
        return math_scoring.gsm8k_gold_answer(item["answer"])

    # ------------------------------------------------------------------ rollouts

    async def collect_trajectories(
        self, item: dict[str, Any]
    ) -> tuple[ScoredDataGroup | None, list]:
        samples = await sample_chat_group(
            self,
            self.messages_for(item["question"]),
            n=self.config.group_size,
            max_tokens=self.budget,
            temperature=self.config.temperature,
        )
        return self.score_samples(samples, self.gold_for(item)), []

    def score_samples(self, samples: list[Sample], gold: str) -> ScoredDataGroup | None:
        """Upstream's GSM8K scoring of one group; None when nothing is left to train on."""
        gold_parsed = math_scoring.parse_gold(gold)
        if not gold_parsed:
            return None  # an unparseable gold answer teaches nothing
        group: ScoredDataGroup = {
            "tokens": [],
            "masks": [],
            "scores": [],
            "messages": [],
            "inference_logprobs": [],
        }
        for sample in samples:
            if sample.trainable_tokens < self.config.min_completion_tokens:
                continue
            parsed = math_scoring.parse_response(sample.text)
            correct = math_scoring.verify_answer(parsed, gold_parsed)
            group["tokens"].append(sample.tokens)
            group["masks"].append(sample.masks)
            group["messages"].append(sample.messages)
            if sample.logprobs is not None:
                group["inference_logprobs"].append(sample.logprobs)
            score = 1.0 if correct else -1.0
            # format credit: a finished reply of enough tokens with exactly one box
            box = math_scoring.final_box(sample.text, sample.finish_reason)
            if box is not None and sample.trainable_tokens >= self.config.format_min_tokens:
                if math_scoring.number_in_box(box) is not None:
                    score += self.config.format_reward
                if any(c.isdigit() for c in box):
                    score += self.config.box_reward
            group["scores"].append(score)
        if not group["tokens"]:
            return None
        if len(group["inference_logprobs"]) != len(group["tokens"]):
            del group["inference_logprobs"]
        best = 1.0 + self.config.format_reward + self.config.box_reward
        self.percent_correct_buffer.extend(1.0 if s == best else 0.0 for s in group["scores"])
        if self.config.length_penalty and all(s == best for s in group["scores"]):
            group["scores"] = length_penalty_scores(
                [len(t) for t in group["tokens"]], self.config.max_token_length
            )
        # a group whose scores are all equal is dropped (and counted) by BaseEnv when
        # ensure_scores_are_not_same is on
        if len(group["tokens"]) != self.config.group_size:
            group["group_overrides"] = {"group_size": len(group["tokens"])}
        # the trainer scales its logits by the temperature the samples were drawn at
        group["generation_params"] = {"temperature": self.config.temperature}
        return group

    # ------------------------------------------------------------------ evaluation

    async def rollout_and_score_eval(self, question: str, gold: str) -> dict[str, Any]:
        """One greedy answer to a test question, scored 1/0."""
        messages = self.messages_for(question)
        text, finish = await eval_completion(
            self, messages, self.budget, self.config.eval_temperature
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

    async def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        start = time.time()
        samples = await gather_bounded(
            [self.rollout_and_score_eval(t["question"], t["gold_answer"]) for t in self.test],
            self.config.max_eval_workers,
            desc="eval",
        )
        metrics = {
            "eval/percent_correct": sum(s["score"] for s in samples) / max(1, len(samples)),
            "eval/num_items": float(len(samples)),
            # well-formed final answers: the reply ended within the budget with exactly one
            # \boxed{} and a number in it (\boxed{N} or a box repeated until cut off is not one)
            "eval/percent_boxed": sum(s["boxed_number"] is not None for s in samples)
            / max(1, len(samples)),
            "eval/percent_finished": sum(s["finish_reason"] != "length" for s in samples)
            / max(1, len(samples)),
        }
        self.eval_metrics.extend(metrics.items())
        await self.evaluate_log(
            metrics,
            samples=samples,
            start_time=start,
            end_time=time.time(),
            generation_parameters={
                "temperature": self.config.eval_temperature,
                "max_tokens": self.budget,
            },
        )
        return metrics

    async def wandb_log(self, wandb_metrics: dict[str, Any] | None = None) -> None:
        wandb_metrics = dict(wandb_metrics or {})
        if self.percent_correct_buffer:
            wandb_metrics["train/percent_correct"] = sum(self.percent_correct_buffer) / len(
                self.percent_correct_buffer
            )
        self.percent_correct_buffer = []
        wandb_metrics.update(dict(self.eval_metrics))
        self.eval_metrics = []
        await super().wandb_log(wandb_metrics)


if __name__ == "__main__":
    GSM8kEnv.cli()
