"""Multi-turn tool calling: the model calls real tools, reads their results, then answers.

Tasks are generated offline from a seeded RNG over ``atroposlib.scoring.tools.CORPUS``
(facts about countries, planets and elements) and random numbers; each needs at least one
tool: ``lookup`` (a fact), ``calculator`` (arithmetic without ``eval``) or ``convert_units``.
``--env.tasks_path`` reads extra tasks from a JSONL file instead (``{"question", "answer"}``).

Each trajectory is a conversation of up to ``max_turns`` model turns. A turn with tool calls
gets the tools' results back; a turn without calls (or with ``<answer>``) ends the episode.
Two call formats (``--env.tool_format``):

* ``hermes`` (default): tools listed in ``<tools>`` in the system prompt, calls written as
  ``<tool_call>{"name", "arguments"}</tool_call>``, results fed back as ``tool`` messages
  holding ``<tool_response>``.
* ``openai``: the request carries ``tools=[...]`` and the reply's ``message.tool_calls`` are
  executed (the ManagedServer parses them with the hermes parser on token servers); results
  go back as ``{"role": "tool", "tool_call_id", "content"}``.

Reward (in [-1, 1]): final answer in ``<answer>...</answer>`` correct 0.8, wrong -0.5,
missing -1.0; plus 0.2 x the fraction of calls that were valid and ran; minus 0.1 per
invalid call (unparseable, unknown tool, bad arguments), at most 0.3.

    python environments/tool_calling_server.py serve --env.use_wandb false
    python environments/tool_calling_server.py process --env.total_steps 4
    python environments/tool_calling_server.py evaluate --env.num_eval_tasks 50
"""

from __future__ import annotations

import asyncio
import random
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from atroposlib.envs.base import BaseEnv, ScoredDataGroup
from atroposlib.envs.config import LocalEnvConfig
from atroposlib.envs.rollout import ChatSession, group_from_trajectories
from atroposlib.envs.server_handling.server_baseline import local_server_configs
from atroposlib.scoring.tools import (
    CORPUS,
    ToolRegistry,
    convert_units,
    default_registry,
    parse_hermes_calls,
    parse_openai_calls,
)
from atroposlib.utils.data import load_rows

SYSTEM_PREAMBLE = (
    "You are a careful assistant with tools. Use the tools to find facts and compute; do not "
    "guess. When you know the final answer, reply with it inside <answer></answer> tags, "
    "for example <answer>42</answer>."
)
_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL | re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")


# --------------------------------------------------------------------------- tasks


def make_task(rng: random.Random) -> dict[str, Any]:
    """One generated task: ``{"question", "answer", "kind"}`` (answer a number or a word)."""
    countries = [k for k, v in CORPUS.items() if v["type"] == "country"]
    planets = [k for k, v in CORPUS.items() if v["type"] == "planet"]
    elements = [k for k, v in CORPUS.items() if v["type"] == "element"]
    kind = rng.choice(["capital", "population", "moons", "atomic", "convert", "arith"])
    if kind == "capital":
        c = rng.choice(countries)
        return {
            "question": f"What is the capital of {c.title()}?",
            "answer": CORPUS[c]["capital"],
            "kind": kind,
        }
    if kind == "population":
        c = rng.choice(countries)
        k = rng.choice([2, 3, 4, 5])
        return {
            "question": f"What is the population of {c.title()} in millions, multiplied by {k}?",
            "answer": CORPUS[c]["population"] / 1_000_000 * k,
            "kind": kind,
        }
    if kind == "moons":
        a, b = rng.sample(planets, 2)
        return {
            "question": f"How many moons do {a.title()} and {b.title()} have together?",
            "answer": CORPUS[a]["moons"] + CORPUS[b]["moons"],
            "kind": kind,
        }
    if kind == "atomic":
        a, b = rng.sample(elements, 2)
        return {
            "question": f"What is the atomic number of {a} plus the atomic number of {b}?",
            "answer": CORPUS[a]["atomic_number"] + CORPUS[b]["atomic_number"],
            "kind": kind,
        }
    if kind == "convert":
        src, dst = rng.choice(
            [("mi", "km"), ("km", "mi"), ("lb", "kg"), ("kg", "lb"), ("f", "c"), ("gal", "l")]
        )
        value = rng.randint(2, 300)
        return {
            "question": f"Convert {value} {src} to {dst}. Round to 2 decimal places.",
            "answer": round(convert_units(value, src, dst), 2),
            "kind": kind,
        }
    a, b, c = rng.randint(12, 999), rng.randint(12, 999), rng.randint(2, 99)
    return {
        "question": f"What is ({a} * {b}) - {c}?",
        "answer": a * b - c,
        "kind": kind,
    }


