"""Every bundled environment passes ``check`` against a real ``atropos-serve`` (the tiny model):
its groups keep the contract, its evaluation runs and returns metrics, its settings round-trip
through YAML. Flags point the envs at local data (no hub) and keep conversations inside the
tiny model's 2,048-token context. All envs run in one process (``check_all.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.environments.test_math import ROWS as MATH_ROWS

ENVS = REPO / "environments"
GAMES = [
    "--env.max_turns",
    "2",
    "--env.max_tokens_per_turn",
    "12",
    "--env.max_token_length",
    "1024",
]
#: Each bundled env file and the flags it runs ``check`` with ({tmp}: a scratch folder).
BUNDLED: dict[str, list[str]] = {
    "arithmetic_server.py": [],
    "code_execution_server/coding_server.py": [],
    "dataset_environment/dataset_env.py": [
        "--config", str(ENVS / "dataset_environment" / "configs" / "gsm8k_local.yaml"),
        "--env.max_token_length", "64",
    ],
    "game_environments/gymnasium/blackjack/blackjack_env.py": GAMES,
    "game_environments/gymnasium/gym_taxi.py": GAMES,
    "game_environments/textworld_env/textworld_env.py": [
        *GAMES, "--env.games_dir", "{tmp}/games", "--env.num_games", "1",
    ],
    "gsm8k_server.py": ["--env.max_token_length", "256"],
    "math_server.py": ["--env.dataset_path", "{tmp}/math", "--env.max_token_length", "64"],
    "mcqa_mmlu_server.py": [],
    "multimodal_shapes_server.py": [],
    "reasoning_gym_environment/reasoning_gym_environment.py": [],
    "rlaif_server.py": [],
    "tool_calling_server.py": [],
}  # fmt: skip


def test_every_bundled_env_file_is_listed() -> None:
    files = {
        str(p.relative_to(ENVS))
        for p in ENVS.rglob("*.py")
        if p.name != "__init__.py" and "data" not in p.relative_to(ENVS).parts
    }
    assert files == set(BUNDLED)


@pytest.mark.slow
def test_every_bundled_env_passes_check(tiny_serve, tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "math").mkdir()
    for split in ("train", "test"):
        rows = "\n".join(json.dumps(r) for r in MATH_ROWS) + "\n"
        (tmp_path / "math" / f"{split}.jsonl").write_text(rows)
    server = [
        "--env.tokenizer_name", str(tiny_model_dir),
        "--openai.base_url", tiny_serve.url + "/v1", "--openai.model_name", "tiny",
        "--openai.server_type", "vllm", "--openai.api_key", "x",
        "--openai.tokenizer_name", str(tiny_model_dir),
        "--check.serve", "never", "--check.items", "1", "--check.eval_items", "1",
    ]  # fmt: skip
    jobs = [
        {
            "file": str(ENVS / name),
            "args": [a.replace("{tmp}", str(tmp_path)) for a in flags] + server,
        }
        for name, flags in BUNDLED.items()
    ]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets"),
        "WANDB_MODE": "disabled",
        "PYTHONPATH": str(REPO),
    }
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("check_all.py"))],
        input="\n".join(json.dumps(job) for job in jobs),
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(BUNDLED), proc.stderr[-3000:]
    failed = {Path(r["file"]).name: r["out"][-2500:] for r in results if r["code"] not in (0, None)}
    assert not failed, "\n\n".join(f"== {name}\n{out}" for name, out in failed.items())
    for result in results:
        assert "ok: 0 error(s)" in result["out"], result["out"][-2000:]
    timings = ", ".join(f"{Path(r['file']).name} {r['seconds']} s" for r in results)
    print(f"check per env: {timings}")
