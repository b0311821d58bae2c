"""docs/writing-an-env.md: both examples, copied out of the page, pass ``check`` against a real
``atropos-serve``; the line counts the page reports are those of the code (ours here, the
verifiers and TRL versions below); the verifiers version loads and scores with verifiers
0.1.9.post2."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO

DOC = REPO / "docs" / "writing-an-env.md"
VF_PY = Path(os.environ.get("ATROPOS_VERIFIERS_PYTHON", "/tmp/verifiers-0.1.9-venv/bin/python"))

#: The word reversal for verifiers 0.1 (an environment package's module).
VERIFIERS_REVERSE = '''\
"""Reverse a word: one prompt, `rollouts_per_example` replies, 1 point for the reversed word."""
import random

import verifiers as vf
from datasets import Dataset

WORDS = ["apple", "river", "stone", "cloud", "light", "tiger", "maple", "ocean"]


def load_environment(**kwargs):
    rng = random.Random(0)
    words = [rng.choice(WORDS) for _ in range(1000)]
    dataset = Dataset.from_list(
        [{"question": f"Write '{w}' backwards. Reply with one word.", "answer": w[::-1]}
         for w in words]
    )

    def reversed_word(completion, answer, **kwargs):
        return float(answer in completion[-1]["content"].lower())

    return vf.SingleTurnEnv(
        dataset=dataset, rubric=vf.Rubric(funcs=[reversed_word]), **kwargs
    )
'''

#: The word reversal for TRL: a reward function and a dataset (GRPOTrainer samples).
TRL_REVERSE = """\
import random

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

WORDS = ["apple", "river", "stone", "cloud", "light", "tiger", "maple", "ocean"]
rng = random.Random(0)
words = [rng.choice(WORDS) for _ in range(1000)]
dataset = Dataset.from_list([
    {"prompt": [{"role": "user", "content": f"Write '{w}' backwards. Reply with one word."}],
     "word": w} for w in words
])
def reversed_word(completions, word, **kwargs):
    return [float(w[::-1] in c[-1]["content"].lower()) for c, w in zip(completions, word)]
trainer = GRPOTrainer("HuggingFaceTB/SmolLM2-135M-Instruct", reward_funcs=reversed_word,
                      train_dataset=dataset, args=GRPOConfig(max_completion_length=16))
trainer.train()
"""

#: Guess the number for TRL: the page's class unchanged, then the trainer.
TRL_GUESS_TAIL = """\
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

rows = [{"prompt": [{"role": "user", "content": "Let's play a game."}], "seed": seed}
        for seed in range(100)]
trainer = GRPOTrainer("HuggingFaceTB/SmolLM2-135M-Instruct", environment_factory=GuessTheNumber,
                      train_dataset=Dataset.from_list(rows), args=GRPOConfig(max_steps=100))
trainer.train()
"""


def block(section: str) -> str:
    text = DOC.read_text().split(f"## {section}", 1)[1]
    match = re.search(r"```python\n(.*?)```", text, re.S)
    assert match, section
    return match.group(1)


def lines(code: str) -> int:
    return sum(1 for line in code.splitlines() if line.strip())


def table_row(name: str) -> list[str]:
    row = next(line for line in DOC.read_text().splitlines() if line.startswith(f"| {name}"))
    return [cell.strip() for cell in row.strip("|").split("|")]


def guess_class() -> str:
    code = block("A multi-turn tool environment")
    return code.split("class GuessTheNumber:", 1)[1].split('\n\nif __name__ == "__main__":')[0]


def test_the_line_counts_are_the_code_s() -> None:
    reverse = table_row("reverse a word")
    assert reverse[1].startswith(f"{lines(block('A single-turn environment'))} ")
    assert reverse[2].startswith(f"{lines(VERIFIERS_REVERSE)} ")
    assert reverse[3].startswith(f"{lines(TRL_REVERSE)} ")
    guess = table_row("guess the number")
    assert guess[1].startswith(f"{lines(block('A multi-turn tool environment'))} ")
    trl_guess = "import random\n\nclass GuessTheNumber:" + guess_class() + "\n" + TRL_GUESS_TAIL
    compile(trl_guess, "trl_guess.py", "exec")
    compile(TRL_REVERSE, "trl_reverse.py", "exec")
    assert guess[3].startswith(f"{lines(trl_guess)} ")


def _check(script: Path, serve, model_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    return subprocess.run(
        [
            sys.executable,
            str(script),
            "check",
            "--env.tokenizer_name",
            str(model_dir),
            "--openai.base_url",
            serve.url + "/v1",
            "--openai.model_name",
            "tiny",
            "--openai.tokenizer_name",
            str(model_dir),
            "--check.serve",
            "never",
            *extra,
        ],  # fmt: skip
        capture_output=True,
        text=True,
        env=env,
        cwd=script.parent,
        timeout=600,
    )


@pytest.mark.parametrize(
    ("section", "extra"),
    [
        ("A single-turn environment", ()),
        ("A multi-turn tool environment", ("--env.max_turns", "3")),
    ],
)
def test_each_example_passes_check(tiny_serve, tiny_model_dir, tmp_path, section, extra) -> None:
    script = tmp_path / "env.py"
    script.write_text(block(section))
    proc = _check(script, tiny_serve, tiny_model_dir, *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ok: 0 error(s)" in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(
    not VF_PY.exists(), reason=f"the verifiers 0.1.9.post2 virtualenv is not at {VF_PY}"
)
def test_the_verifiers_version_loads_and_scores(tmp_path: Path) -> None:
    (tmp_path / "vf_reverse_word.py").write_text(VERIFIERS_REVERSE)
    probe = textwrap.dedent(
        """
        import asyncio, contextlib, verifiers as vf
        env = vf.load_environment("vf-reverse-word")
        row = env.get_dataset()[0]
        for text, want in ((row["answer"], 1.0), ("no idea", 0.0)):
            state = {"prompt": row["prompt"], "answer": row["answer"], "task": "default",
                     "info": {}, "completion": [{"role": "assistant", "content": text}],
                     "timing": {"total_ms": 0.0}}
            asyncio.run(env.rubric.score_rollout(state, contextlib.nullcontext()))
            assert state["reward"] == want, state
        print("ok", len(env.get_dataset()))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [str(VF_PY), "-c", probe], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-2:] == ["ok", "1000"]