def load_tasks(path: str | Path) -> list[dict[str, Any]]:
    """Tasks from a JSONL file of ``{"question", "answer"}`` objects (errors name the line)."""
    rows = load_rows(path, flag="tasks_path", required=("question", "answer"), allow_empty=False)
    return [{"kind": "file", **row} for row in rows]


# --------------------------------------------------------------------------- scoring


def extract_answer(text: str | None) -> str | None:
    """The content of the last ``<answer>`` block, or None."""
    found = _ANSWER.findall(text or "")
    return found[-1].strip() if found else None


def answer_matches(given: str | None, gold: Any) -> bool:
    """Numbers match within 0.01 (+0.01% of the gold value); words case- and punctuation-insensitively."""
    if given is None:
        return False
    if isinstance(gold, int | float) and not isinstance(gold, bool):
        numbers = _NUMBER.findall(given.replace(",", ""))
        if not numbers:
            return False
        value = float(numbers[-1])
        return abs(value - float(gold)) <= 0.01 + 1e-4 * abs(float(gold))
    norm = lambda s: re.sub(r"[^a-z0-9]+", " ", str(s).lower()).strip()  # noqa: E731
    return norm(given) == norm(gold)


def score_episode(answer: str | None, gold: Any, valid_calls: int, invalid_calls: int) -> float:
    """The reward of one episode (see the module docstring)."""
    if answer is None:
        score = -1.0
    else:
        score = 0.8 if answer_matches(answer, gold) else -0.5
    total = valid_calls + invalid_calls
    if total:
        score += 0.2 * valid_calls / total
    score -= 0.1 * min(3, invalid_calls)
    return max(-1.0, min(1.0, score))


# --------------------------------------------------------------------------- env


class ToolCallingEnvConfig(LocalEnvConfig):
    """Settings of the tool-calling environment."""

    ensure_scores_are_not_same: bool = False

    tool_format: Literal["hermes", "openai"] = Field(
        default="hermes", description="Call format: hermes <tool_call> text or OpenAI tools"
    )
    tools_in_system_prompt: bool = Field(
        default=True,
        description="List the tools in the system prompt (needed when the chat template "
        "ignores the tools field, as SmolLM2's does)",
    )
    max_turns: int = Field(default=4, ge=1, description="Most model turns per episode")
    max_calls_per_turn: int = Field(default=4, ge=1, description="Calls executed per turn")
    max_tokens_per_turn: int = Field(default=192, ge=1, description="Generation budget per turn")
    temperature: float = Field(default=1.0, ge=0.0, description="Sampling temperature")
    seed: int = Field(default=0, description="Seed of the task generator")
    tasks_path: str | None = Field(
        default=None, description="JSONL of {question, answer} tasks instead of generated ones"
    )
    num_eval_tasks: int = Field(default=32, ge=1, description="Fixed tasks evaluate() asks")


