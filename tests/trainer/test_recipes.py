"""Every quick-start recipe is accepted as written: its flags, its env settings (through the
env's own command line) and its trainer settings. A typo in a recipe would otherwise surface
only when a 25-minute run reaches that part."""

from __future__ import annotations

import importlib
import inspect

import pytest

from atroposlib.envs.base import BaseEnv
from atroposlib.envs.cli import resolve_config
from example_trainer import quickstart
from example_trainer.config import TrainingConfig
from example_trainer.recipes import RECIPES


def _env_class(env: str) -> type[BaseEnv]:
    path = quickstart.find_env_file(env)
    module = importlib.import_module(f"environments.{path.stem}")
    classes = [
        cls
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, BaseEnv) and cls.__module__ == module.__name__
    ]
    assert len(classes) == 1, f"{path}: expected one env class, found {classes}"
    return classes[0]


def _same(got: object, written: str) -> bool:
    if isinstance(got, bool):
        return got == (written.strip().lower() in {"true", "1", "yes"})
    if isinstance(got, (int, float)):
        return got == type(got)(written)
    return got == written


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_settings_reach_the_env_and_the_trainer(name: str) -> None:
    recipe = RECIPES[name]
    args = quickstart.parse_args(["--recipe", name])
    for flag, value in recipe.flags.items():
        assert getattr(args, flag) == value, flag

    env_cls = _env_class(args.env)
    argv = ["serve", *quickstart._flag_list(args.env_arg, "--env-arg")]
    env_config = resolve_config(env_cls, argv).env_config
    for pair in recipe.env_args:
        key, _, written = pair.partition("=")
        field = key.removeprefix("env.")
        assert field in type(env_config).model_fields, f"{name}: no env field {field!r}"
        assert _same(getattr(env_config, field), written), (field, getattr(env_config, field))

    overrides = quickstart._trainer_overrides(args.trainer_arg)
    config = TrainingConfig(model_name="SmolLM2-135M-Instruct", **overrides)
    for field, value in overrides.items():
        assert getattr(config, field) == value


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_command_line_flags_override_the_recipe(name: str) -> None:
    args = quickstart.parse_args(
        ["--recipe", name, "--steps", "2", "--env-arg", "env.temperature=0.25"]
    )
    assert args.steps == 2
    # the recipe's settings first, the command line's after them (the last one wins)
    assert args.env_arg == [*RECIPES[name].env_args, "env.temperature=0.25"]
    env_cls = _env_class(args.env)
    argv = ["serve", *quickstart._flag_list(args.env_arg, "--env-arg")]
    assert resolve_config(env_cls, argv).env_config.temperature == 0.25
    args = quickstart.parse_args(["--recipe", name, "--no-eval", "--trainer-arg=--kl-coef=0.1"])
    assert args.eval is False
    assert args.trainer_arg == [*RECIPES[name].trainer_args, "--kl-coef=0.1"]
    assert quickstart._trainer_overrides(args.trainer_arg)["kl_coef"] == 0.1
