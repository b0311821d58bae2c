"""RLAIF: open-ended answers scored by an LLM judge at a configurable OpenAI endpoint.

For each prompt the policy samples ``group_size`` answers; a judge model (any
OpenAI-compatible chat endpoint: ``--env.judge_base_url``, ``--env.judge_model_name``,
``--env.judge_api_key``; by default the same server as the policy, like upstream's
self-judging ``rlaif_server.py``) scores them:

* ``--env.judge_mode pairwise`` (default): every pair of answers is compared, in both orders
  when ``judge_swap`` (position bias cancels); an answer's score is ``2 * win_rate - 1``.
* ``--env.judge_mode rubric``: each answer is rated on ``rubric`` from ``rubric_min`` to
  ``rubric_max``, mapped to [-1, 1].

Judge replies are parsed leniently (``[[A]]``, ``Verdict: B``, ``Rating: [[7]]``, ``7/10``);
an unparseable reply is retried ``judge_retries`` times, then counts as a tie / the middle of
the scale, and is counted in ``judge/parse_failure_rate``; an unreachable judge is counted in
``judge/errors`` and never kills the rollout.

Prompts: a small instruction set shipped in this file (with reference answers), or
``--env.prompts_path`` (JSONL of ``{"prompt", "reference"?}``). ``evaluate()`` answers the
eval prompts at temperature 0 and reports ``eval/mean_rubric_score`` (judge rating in
[-1, 1]), ``eval/win_rate_vs_reference`` and ``eval/judge_parse_failure_rate``.

    python environments/rlaif_server.py serve --env.judge_base_url http://judge:8000/v1 \\
        --env.judge_model_name Qwen/Qwen3-8B
    python environments/rlaif_server.py process --env.total_steps 4
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from atroposlib.envs.base import BaseEnv, ScoredDataGroup
from atroposlib.envs.config import LocalEnvConfig
from atroposlib.envs.rollout import eval_completion, group_from_samples, sample_chat_group
from atroposlib.envs.server_handling.server_baseline import local_server_configs
from atroposlib.scoring.judge import (
    DEFAULT_RUBRIC,
    JudgeStats,
    OpenAIJudge,
    judge_pair,
    judge_rubric,
    score_group_pairwise,
    score_group_rubric,
)
from atroposlib.utils.data import load_rows

SYSTEM_PROMPT = "You are a helpful, honest and concise assistant."

#: The shipped prompt set: (prompt, reference answer).
PROMPTS: list[tuple[str, str]] = [
    ("Explain in two sentences why the sky is blue.",
     "Sunlight is scattered by the molecules in the air, and shorter (blue) wavelengths scatter "
     "much more than longer ones (Rayleigh scattering). So blue light reaches our eyes from every "
     "direction of the sky."),
    ("Give three tips for getting better sleep.",
     "1. Keep a regular schedule, even on weekends. 2. Avoid screens and caffeine in the hours "
     "before bed. 3. Keep the bedroom dark, quiet and cool."),
    ("Write a haiku about autumn rain.",
     "Cold rain on red leaves / the gutter hums a slow song / the year exhales grey"),
    ("What is the difference between weather and climate?",
     "Weather is the short-term state of the atmosphere (today's rain or heat); climate is the "
     "average pattern of weather in a region over decades."),
    ("Summarize the plot of Romeo and Juliet in one sentence.",
     "Two young lovers from feuding families in Verona marry in secret, and a chain of "
     "misunderstandings ends in both of their deaths, which reconciles the families."),
    ("How do I reverse a list in Python?",
     "Use `my_list.reverse()` to reverse it in place, or `my_list[::-1]` / `list(reversed(my_list))` "
     "for a reversed copy."),
    ("Suggest a name for a coffee shop run by cats.", "The Purrcolator."),
    ("Why do we have leap years?",
     "A year (one orbit of the Sun) lasts about 365.24 days; adding a day every four years "
     "(with century exceptions) keeps the calendar aligned with the seasons."),
    ("Write a polite email declining a meeting invitation.",
     "Hi Sam, thank you for the invitation. Unfortunately I can't attend on Thursday because of a "
     "prior commitment. Could you share the notes afterwards? Best regards, Alex"),
    ("What are the main causes of inflation?",
     "Demand growing faster than supply (demand-pull), rising production costs such as energy or "
     "wages (cost-push), and expectations of future inflation, often fed by money supply growth."),
    ("Explain what a hash table is to a beginner.",
     "A hash table stores key-value pairs. A hash function turns each key into an array index, so "
     "looking a value up by its key is usually very fast, no matter how many items are stored."),
    ("List the planets of the solar system in order from the Sun.",
     "Mercury, Venus, Earth, Mars, Jupiter, Saturn, Uranus, Neptune."),
    ("Give me a simple recipe for pancakes.",
     "Whisk 1 cup flour, 1 tbsp sugar, 2 tsp baking powder and a pinch of salt; add 1 cup milk, "
     "1 egg and 2 tbsp melted butter; cook ladlefuls on a hot greased pan until bubbles form, "
     "flip, and cook another minute."),
    ("What is photosynthesis?",
     "The process by which plants, algae and some bacteria use light energy to turn carbon "
     "dioxide and water into glucose and oxygen."),
    ("How can I politely ask a neighbour to keep the noise down?",
     "Pick a calm moment, greet them, explain the specific problem (e.g. music after 11pm) and how "
     "it affects you, and suggest a compromise, such as quieter hours on weeknights."),
    ("Translate 'Where is the train station?' into French and Spanish.",
     "French: Où est la gare ? Spanish: ¿Dónde está la estación de tren?"),
    ("Explain the rule of thirds in photography.",
     "Divide the frame into a 3x3 grid and place the subject or key lines along the grid lines or "
     "their intersections rather than the centre; this usually gives a more balanced image."),
    ("What should I pack for a one-day hike?",
     "Water, snacks, a map or navigation app, sun protection, a rain layer, a small first-aid kit, "
     "a charged phone and sturdy shoes."),
    ("Describe the water cycle briefly.",
     "Water evaporates from oceans and land, condenses into clouds, falls as precipitation, and "
     "flows back through rivers and groundwater to the sea, where the cycle repeats."),
    ("Write a two-line motivational message for a friend starting a new job.",
     "You earned this and you're ready for it. Go learn, ask questions, and enjoy the new start!"),
    ("Is a tomato a fruit or a vegetable?",
     "Botanically a fruit (it develops from the flower and holds seeds); in cooking it is usually "
     "treated as a vegetable."),
    ("What is the Pythagorean theorem?",
     "In a right triangle, the square of the hypotenuse equals the sum of the squares of the "
     "other two sides: a² + b² = c²."),
    ("Give two arguments for and two against working from home.",
     "For: no commute, more flexible hours. Against: weaker separation of work and home, fewer "
     "spontaneous conversations with colleagues."),
    ("Explain recursion with a short example.",
     "A recursive function calls itself on a smaller input until a base case. Example: "
     "factorial(n) = 1 if n == 0 else n * factorial(n - 1)."),
]  # fmt: skip


def load_prompts(path: str | Path) -> list[dict[str, Any]]:
    """Prompts from a JSONL file of ``{"prompt", "reference"?}`` (errors name the line)."""
    rows = load_rows(path, flag="prompts_path", required={"prompt": str}, allow_empty=False)
    return [{"prompt": row["prompt"], "reference": row.get("reference")} for row in rows]


class RLAIFEnvConfig(LocalEnvConfig):
    """Settings of the RLAIF environment."""

    max_token_length: int = 1024
    ensure_scores_are_not_same: bool = False

    judge_base_url: str = Field(
        default="http://localhost:9001/v1", description="OpenAI-compatible URL of the judge"
    )
    judge_model_name: str = Field(default="SmolLM2-135M-Instruct", description="Judge model")
    judge_api_key: str = Field(default="x", description="API key of the judge endpoint")
    judge_mode: Literal["pairwise", "rubric"] = Field(
        default="pairwise", description="pairwise comparisons or a rubric rating per answer"
    )
    judge_swap: bool = Field(default=True, description="Judge each pair in both orders")
    judge_retries: int = Field(default=1, ge=0, description="Retries of an unparseable reply")
    judge_max_tokens: int = Field(default=512, ge=1, description="Judge generation budget")
    judge_temperature: float = Field(default=0.0, ge=0.0, description="Judge temperature")
    judge_concurrency: int = Field(default=8, ge=1, description="Judge requests in flight")
    rubric: str = Field(default=DEFAULT_RUBRIC, description="Rubric of the rubric mode")
    rubric_min: int = Field(default=1, description="Lowest rubric rating")
    rubric_max: int = Field(default=10, description="Highest rubric rating")
    prompts_path: str | None = Field(
        default=None, description="JSONL of {prompt, reference?} instead of the shipped set"
    )
    max_answer_tokens: int = Field(default=256, ge=1, description="Policy generation budget")
    temperature: float = Field(default=1.0, ge=0.0, description="Policy sampling temperature")
    num_eval_prompts: int = Field(default=8, ge=1, description="Prompts evaluate() answers")
    seed: int = Field(default=0, description="Shuffle seed of the prompts")


class RLAIFEnv(BaseEnv):
    """Open-ended answers scored by an LLM judge (pairwise or rubric)."""

    name = "rlaif"
    env_config_cls = RLAIFEnvConfig

    default_server_configs = local_server_configs(num_requests_for_eval=8, timeout=300)

    async def setup(self) -> None:
        cfg = self.config
        if cfg.rubric_max <= cfg.rubric_min:
            raise ValueError("rubric_max: must be greater than rubric_min")
        if cfg.prompts_path:
            rows = load_prompts(cfg.prompts_path)
        else:
            rows = [{"prompt": p, "reference": r} for p, r in PROMPTS]
        random.Random(cfg.seed).shuffle(rows)
        n_eval = min(cfg.num_eval_prompts, max(1, len(rows) // 3))
        self.eval_rows, self.train_rows = rows[:n_eval], rows[n_eval:] or rows
        self.client = OpenAIJudge(
            cfg.judge_base_url,
            cfg.judge_model_name,
            api_key=cfg.judge_api_key,
            temperature=cfg.judge_temperature,
            max_tokens=cfg.judge_max_tokens,
        )
        self._judge_sem = asyncio.Semaphore(cfg.judge_concurrency)
        self.judge_stats = JudgeStats()
        self._eval_stats = JudgeStats()  # judge calls of the current evaluate()
        self.iter = 0

    async def judge(self, messages: list[dict[str, str]], n: int = 1) -> list[str]:
        """The judge endpoint, with bounded concurrency (a ``JudgeFn``)."""
        async with self._judge_sem:
            return await self.client(messages, n)

    async def get_next_item(self) -> dict[str, Any]:
        row = self.train_rows[self.iter % len(self.train_rows)]
        self.iter += 1
        return row

    def _messages(self, prompt: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]

    async def score_answers(self, prompt: str, answers: list[str]) -> list[float]:
        """Judge scores in [-1, 1] for ``answers`` to ``prompt`` (per ``judge_mode``)."""
        cfg = self.config
        if cfg.judge_mode == "pairwise":
            return await score_group_pairwise(
                self.judge, prompt, answers, swap=cfg.judge_swap, retries=cfg.judge_retries,
                stats=self.judge_stats,
            )  # fmt: skip
        return await score_group_rubric(
            self.judge, prompt, answers, rubric=cfg.rubric, scale=(cfg.rubric_min, cfg.rubric_max),
            retries=cfg.judge_retries, stats=self.judge_stats,
        )  # fmt: skip

    async def collect_trajectories(
        self, item: dict[str, Any]
    ) -> tuple[ScoredDataGroup | None, list]:
        samples = await sample_chat_group(
            self,
            self._messages(item["prompt"]),
            n=self.config.group_size,
            max_tokens=self.config.max_answer_tokens,
            temperature=self.config.temperature,
        )
        texts = [s.text for s in samples]
        group = group_from_samples(
            samples,
            await self.score_answers(item["prompt"], texts),
            group_size=self.config.group_size,
        )
        self.log_train_metric("train/mean_judge_score", group["scores"])
        return group, []

    async def _eval_one(self, row: dict[str, Any]) -> dict[str, Any]:
        """A greedy answer to an eval prompt, rated on the rubric and (with a reference)
        judged against it."""
        cfg = self.config
        answer, _ = await eval_completion(
            self, self._messages(row["prompt"]), cfg.max_answer_tokens, 0.0
        )
        rating = await judge_rubric(
            self.judge, row["prompt"], answer, rubric=cfg.rubric,
            scale=(cfg.rubric_min, cfg.rubric_max), reference=row.get("reference"),
            retries=cfg.judge_retries, stats=self._eval_stats,
        )  # fmt: skip
        win = None
        if row.get("reference"):
            win = await judge_pair(
                self.judge, row["prompt"], answer, row["reference"],
                swap=cfg.judge_swap, retries=cfg.judge_retries, stats=self._eval_stats,
            )  # fmt: skip
        low, high = cfg.rubric_min, cfg.rubric_max
        return {
            "question": row["prompt"],
            "response": answer,
            "judge_rating": rating,
            "win_vs_reference": win,
            "score": 0.0 if rating is None else 2 * (rating - low) / (high - low) - 1,
        }

    def summarize_eval(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        """``eval/mean_rubric_score`` (in [-1, 1]), ``eval/rated_fraction``,
        ``eval/judge_parse_failure_rate`` and ``eval/win_rate_vs_reference``."""
        n = max(1, len(samples))
        wins = [s["win_vs_reference"] for s in samples if s["win_vs_reference"] is not None]
        metrics = {
            "eval/mean_rubric_score": sum(s["score"] for s in samples) / n,
            "eval/rated_fraction": sum(s["judge_rating"] is not None for s in samples) / n,
            "eval/judge_parse_failure_rate": self._eval_stats.as_metrics()[
                "judge/parse_failure_rate"
            ],
        }
        if wins:
            metrics["eval/win_rate_vs_reference"] = sum(wins) / len(wins)
        return metrics

    async def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        self._eval_stats = JudgeStats()
        return await self.run_eval(
            [self._eval_one(row) for row in self.eval_rows],
            self.summarize_eval,
            generation_parameters={"temperature": 0.0, "max_tokens": self.config.max_answer_tokens},
        )

    async def wandb_log(self, wandb_metrics: dict[str, Any] | None = None) -> None:
        wandb_metrics = dict(wandb_metrics or {})
        if hasattr(self, "judge_stats"):
            wandb_metrics.update(self.judge_stats.as_metrics())
        await super().wandb_log(wandb_metrics)


if __name__ == "__main__":
    RLAIFEnv.cli()
