"""Arithmetic: a small offline environment (no dataset download, no network besides the
inference server), and the task of the quick start's learning recipe.

Problems like ``What is 17 - 4?`` (operands 0..``max_operand``, operators from ``operators``)
are generated from a seeded RNG. The prompt asks for only the final integer, and a reply is
graded by its **first** integer: ``13`` and ``13, since 17 - 4 = 13`` are right, ``17 - 4 = 13``
is wrong (it answers 17 first). SmolLM2-135M-Instruct restates the question before answering
almost every time, so it gets ~5% of these right at first.

Held out: ``num_eval_problems`` distinct problems (from their own generator, ``eval_seed``) are
what ``evaluate`` asks, greedily; training never draws one of them, whatever its ``seed``.

Reward of a sampled reply (``score_reply``): 1.0 when its first integer is the answer, else
``partial_credit`` when the answer appears later in it, else 0.0 (-``format_penalty`` when it
holds no integer at all); minus ``length_penalty`` per reply token beyond the answer's own.
The defaults reward only correct answers, scored as evaluate() grades them.

Defaults fit the embedded server (``atropos-serve --port 9001``, SmolLM2-135M-Instruct):

    run-api --port 8000 &
    atropos-serve --port 9001 &
    python environments/arithmetic_server.py serve --env.use_wandb false
    python environments/arithmetic_server.py process --env.total_steps 8 --env.use_wandb false

With ``server_type`` ``vllm``/``sglang``/``trl`` (the default: atropos-serve speaks vLLM's
``/generate``), tokens and sampler logprobs come exactly from the server (``ManagedServer``);
with ``openai`` the chat is re-tokenized locally and ``inference_logprobs`` are left out.
"""

from __future__ import annotations

import random
import re
from typing import Any

from pydantic import Field, model_validator

from atroposlib.envs.base import BaseEnv, ScoredDataGroup
from atroposlib.envs.config import LocalEnvConfig
from atroposlib.envs.rollout import group_from_samples, sample_chat_group
from atroposlib.envs.server_handling.server_baseline import local_server_configs

SYSTEM_PROMPT = "You are a calculator. Reply with only the final integer answer."
_INT = re.compile(r"-?\d+")
_OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_EVAL_SEED_OFFSET = 1_000_003


FEW_SHOT_EXAMPLES = [("What is 7 + 5?", "12"), ("What is 3 - 9?", "-6"), ("What is 14 - 6?", "8")]
"""Worked examples shown before the question with ``few_shot`` > 0 (never asked themselves)."""


def chat_messages(
    question: str, system_prompt: str = SYSTEM_PROMPT, few_shot: int = len(FEW_SHOT_EXAMPLES)
) -> list[dict[str, str]]:
    """The chat the env asks ``question`` in: the system prompt (if any), the first
    ``few_shot`` worked examples as earlier turns, then the question."""
    messages = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    for example, answer in FEW_SHOT_EXAMPLES[:few_shot]:
        messages.append({"role": "user", "content": example})
        messages.append({"role": "assistant", "content": answer})
    messages.append({"role": "user", "content": question})
    return messages


