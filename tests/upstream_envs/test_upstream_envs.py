"""Upstream Atropos's environment files, byte-identical, run with this library.

Every vendored file in ``environments/`` imports and answers ``--help`` and ``process --help``;
the files in ``PROCESS`` also run ``process`` for one group against a real ``atropos-serve``
(serving a scripted tiny model, ``scripted_model.py``, whose replies the env scores
differently, since upstream's envs drop groups whose scores are all equal), with their hub
datasets replaced by the tiny JSONL files in ``data/`` (``standins/sitecustomize.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import ServeProcess, start_server
from tests.upstream_envs.scripted_model import build_scripted_model

HERE = Path(__file__).resolve().parent
ENVS = HERE / "environments"
UPSTREAM_COMMIT = "296a0bc55760e43b9c0743c052f8d6c2732606d1"

ELDRITCH = "The void stirs beneath your greeting; a thousand eyes blink awake in the dark."

# file -> (replies of the scripted model, extra process flags[, a line its stdout must have])
PROCESS: dict[str, tuple] = {
    "gsm8k_server.py": (
        [
            "Let me think about it carefully. The final answer is \\boxed{18}",
            "I am not sure what this question asks, sorry",
        ],
        ["--env.max_token_length", "256"],
    ),
    "mcqa_thinking_env.py": (
        [
            ["<", "think", ">", " hmm", "</", "Think", ">.", "The best answer is: B"],
            "I refuse to choose any of these options because none seem right",
        ],
        ["--env.max_token_length", "1024"],
    ),
    "math_server.py": (
        [
            "<think>Ten apples and eight more make eighteen.</think>The answer is \\boxed{18}",
            "<think>I think he ate some of them first.</think>The answer is \\boxed{7}",
        ],
        # no judging or length penalty (random branches); prompt + 1024 reply tokens
        ["--env.max_token_length", "1400", "--env.percent_to_judge", "0"],
    ),
    "math_server_zero.py": (
        [
            " Ten and eight make eighteen. </think> <answer> \\boxed{18} </answer>",
            " He must have eaten some apples. </think> <answer> \\boxed{7} </answer>",
        ],
        ["--env.max_token_length", "1400"],
    ),
    "text_reversal_environment.py": (
        [
            "<think>Backwards, letter by letter.</think><reversed_text>dlrow olleH</reversed_text>",
            "<think>That looks easy enough.</think><reversed_text>Hello world</reversed_text>",
        ],
        ["--env.max_token_length", "1024", "--env.train_max_tokens", "64"],
    ),
    "tool_calling_server.py": (
        [
            '<think>The weather tool fits.</think>\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}\n</tool_call>',
            '<think>Maybe the other city.</think>\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Rome"}}\n</tool_call>',
        ],
        ["--env.max_token_length", "1024"],
    ),
    "rlaif_server.py": (
        {  # the judge (same server) prefers the eldritch reply, as A or as B
            "[Response A]\n" + ELDRITCH: [
                "<think>The tentacles steer the vibes.</think>\\boxed{A}"
            ],
            "[Response B]\n" + ELDRITCH: [
                "<think>The tentacles steer the vibes.</think>\\boxed{B}"
            ],
            "": [ELDRITCH, "Hi there! I am doing well, thank you for asking."],
        },
        ["--env.max_token_length", "1024"],
    ),
    "instruction_following_algorithm_environment.py": (
        [
            "<think>Use the word.</think>This sentence is an example of a sentence.",
            "<think>Keep it short.</think>This sentence has no such word in it at all.",
        ],
        ["--env.max_token_length", "1024"],
        "Successfully processed 4 items",  # the stand-in, not the env's dummy fallback
    ),
    "fundamental_prediction_environment.py": (
        [
            "<think>Sales keep growing.</think>The revenue will be: raised and the magnitude "
            "will be: 10%",
            "<think>Hard to say.</think>The revenue will be: reduced and the magnitude will be: 5%",
        ],
        ["--env.max_token_length", "1024"],
    ),
    "tool_use_multiturn_server.py": (
        [
            '<think>The weather tool fits.</think>\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}\n</tool_call>',
            '<think>Maybe the other city.</think>\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Rome"}}\n</tool_call>',
        ],
        ["--env.max_token_length", "2048", "--env.scenario_category", "single"],
    ),
    "tool_use_turnlevel_advantage_server.py": (
        {  # turn 2 (after the tool's answer, which has temp_c): narrate it
            "temp_c": ["<think>Report it.</think>It is 21 degrees C in Paris."],
            "": [
                '<think>The weather tool fits.</think>\n<tool_call>\n{"name": "get_weather", '
                '"arguments": {"city": "Paris"}}\n</tool_call>',
                '<think>Maybe the other city.</think>\n<tool_call>\n{"name": "get_weather", '
                '"arguments": {"city": "Rome"}}\n</tool_call>',
            ],
        },
        [
            "--env.max_token_length",
            "4096",
            "--env.scenario_category",
            "single",
            "--env.min_tool_call_turns",
            "1",
        ],
    ),
    "gsm8k_server_axolotl.py": (
        [
            "Let me think about it carefully. The final answer is \\boxed{18}",
            "I am not sure what this question asks, sorry",
        ],
        ["--env.max_token_length", "256"],
    ),
    "gsm8k_server_teacher_distill.py": (
        [
            "Let me think about it carefully. The final answer is \\boxed{18}",
            "I am not sure what this question asks, sorry",
        ],
        [
            "--env.max_token_length",
            "256",
            "--teacher.base_url",
            "{url}/v1",
            "--teacher.model_name",
            "tiny",
            "--teacher.server_type",
            "vllm",
            "--teacher.tokenizer_name",
            "{model}",  # the scripted model's folder holds the SmolLM2 tokenizer
        ],
    ),
}
# Each reply is one of two scripted ones, 50/50; an env drops a group whose scores are all equal
# and process mode gives up after 11 such groups. With 4 replies a group is all-equal 1 time in
# 8, so giving up is a (1/8)^11 event (with 2 replies it was 1 in 2,000 runs per env).
GROUP_SIZE = 4
#: rlaif_server judges replies pairwise (A vs B): its groups stay at 2 (a 1-in-2,000 flake).
GROUP_SIZES = {"rlaif_server.py": 2}


def _env(tmp: Path) -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp / "hf-datasets"),
        "WANDB_MODE": "disabled",
        "PYTHONPATH": os.pathsep.join([str(HERE / "standins"), str(HERE)]),
        "ATROPOS_STANDIN_DATA": str(HERE / "data"),
    }


def test_vendored_files_are_upstreams() -> None:
    """The env files are upstream's, unchanged (compared with the mirror when it is here)."""
    mirror = Path("/work/.mirror/NousResearch+atropos/repo")
    files = sorted(ENVS.glob("*.py"))
    assert len(files) >= 13
    if not mirror.exists():
        return
    for path in files:
        upstream = subprocess.run(
            ["git", "-C", str(mirror), "show", f"{UPSTREAM_COMMIT}:environments/{path.name}"],
            capture_output=True,
            check=True,
        ).stdout
        assert hashlib.sha256(upstream).digest() == hashlib.sha256(path.read_bytes()).digest()