class ToolCallingEnv(BaseEnv):
    """Multi-turn tool use with executed tools; reward on the answer and call validity."""

    name = "tool_calling"
    env_config_cls = ToolCallingEnvConfig

    default_server_configs = local_server_configs(num_requests_for_eval=8, timeout=300)

    async def setup(self) -> None:
        cfg = self.config
        self.registry: ToolRegistry = default_registry()
        self.rng = random.Random(cfg.seed)
        if cfg.tasks_path:
            tasks = load_tasks(cfg.tasks_path)
            self.rng.shuffle(tasks)
            n_eval = min(cfg.num_eval_tasks, max(1, len(tasks) // 5))
            self.eval_tasks, self.train_tasks = tasks[:n_eval], tasks[n_eval:] or tasks
        else:
            eval_rng = random.Random(cfg.seed + 1_000_003)
            self.eval_tasks = [make_task(eval_rng) for _ in range(cfg.num_eval_tasks)]
            self.train_tasks = []
        self.iter = 0

    async def get_next_item(self) -> dict[str, Any]:
        self.iter += 1
        if self.train_tasks:
            return self.train_tasks[(self.iter - 1) % len(self.train_tasks)]
        return make_task(self.rng)

    def system_prompt(self) -> str:
        """The system prompt (tool list included when ``tools_in_system_prompt``)."""
        if self.config.tools_in_system_prompt:
            return self.registry.hermes_system_prompt(SYSTEM_PREAMBLE)
        return SYSTEM_PREAMBLE

    async def run_episode(
        self, task: dict[str, Any], temperature: float, split: str | None = None
    ) -> tuple[dict[str, Any] | None, dict[str, float]]:
        """One conversation for ``task``: ``(trajectory or None, stats)``."""
        openai_format = self.config.tool_format == "openai"
        messages = [
            {"role": "system", "content": self.system_prompt()},
            {"role": "user", "content": task["question"]},
        ]
        valid = invalid = 0
        answer: str | None = None
        extra = {"split": split} if split else {}
        async with ChatSession(
            self,
            messages,
            max_tokens_per_turn=self.config.max_tokens_per_turn,
            max_token_length=self.config.max_token_length,
            temperature=temperature,
            tools=self.registry.openai_tools() if openai_format else None,
        ) as session:
            while session.turns < self.config.max_turns:
                choice = await session.generate(**extra)
                if choice is None:
                    break
                text = choice.message.content or ""
                tool_calls = getattr(choice.message, "tool_calls", None)
                calls = parse_openai_calls(tool_calls) if tool_calls else parse_hermes_calls(text)
                answer = extract_answer(text)
                if not calls or answer is not None:
                    break
                for call in calls[: self.config.max_calls_per_turn]:
                    result = self.registry.execute(call)
                    valid += result.ok
                    invalid += not result.ok
                    if openai_format and tool_calls:
                        message = result.openai_message()
                        session.add("tool", message["content"], tool_call_id=call.id)
                    else:
                        session.add("tool", result.hermes_message())
                invalid += max(0, len(calls) - self.config.max_calls_per_turn)
            traj = session.trajectory()
        score = score_episode(answer, task["answer"], valid, invalid)
        stats = {
            "score": score,
            "correct": float(answer_matches(answer, task["answer"])),
            "answered": float(answer is not None),
            "calls": float(valid + invalid),
            "valid_call_rate": valid / (valid + invalid) if valid + invalid else 0.0,
            "turns": float(session.turns),
        }
        if traj is not None:
            traj["score"] = score
        return traj, stats

    async def collect_trajectories(
        self, item: dict[str, Any]
    ) -> tuple[ScoredDataGroup | None, list]:
        results = await asyncio.gather(
            *(
                self.run_episode(item, self.config.temperature)
                for _ in range(self.config.group_size)
            )
        )
        for _, stats in results:
            for key in ("score", "correct", "answered", "calls", "valid_call_rate"):
                self.log_train_metric(f"train/{key}", stats[key])
        trajectories = [traj for traj, _ in results]
        group = group_from_trajectories(
            trajectories,
            [traj["score"] if traj is not None else None for traj in trajectories],
            group_size=self.config.group_size,
        )
        return group, []

    async def _eval_task(self, task: dict[str, Any]) -> dict[str, Any]:
        """One greedy episode of an eval task: its sample (``messages``, ``score``, stats)."""
        traj, stats = await self.run_episode(task, 0.0, split="eval")
        return {
            "question": task["question"],
            "gold_answer": str(task["answer"]),
            "messages": traj["messages"] if traj else None,
            "score": stats["score"],
            "correct": bool(stats["correct"]),
            "answered": stats["answered"],
            "calls": stats["calls"],
            "valid_call_rate": stats["valid_call_rate"],
            "turns": stats["turns"],
        }

    @staticmethod
    def summarize_eval(samples: list[dict[str, Any]]) -> dict[str, float]:
        """Accuracy, mean score, answer rate, tool use, call validity and turns."""
        n = max(1, len(samples))
        with_calls = [s for s in samples if s["calls"]]
        return {
            "eval/accuracy": sum(s["correct"] for s in samples) / n,
            "eval/mean_score": sum(s["score"] for s in samples) / n,
            "eval/answer_rate": sum(s["answered"] for s in samples) / n,
            "eval/tool_use_rate": len(with_calls) / n,
            "eval/valid_call_rate": (
                sum(s["valid_call_rate"] for s in with_calls) / len(with_calls)
                if with_calls
                else 0.0
            ),
            "eval/mean_turns": sum(s["turns"] for s in samples) / n,
        }

    async def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        return await self.run_eval(
            [self._eval_task(task) for task in self.eval_tasks],
            self.summarize_eval,
            generation_parameters={
                "temperature": 0.0,
                "max_tokens": self.config.max_tokens_per_turn,
                "max_turns": self.config.max_turns,
                "tool_format": self.config.tool_format,
            },
        )


if __name__ == "__main__":
    ToolCallingEnv.cli()
