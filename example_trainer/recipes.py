"""Named quick-start recipes: settings that were measured to make a model better.

A recipe fills in ``atropos-quickstart`` flags (``flags``), environment flags (``env_args``,
``--env-arg`` pairs) and trainer settings (``trainer_args``, ``--trainer-arg`` pairs). Flags given
on the command line win over the recipe's. How each recipe was chosen, and what else was tried,
is in ``example_trainer/README.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: The gsm8k-format recipe's instruction after each question (the benches that reproduce the
#: recipe's load use it too).
GSM8K_FORMAT_INSTRUCTION = "\n\nSolve it step by step. Write the final answer as \\boxed{N}."


@dataclass(frozen=True)
class Recipe:
    """One named set of quick-start settings."""

    summary: str
    flags: dict[str, Any]
    env_args: list[str] = field(default_factory=list)
    trainer_args: list[str] = field(default_factory=list)
    trl_flags: dict[str, Any] = field(default_factory=dict)
    """Flags that replace ``flags`` with ``--trainer trl`` (TRL computes every prompt token of
    every sequence, so a step costs it several times what it costs the GRPO trainer)."""

    def options(self, trainer: str = "grpo") -> dict[str, Any]:
        """The recipe as ``atropos-quickstart`` option values (``QuickstartOptions`` fields),
        layered under the flags given; ``--env-arg``/``--trainer-arg`` add to its lists."""
        return {
            **self.flags,
            **(self.trl_flags if trainer == "trl" else {}),
            "env_arg": list(self.env_args),
            "trainer_arg": list(self.trainer_args),
        }


RECIPES: dict[str, Recipe] = {
    "arithmetic-learn": Recipe(
        summary="SmolLM2-135M-Instruct learns to answer 'What is a +/- b?' (operands 0-20) with "
        "the right integer; held-out accuracy before/after, ~5 min on 2 CPU cores with bfloat16 units "
        "(AVX-512 BF16), 10-20 min without",
        flags={
            "env": "arithmetic",
            "steps": 80,
            "group_size": 16,
            "batch_size": 64,
            "micro_batch_size": 16,
            "lr": 2e-5,
            "seq_len": 128,
            "eval": True,
            "eval_every": 20,
            "output": "runs/arithmetic-learn",
        },
        env_args=[
            "env.max_operand=20",
            "env.operators=+-",
            "env.num_eval_problems=200",
            "env.few_shot=3",
            "env.max_answer_tokens=6",
            "env.temperature=1.0",
            "env.ensure_scores_are_not_same=true",
            "env.max_batches_offpolicy=1",
        ],
        trainer_args=["checkpoint_interval=20", "pause_generation=true"],
        trl_flags={"steps": 20, "eval_every": 10, "output": "runs/arithmetic-learn-trl"},
    ),
    "gsm8k-format": Recipe(
        summary="SmolLM2-135M-Instruct learns to finish its GSM8K solutions with one \\boxed{} "
        "number (the bundled train split; 200 held-out test problems before/after); at least 13 "
        "steps, up to 20 while they fit in 11 min 30 s (evaluations included) on 2 CPU cores with "
        "bfloat16 units (AVX-512 BF16); 13 steps take longer without",
        flags={
            "env": "gsm8k",
            "steps": 20,
            "min_steps": 13,
            "max_time": 690.0,
            "group_size": 16,
            "batch_size": 32,
            "micro_batch_size": 16,
            "lr": 1e-4,
            "seq_len": 384,
            "eval": True,
            "eval_every": 0,
            "output": "runs/gsm8k-format",
        },
        env_args=[
            "env.system_prompt=",
            "env.prompt_suffix=" + GSM8K_FORMAT_INSTRUCTION,
            "env.max_answer_tokens=128",
            "env.max_eval_items=200",
            "env.temperature=0.4",
            "env.format_reward=1.0",
            "env.box_reward=0.5",
            "env.format_min_tokens=24",
            "env.strict_answer=true",
            "env.min_completion_tokens=0",
            "env.ensure_scores_are_not_same=true",
            "env.max_batches_offpolicy=1",
        ],
        trainer_args=[
            "checkpoint_interval=10",
            "pause_generation=true",
            "skip_grad_spikes=2.5",
        ],
        trl_flags={"steps": 13, "min_steps": 0, "max_time": None},
    ),
}
