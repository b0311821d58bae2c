"""Arithmetic: a small offline environment (no dataset download, no network besides the
inference server).

Problems like ``What is 17 * 4?`` are generated from a seeded RNG. Each reply is scored by
its last integer: 1.0 for the exact answer, -0.5 for a wrong number, -1.0 for no number at all.

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
import time
from typing import Any

from pydantic import Field

from atroposlib.envs.base import (
    APIServerConfig,
    BaseEnv,
    BaseEnvConfig,
    ScoredDataGroup,
)
from atroposlib.utils.tokenize_for_trainer import tokenize_for_trainer

SYSTEM_PROMPT = "You are a calculator. Reply with only the final integer answer."
_INT = re.compile(r"-?\d+")
_OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class ArithmeticEnvConfig(BaseEnvConfig):
    """Settings of the arithmetic environment."""

    max_operand: int = Field(default=20, ge=1, description="Operands are drawn from 0..max_operand")
    operators: str = Field(default="+-*", description="Operators to use, any of '+', '-' and '*'")
    seed: int = Field(default=0, description="Seed of the problem generator")
    num_eval_problems: int = Field(
        default=32, ge=1, description="How many fixed problems evaluate() asks"
    )
    max_answer_tokens: int = Field(
        default=16, ge=1, description="Generation budget per reply (tokens)"
    )
    temperature: float = Field(default=1.0, ge=0.0, description="Sampling temperature")


def make_problem(rng: random.Random, max_operand: int, operators: str) -> dict[str, Any]:
    """One problem: ``{"question", "answer"}``."""
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    op = rng.choice([o for o in operators if o in _OPERATORS] or ["+"])
    return {"question": f"What is {a} {op} {b}?", "answer": _OPERATORS[op](a, b)}


def score_reply(reply: str | None, answer: int) -> float:
    """1.0 when the reply's last integer is ``answer``, -0.5 for another integer, -1.0 when
    it has none."""
    numbers = _INT.findall(reply or "")
    if not numbers:
        return -1.0
    return 1.0 if int(numbers[-1]) == answer else -0.5


class ArithmeticEnv(BaseEnv):
    """Generated arithmetic problems scored by exact answer."""

    name = "arithmetic"
    env_config_cls = ArithmeticEnvConfig

    @classmethod
    def config_init(cls) -> tuple[ArithmeticEnvConfig, list[APIServerConfig]]:
        env_config = ArithmeticEnvConfig(
            tokenizer_name="SmolLM2-135M-Instruct",
            group_size=4,
            use_wandb=False,
            rollout_server_url="http://localhost:8000",
            max_token_length=256,
            total_steps=100,
            batch_size=16,
            steps_per_eval=50,
            wandb_name="arithmetic",
            # a small or untrained model often scores a whole group alike; keep those groups
            # so the trainer is always fed (their advantages are zero)
            ensure_scores_are_not_same=False,
        )
        servers = [
            APIServerConfig(
                model_name="SmolLM2-135M-Instruct",
                base_url="http://localhost:9001/v1",
                api_key="x",
                server_type="vllm",
                num_requests_for_eval=16,
                timeout=120,
            )
        ]
        return env_config, servers

    async def setup(self) -> None:
        cfg = self.config
        self.rng = random.Random(cfg.seed)
        eval_rng = random.Random(cfg.seed + 1_000_003)
        self.eval_problems = [
            make_problem(eval_rng, cfg.max_operand, cfg.operators)
            for _ in range(cfg.num_eval_problems)
        ]
        self.iter = 0
        self.percent_correct_buffer: list[float] = []

    async def get_next_item(self) -> dict[str, Any]:
        self.iter += 1
        return make_problem(self.rng, self.config.max_operand, self.config.operators)

    def _messages(self, question: str) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": question},
        ]

    def _uses_token_server(self) -> bool:
        server = self.server.servers[0] if self.server.servers else None
        return bool(getattr(server, "provides_token_logprobs", False))

    async def collect_trajectories(self, item: dict[str, Any]) -> tuple[ScoredDataGroup, list]:
        messages = self._messages(item["question"])
        kwargs = {
            "messages": messages,
            "n": self.config.group_size,
            "max_tokens": self.config.max_answer_tokens,
            "temperature": self.config.temperature,
        }
        group: ScoredDataGroup = {
            "tokens": [],
            "masks": [],
            "scores": [],
            "messages": [],
            "group_overrides": {},
        }
        if self._uses_token_server():
            async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
                reply = await managed.chat_completion(**kwargs)
                nodes = managed.get_state()["nodes"]
            group["inference_logprobs"] = []
            for choice, node in zip(reply.choices, nodes, strict=True):
                text = choice.message.content or ""
                group["tokens"].append(list(node.tokens))
                group["masks"].append(list(node.masked_tokens))
                group["inference_logprobs"].append(list(node.logprobs))
                group["scores"].append(score_reply(text, item["answer"]))
                group["messages"].append([*messages, {"role": "assistant", "content": text}])
        else:
            reply = await self.server.chat_completion(**kwargs)
            for choice in reply.choices:
                text = choice.message.content or ""
                chat = [*messages, {"role": "assistant", "content": text}]
                out = tokenize_for_trainer(
                    self.tokenizer, chat, finish_reason=choice.finish_reason or ""
                )
                group["tokens"].append(out["tokens"])
                group["masks"].append(out["masks"])
                group["scores"].append(score_reply(text, item["answer"]))
                group["messages"].append(chat)
        if len(group["tokens"]) != self.config.group_size:
            group["group_overrides"]["group_size"] = len(group["tokens"])
        self.percent_correct_buffer.extend(1.0 if s == 1.0 else 0.0 for s in group["scores"])
        return group, []

    async def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        start = time.time()
        samples = []
        correct = 0
        for problem in self.eval_problems:
            reply = await self.server.chat_completion(
                messages=self._messages(problem["question"]),
                n=1,
                max_tokens=self.config.max_answer_tokens,
                temperature=0.0,
                split="eval",
            )
            text = reply.choices[0].message.content or ""
            ok = score_reply(text, problem["answer"]) == 1.0
            correct += ok
            samples.append(
                {
                    "question": problem["question"],
                    "gold_answer": str(problem["answer"]),
                    "model_parsed": (_INT.findall(text) or [None])[-1],
                    "response": text,
                    "score": int(ok),
                    "correct": ok,
                    "finish_reason": reply.choices[0].finish_reason,
                }
            )
        metrics = {"eval/percent_correct": correct / len(self.eval_problems)}
        await self.evaluate_log(
            metrics,
            samples=samples,
            start_time=start,
            end_time=time.time(),
            generation_parameters={"temperature": 0.0, "max_tokens": self.config.max_answer_tokens},
        )
        return metrics

    async def wandb_log(self, wandb_metrics: dict[str, Any] | None = None) -> None:
        wandb_metrics = dict(wandb_metrics or {})
        if self.percent_correct_buffer:
            wandb_metrics["train/percent_correct"] = sum(self.percent_correct_buffer) / len(
                self.percent_correct_buffer
            )
            self.percent_correct_buffer = []
        await super().wandb_log(wandb_metrics)


if __name__ == "__main__":
    ArithmeticEnv.cli()