class ArithmeticEnvConfig(LocalEnvConfig):
    """Settings of the arithmetic environment."""

    max_token_length: int = 256
    # a small or untrained model often scores a whole group alike; keep those groups
    # so the trainer is always fed (their advantages are zero)
    ensure_scores_are_not_same: bool = False
    # the held-out problems are asked as fast as the server's eval slots allow
    max_eval_workers: int = 64

    max_operand: int = Field(default=20, ge=1, description="Operands are drawn from 0..max_operand")
    operators: str = Field(default="+-", description="Operators to use, any of '+', '-' and '*'")
    seed: int = Field(default=0, description="Seed of the training problem generator")
    eval_seed: int = Field(
        default=0, description="Seed of the held-out problems (independent of seed)"
    )
    num_eval_problems: int = Field(
        default=200,
        ge=1,
        description="Distinct held-out problems evaluate() asks (greedy); training never uses them",
    )
    max_answer_tokens: int = Field(
        default=16, ge=1, description="Generation budget per reply (tokens)"
    )
    temperature: float = Field(default=1.0, ge=0.0, description="Sampling temperature")
    system_prompt: str = Field(default=SYSTEM_PROMPT, description="System message of each chat")
    partial_credit: float = Field(
        default=0.0,
        description="Reward when the answer appears in the reply but is not its first integer",
    )
    format_penalty: float = Field(
        default=0.0, ge=0.0, description="Subtracted when a reply holds no integer at all"
    )
    few_shot: int = Field(
        default=0,
        ge=0,
        le=len(FEW_SHOT_EXAMPLES),
        description="Worked examples (question, bare answer) shown as earlier chat turns",
    )
    length_penalty: float = Field(
        default=0.0,
        ge=0.0,
        description="Subtracted per reply token beyond the answer's own tokens (penalises rambling)",
    )

    @model_validator(mode="after")
    def _check_operators(self) -> ArithmeticEnvConfig:
        bad = sorted(set(self.operators) - set(_OPERATORS))
        if bad or not self.operators:
            raise ValueError(f"operators: use any of '+', '-', '*' (got {self.operators!r})")
        return self


def problem_space(max_operand: int, operators: str) -> int:
    """How many distinct problems the settings allow."""
    return (max_operand + 1) ** 2 * len(set(operators))


def make_problem(rng: random.Random, max_operand: int, operators: str) -> dict[str, Any]:
    """One problem: ``{"question", "answer"}``."""
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    op = rng.choice([o for o in operators if o in _OPERATORS] or ["+"])
    return {"question": f"What is {a} {op} {b}?", "answer": _OPERATORS[op](a, b)}


def held_out_problems(seed: int, count: int, max_operand: int, operators: str) -> list[dict]:
    """``count`` distinct problems from the evaluation generator (its own seed space)."""
    if count > problem_space(max_operand, operators) // 2:
        raise ValueError(
            f"num_eval_problems={count} would hold out more than half of the "
            f"{problem_space(max_operand, operators)} possible problems; raise max_operand"
        )
    rng = random.Random(seed + _EVAL_SEED_OFFSET)
    examples = {q for q, _ in FEW_SHOT_EXAMPLES}
    seen: dict[str, dict[str, Any]] = {}
    while len(seen) < count:
        problem = make_problem(rng, max_operand, operators)
        if problem["question"] not in examples:
            seen.setdefault(problem["question"], problem)
    return list(seen.values())


_BARE = re.compile(r"\s*-?\d+\s*\.?\s*")
_RESTATED = re.compile(r"\s*[-+*/=×÷x]\s*-?\d")


def first_integer(reply: str | None) -> int | None:
    """The first integer of a reply, or None."""
    match = _INT.search(reply or "")
    return int(match.group()) if match else None


def graded_answer(reply: str | None) -> int | None:
    """The answer a reply gives, as evaluate() grades it: its first integer, unless that integer
    starts an expression (``17 - 4 = 13`` restates the question; the prompt asks for only the
    answer), in which case the reply gives none."""
    match = _INT.search(reply or "")
    if match is None or _RESTATED.match(reply or "", match.end()):
        return None
    return int(match.group())


def score_reply(
    reply: str | None,
    answer: int,
    *,
    partial_credit: float = 0.0,
    format_penalty: float = 0.0,
    extra_tokens: int = 0,
    length_penalty: float = 0.0,
) -> float:
    """Reward of one reply (see the module docstring); ``extra_tokens`` is the reply's length in
    tokens beyond the answer's own."""
    numbers = [int(n) for n in _INT.findall(reply or "")]
    if not numbers:
        score = 0.0 - format_penalty  # 0.0, not -0.0, when there is no penalty
    elif graded_answer(reply) == answer:
        score = 1.0
    elif answer in numbers:
        score = partial_credit
    else:
        score = 0.0
    return score - length_penalty * max(extra_tokens, 0)


