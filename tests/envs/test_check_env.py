"""``check``: ``python env.py check`` / ``check_env`` passes a correct env and names what is
wrong with a broken one (the method and the field), against a real ``atropos-serve``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from atroposlib.envs import EnvironmentClassEnv
from atroposlib.envs.check import check_env
from tests.conftest import REPO
from tests.envs.broken_envs import ENVS
from tests.envs.env_classes import Counter


def server_flags(serve, model_dir: Path) -> list[str]:
    return [
        "--env.tokenizer_name", str(model_dir), "--env.group_size", "4",
        "--openai.base_url", serve.url + "/v1", "--openai.model_name", "tiny",
        "--openai.server_type", "vllm", "--openai.api_key", "x",
        "--openai.tokenizer_name", str(model_dir),
    ]  # fmt: skip


def test_a_correct_env_passes(tiny_serve, tiny_model_dir: Path) -> None:
    report = check_env(ENVS["Echo"], server_flags(tiny_serve, tiny_model_dir))
    assert report.ok, report.render()
    assert report.errors == []
    assert (report.items, report.groups, report.sequences) == (2, 2, 8)
    assert report.evaluated is not None and "eval/odd" in report.evaluated
    assert report.server == tiny_serve.url + "/v1"  # it was up: nothing started


@pytest.mark.parametrize(
    ("name", "where", "message"),
    [
        ("PromptTrained", "collect_trajectories (item 0)", "masks[0]: the prompt is trained on"),
        (
            "WrongSize",
            "collect_trajectories (item 0)",
            "the sender would drop this group: 3 sequences but group_size is 4",
        ),
        ("BadLengths", "collect_trajectories (item 0)", "masks"),
        ("EvalFails", "evaluate (broken_envs.py:", "AttributeError: 'EvalFails' object has no"),
        ("EvalEmpty", "evaluate", "returned {}: no metrics"),
        ("BadConfig", "config: --env.reply_tokens", "does not round-trip through YAML: "),
    ],
)
def test_a_broken_env_fails_naming_the_method_and_field(
    tiny_serve, tiny_model_dir: Path, name: str, where: str, message: str
) -> None:
    report = check_env(ENVS[name], server_flags(tiny_serve, tiny_model_dir))
    assert not report.ok
    assert any(e.where.startswith(where) and message in e.message for e in report.errors), (
        report.render()
    )


def test_flat_scores_and_cut_replies_are_warnings_and_strict_fails(
    tiny_serve, tiny_model_dir: Path
) -> None:
    flags = [*server_flags(tiny_serve, tiny_model_dir), "--env.reply_tokens", "1"]
    report = check_env(ENVS["Echo"], [*flags, "--check.evaluate", "false"])
    # one-token replies: every reply has odd length 1 or is empty: scores alike, replies cut
    assert report.ok and not report.errors, report.render()
    messages = [w.message for w in report.warnings]
    assert any("end without an end-of-turn token" in m for m in messages), report.render()
    assert report.evaluated is None
    strict = check_env(ENVS["Echo"], [*flags, "--check.evaluate", "false", "--check.strict"])
    assert not strict.ok


def test_the_check_starts_the_embedded_server_when_none_answers(tiny_model_dir: Path) -> None:
    flags = [
        "--env.tokenizer_name", str(tiny_model_dir), "--env.group_size", "2",
        "--openai.base_url", "http://127.0.0.1:9/v1", "--openai.model_name", "tiny",
        "--openai.server_type", "vllm", "--openai.api_key", "x",
        "--check.serve_model", str(tiny_model_dir), "--check.items", "1",
        "--check.eval_items", "1",
    ]  # fmt: skip
    report = check_env(ENVS["Echo"], flags)
    assert report.ok, report.render()
    assert "embedded atropos-serve" in report.server and ":9/" not in report.server
    never = check_env(ENVS["Echo"], [*flags, "--check.serve", "never"])
    assert not never.ok and never.items == 0  # nothing answers on port 9: no rollout waits
    assert "--openai.base_url http://127.0.0.1:9/v1 does not answer" in never.render()


def test_an_environment_class_passes(scripted_tools) -> None:
    serve, model = scripted_tools
    env_cls = EnvironmentClassEnv.wrap(Counter, rows=[{"prompt": "Use the counter."}] * 3)
    report = check_env(env_cls, server_flags(serve, model))
    assert report.ok, report.render()
    assert report.evaluated is not None and "eval/Counter" in report.evaluated


def _cli(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env=env, timeout=600, cwd=REPO
    )


def test_the_check_command_exits_0_or_1_with_the_report(tiny_serve, tiny_model_dir) -> None:
    script = str(REPO / "tests" / "envs" / "broken_envs.py")
    flags = server_flags(tiny_serve, tiny_model_dir)
    good = _cli([script, "Echo", "check", *flags])
    assert good.returncode == 0, good.stdout + good.stderr[-3000:]
    assert "ok: 0 error(s)" in good.stdout
    bad = _cli([script, "PromptTrained", "check", *flags, "--check.items", "1"])
    assert bad.returncode == 1, bad.stdout + bad.stderr[-3000:]
    assert "error   collect_trajectories (item 0): masks[0]: the prompt is trained on" in bad.stdout
    assert "FAILED" in bad.stdout
    usage = _cli([script, "Echo", "check", "--check.items", "0"])
    assert usage.returncode == 2 and "--check.items" in usage.stderr
    helped = _cli([script, "Echo", "--help"])
    assert "check" in helped.stdout