def test_every_env_file_answers_help(tmp_path: Path) -> None:
    """``ENV.py --help`` and ``ENV.py process --help`` exit 0 for every vendored file."""
    files = sorted(str(p) for p in ENVS.glob("*.py"))
    proc = subprocess.run(
        [sys.executable, str(HERE / "help_all.py"), *files],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        cwd=HERE,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 2 * len(files)
    for result in results:
        name = Path(result["file"]).name
        assert result["code"] in (0, None), f"{name} {result['args']}: {result['out'][-2000:]}"
        assert "--env.group_size" in result["out"] or result["args"] == ["--help"], name
        assert "process" in result["out"], name


@pytest.fixture(scope="module")
def scripted_serve(tmp_path_factory: pytest.TempPathFactory):
    """One ``atropos-serve`` for the module; each test reloads it with its env's script."""
    first = next(iter(PROCESS.values()))[0]
    model = build_scripted_model(tmp_path_factory.mktemp("scripted") / "m0", first)
    with pytest.MonkeyPatch.context() as patch:  # the server loads the scripted model type
        patch.setenv("PYTHONPATH", str(HERE / "standins"))
        patch.setenv("ATROPOS_SCRIPTED_MODEL", "1")
        server = start_server(
            tmp_path_factory, model, "--dtype", "float32", "--served-model-name", "tiny"
        )
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("env_file", sorted(PROCESS))
def test_env_file_processes_a_group(
    env_file: str, scripted_serve: ServeProcess, tmp_path: Path
) -> None:
    """``ENV.py process`` writes one scored group whose replies came from atropos-serve."""
    replies, flags, *expect = PROCESS[env_file]
    model = build_scripted_model(tmp_path / "model", replies)
    reload = httpx.post(
        scripted_serve.url + "/reload_weights", json={"path": str(model)}, timeout=120
    )
    assert reload.status_code == 200, reload.text
    out = tmp_path / "groups.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            str(ENVS / env_file),
            "process",
            "--env.total_steps",
            "1",
            "--env.group_size",
            str(GROUP_SIZES.get(env_file, GROUP_SIZE)),
            "--env.tokenizer_name",
            "SmolLM2-135M-Instruct",
            "--env.data_path_to_save_groups",
            str(out),
            "--openai.base_url",
            scripted_serve.url + "/v1",
            "--openai.model_name",
            "tiny",
            "--openai.server_type",
            "vllm",
            "--openai.api_key",
            "x",
            # a group whose sampled replies happen to score the same is dropped and retried
            "--env.ensure_scores_are_not_same",
            "true",
            *(f.replace("{url}", scripted_serve.url).replace("{model}", str(model)) for f in flags),
        ],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        cwd=tmp_path,
        timeout=240,
    )
    log = proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.returncode == 0, log
    # (not the "Processed 1 of 1 groups" log line: some envs silence atroposlib.envs.base)
    assert f"Wrote 1 groups to {out}" in proc.stdout, log
    for line in expect:
        assert line in proc.stdout, log
    groups = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(groups) == 1, log
    group = groups[0]
    size = GROUP_SIZES.get(env_file, GROUP_SIZE)
    assert len(group["tokens"]) == len(group["masks"]) == len(group["scores"]) == size
    assert len(set(group["scores"])) > 1  # scored the scripts differently
    assert all(-100 in masks for masks in group["masks"])  # prompts masked, replies trained
    if "teacher" in env_file:  # the teacher (the same server) gave top-k logprobs per token
        assert [len(t) for t in group["distill_token_ids"]] == [len(t) for t in group["tokens"]]
