"""The env command line: precedence CLI > YAML > config_init, strict flags, clear errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from atroposlib.envs.base import BaseEnv, BaseEnvConfig
from atroposlib.envs.cli import CliError, resolve_config
from atroposlib.envs.server_handling.server_baseline import APIServerConfig, ServerBaseline
from environments.arithmetic_server import ArithmeticEnv
from tests.envs.helpers import ARITHMETIC_ENV, env_environ


class BaselineEnv(BaseEnv):
    """An env whose config_init returns a bare ServerBaseline (upstream's default)."""

    async def setup(self) -> None: ...

    async def get_next_item(self):
        return None

    async def evaluate(self, *args, **kwargs):
        return None


def test_precedence_cli_over_yaml_over_config_init(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "env:\n  group_size: 6\n  max_operand: 50\n  total_steps: 7\n"
        "openai:\n  base_url: http://yaml:1/v1\n  model_name: from-yaml\n"
        "testing: true\n"
    )
    r = resolve_config(
        ArithmeticEnv,
        ["serve", "--config", str(cfg), "--env.group_size", "8", "--openai.model_name", "cli"],
    )
    assert r.env_config.group_size == 8  # CLI beats YAML
    assert r.env_config.max_operand == 50  # YAML beats config_init
    assert r.env_config.total_steps == 7
    assert r.env_config.max_token_length == 256  # config_init beats the class default
    [server] = r.server_configs
    assert server.model_name == "cli"
    assert server.base_url == "http://yaml:1/v1"
    assert server.server_type == "vllm"  # from config_init
    assert r.manager_config.testing is True
    plain = resolve_config(ArithmeticEnv, ["serve"])
    assert plain.env_config.group_size == 4
    assert plain.server_configs[0].base_url == "http://localhost:9001/v1"


def test_process_mode_defaults_and_overrides() -> None:
    r = resolve_config(ArithmeticEnv, ["process"])
    assert r.env_config.include_messages is True
    assert r.env_config.ensure_scores_are_not_same is False
    assert r.env_config.data_path_to_save_groups == "data/arithmetic.jsonl"
    r = resolve_config(ArithmeticEnv, ["process", "--env.include_messages", "false"])
    assert r.env_config.include_messages is False


def test_bool_none_and_negative_values() -> None:
    r = resolve_config(
        ArithmeticEnv,
        ["serve", "--env.use_wandb", "--env.wandb_name", "None", "--env.max_num_workers", "-1"],
    )
    assert r.env_config.use_wandb is True
    assert r.env_config.wandb_name is None
    assert r.env_config.max_num_workers == -1
    r = resolve_config(ArithmeticEnv, ["serve", "--env.use_wandb=false", "--slurm", "false"])
    assert r.env_config.use_wandb is False
    assert r.manager_config.slurm is False


def test_wandb_name_defaults_to_class_name() -> None:
    r = resolve_config(BaselineEnv, ["serve"])
    assert r.env_config.wandb_name == "BaselineEnv"


@pytest.mark.parametrize("command", ["serve", "process", "evaluate"])
def test_openai_overrides_apply_to_a_server_baseline_in_every_mode(command: str) -> None:
    r = resolve_config(
        BaselineEnv, [command, "--openai.base_url", "http://x:5/v1", "--openai.model_name", "m"]
    )
    [server] = r.server_configs
    assert isinstance(server, APIServerConfig)
    assert (server.base_url, server.model_name) == ("http://x:5/v1", "m")
    assert isinstance(resolve_config(BaselineEnv, [command]).server_configs, ServerBaseline)


def test_yaml_server_list_and_cli_conflict(tmp_path: Path) -> None:
    cfg = tmp_path / "multi.yaml"
    cfg.write_text(
        "openai:\n  - base_url: http://a:1/v1\n    model_name: a\n"
        "  - base_url: http://b:2/v1\n    model_name: b\n"
    )
    r = resolve_config(ArithmeticEnv, ["serve", "--config", str(cfg)])
    assert [s.model_name for s in r.server_configs] == ["a", "b"]
    with pytest.raises(CliError, match="not supported when multiple servers"):
        resolve_config(ArithmeticEnv, ["serve", "--config", str(cfg), "--openai.model_name", "x"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["serve", "--env.gruop_size", "3"],
            "unknown flag --env.gruop_size (did you mean --env.group_size?)",
        ),
        (["serve", "--opneai.base_url", "x"], "unknown flag --opneai.base_url"),
        (
            ["serve", "--env.group_size", "abc"],
            "--env.group_size 'abc': Input should be a valid integer",
        ),
        (
            ["serve", "--env.group_size", "0"],
            "--env.group_size '0': Input should be greater than or equal to 1",
        ),
        # 0 or less would silently disable the length limit: refused, naming the flag
        (
            ["serve", "--env.max_token_length", "0"],
            "--env.max_token_length '0': Input should be greater than 0",
        ),
        (
            ["process", "--env.max_token_length", "-1"],
            "--env.max_token_length '-1': Input should be greater than 0",
        ),
        (["serve", "--env.eval_handling", "SOMETIMES"], "--env.eval_handling 'SOMETIMES'"),
        (["serve", "--env.reasoning_effort", "max"], "--env.reasoning_effort 'max'"),
        (["serve", "--openai.server_type", "tgi"], "--openai.server_type"),
        (["serve", "--config", "/nonexistent.yaml"], "--config: no such file"),
        ([], "choose a command"),
    ],
)
def test_errors_name_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(CliError) as info:
        resolve_config(ArithmeticEnv, argv)
    assert message in info.value.message


def test_yaml_errors_name_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("env:\n  group_sise: 3\n")
    with pytest.raises(
        CliError, match=r"unknown key 'env.group_sise' \(did you mean group_size\?\)"
    ):
        resolve_config(ArithmeticEnv, ["serve", "--config", str(cfg)])
    cfg.write_text("env:\n  group_size: many\n")
    with pytest.raises(
        CliError, match=rf"env.group_size in {cfg}: Input should be a valid integer"
    ):
        resolve_config(ArithmeticEnv, ["serve", "--config", str(cfg)])


def test_help_lists_every_field_with_description_and_default() -> None:
    out = subprocess.run(
        [sys.executable, str(ARITHMETIC_ENV), "serve", "--help"],
        capture_output=True,
        text=True,
        env=env_environ(),
        timeout=60,
    )
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for field in BaseEnvConfig.model_fields:
        assert f"--env.{field}" in text
    for field in APIServerConfig.model_fields:
        assert f"--openai.{field}" in text
    assert "--slurm" in text and "--testing" in text and "--config" in text
    assert "How many responses are grouped together for scoring (default: 4)" in text
    assert "Operands are drawn from 0..max_operand (default: 20)" in text
    assert "(default: http://localhost:9001/v1)" in text


def test_unknown_flag_exits_2_naming_it() -> None:
    out = subprocess.run(
        [sys.executable, str(ARITHMETIC_ENV), "serve", "--env.max_tokne_length", "5"],
        capture_output=True,
        text=True,
        env=env_environ(),
        timeout=60,
    )
    assert out.returncode == 2
    assert (
        "error: unknown flag --env.max_tokne_length (did you mean --env.max_token_length?)"
        in out.stderr
    )