class ArithmeticEnv(BaseEnv):
    """Generated arithmetic problems scored by exact answer."""

    name = "arithmetic"
    env_config_cls = ArithmeticEnvConfig

    default_server_configs = local_server_configs(num_requests_for_eval=64, timeout=120)

    async def setup(self) -> None:
        cfg = self.config
        self.rng = random.Random(cfg.seed)
        self.eval_problems = held_out_problems(
            cfg.eval_seed, cfg.num_eval_problems, cfg.max_operand, cfg.operators
        )
        self._held_out = {p["question"] for p in self.eval_problems}
        self._held_out |= {q for q, _ in FEW_SHOT_EXAMPLES}  # shown as examples, never asked
        self.iter = 0

    async def get_next_item(self) -> dict[str, Any]:
        """The next training problem: never one of the held-out evaluation problems."""
        self.iter += 1
        while True:
            problem = make_problem(self.rng, self.config.max_operand, self.config.operators)
            if problem["question"] not in self._held_out:
                return problem

    def _messages(self, question: str) -> list[dict[str, str]]:
        return chat_messages(question, self.config.system_prompt, self.config.few_shot)

    def _score(self, text: str, answer: int, reply_tokens: int) -> float:
        cfg = self.config
        answer_tokens = len(self.tokenizer.encode(str(answer), add_special_tokens=False)) + 1
        return score_reply(
            text,
            answer,
            partial_credit=cfg.partial_credit,
            format_penalty=cfg.format_penalty,
            extra_tokens=reply_tokens - answer_tokens,  # +1 above: the end-of-turn token
            length_penalty=cfg.length_penalty,
        )

    async def collect_trajectories(self, item: dict[str, Any]) -> tuple[ScoredDataGroup, list]:
        samples = await sample_chat_group(
            self,
            self._messages(item["question"]),
            n=self.config.group_size,
            max_tokens=self.config.max_answer_tokens,
            temperature=self.config.temperature,
        )
        group = group_from_samples(
            samples,
            [self._score(s.text, item["answer"], s.trainable_tokens) for s in samples],
            group_size=self.config.group_size,
        )
        # the trainer scales its logits by the temperature the samples were drawn at
        group["generation_params"] = {
            "temperature": self.config.temperature,
            "max_tokens": self.config.max_answer_tokens,
        }
        self.log_train_metric(
            "train/percent_correct",
            [1.0 if graded_answer(s.text) == item["answer"] else 0.0 for s in samples],
        )
        return group, []

    async def _ask(self, problem: dict[str, Any]) -> dict[str, Any]:
        reply = await self.server.chat_completion(
            messages=self._messages(problem["question"]),
            n=1,
            max_tokens=self.config.max_answer_tokens,
            temperature=0.0,
            split="eval",
        )
        text = reply.choices[0].message.content or ""
        given = graded_answer(text)
        numbers = [int(n) for n in _INT.findall(text)]
        return {
            "question": problem["question"],
            "gold_answer": str(problem["answer"]),
            "model_parsed": None if given is None else str(given),
            "response": text,
            "score": int(given == problem["answer"]),
            "correct": given == problem["answer"],
            "answer_anywhere": problem["answer"] in numbers,
            "bare": _BARE.fullmatch(text) is not None,
            "finish_reason": reply.choices[0].finish_reason,
        }

    @staticmethod
    def summarize_eval(samples: list[dict[str, Any]]) -> dict[str, float]:
        """``eval/percent_correct`` (the grade), ``eval/answer_anywhere`` (the answer appears
        somewhere in the reply), ``eval/bare_answer`` (the reply is only an integer),
        ``eval/mean_reply_chars``."""
        n = max(1, len(samples))
        return {
            "eval/percent_correct": sum(s["correct"] for s in samples) / n,
            "eval/answer_anywhere": sum(s["answer_anywhere"] for s in samples) / n,
            "eval/bare_answer": sum(s["bare"] for s in samples) / n,
            "eval/mean_reply_chars": sum(len(s["response"]) for s in samples) / n,
        }

    async def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """Ask every held-out problem greedily; grade each reply by its first integer."""
        return await self.run_eval(
            [self._ask(p) for p in self.eval_problems],
            self.summarize_eval,
            generation_parameters={"temperature": 0.0, "max_tokens": self.config.max_answer_tokens},
        )


if __name__ == "__main__":
    ArithmeticEnv.cli()
