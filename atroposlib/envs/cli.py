"""The environment command line: ``python env.py serve|process|evaluate``.

Every setting is a flag generated from the config models by
:class:`atroposlib.utils.cli.ModelFlags` (the flag style of every atroposlib command), with its
description and default in ``--help``:

* ``--env.<field>``: the env's config class (``BaseEnvConfig`` or the subclass ``config_init``
  returns);
* ``--openai.<field>``: ``APIServerConfig`` (one inference server; several go in YAML as a
  list under ``openai:``);
* ``--slurm``, ``--testing``, ``--max-n-completions``, ``--proxy-url``: ``ServerManagerConfig``
  (``--max_n_completions``, ``--proxy_url`` work too);
* ``--config file.yaml``: ``env: {...}``, ``openai: {...} | [{...}, ...]`` and the server
  manager keys at the top level.

Namespaced flags spell the field as YAML does (``--env.group_size``; ``--env.group-size`` is
accepted). Booleans take ``--env.use_wandb``, ``--no-env.use_wandb`` or ``--env.use_wandb false``.

Precedence: command line > YAML > ``config_init()`` (> the mode's base overrides for
``process`` / ``evaluate``). Unknown flags and unknown YAML keys are errors naming them (with
a suggestion); values are validated by the pydantic models and a bad one is reported with the
flag or YAML key it came from. Errors exit with code 2.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import difflib
import inspect
import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from atroposlib.envs.constants import ENV_NAMESPACE, NAMESPACE_SEP, OPENAI_NAMESPACE
from atroposlib.envs.options import ENV_INIT_EXTRAS, SERVER_MANAGER_OPTIONS
from atroposlib.envs.server_handling.openai_server import (
    ServerConfigError,
    resolve_openai_configs,
)
from atroposlib.envs.server_handling.server_baseline import APIServerConfig, ServerBaseline
from atroposlib.envs.server_handling.server_manager import ServerManagerConfig
from atroposlib.utils.cli import FlagError, ModelArgumentParser, ModelFlags, merge_dicts

logger = logging.getLogger(__name__)

__all__ = [
    "CliError",
    "ResolvedConfig",
    "build_parser",
    "model_flags",
    "resolve_config",
    "run_cli",
]

COMMANDS = {
    "serve": "Run the env against a trajectory API (run-api) and a trainer.",
    "process": "Roll out groups offline (no API, no trainer) into JSONL + HTML.",
    "evaluate": "Run the env's evaluate() once and write metrics.json / samples.jsonl.",
    "check": "Check the env keeps the contract: a few items and evaluate() against a real "
    "server (the embedded atropos-serve by default); exit 1 on any error.",
}
ENV_PREFIX = f"{ENV_NAMESPACE}{NAMESPACE_SEP}"
OPENAI_PREFIX = f"{OPENAI_NAMESPACE}{NAMESPACE_SEP}"
MANAGER_KEYS = tuple(ServerManagerConfig.model_fields)
#: Key of the un-prefixed ``ServerManagerConfig`` flags in :func:`model_flags`.
MANAGER = "manager"
#: Key (and flag prefix) of the ``check`` command's own options (``--check.*``).
CHECK = "check"


class CliError(Exception):
    """A command-line or config-file problem; reported as ``error: <message>``."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


@dataclass
class ResolvedConfig:
    """Everything a subcommand runs with, after merging defaults, YAML and flags."""

    command: str
    env_config: BaseModel
    server_configs: ServerBaseline | list[APIServerConfig]
    manager_config: ServerManagerConfig
    yaml_config: dict[str, Any]
    # More constructor arguments (``teacher_server_configs`` of a TeacherDistillationEnv).
    extra_env_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The command's own options (``check``: ``CheckOptions``), None for the others.
    command_options: Any = None


# ---------------------------------------------------------------------------- parser


def _teacher_namespace(env_cls: type) -> str | None:
    """``teacher`` for envs with a teacher server (``TeacherDistillationEnv``), else None."""
    if hasattr(env_cls, "teacher_config_init") and hasattr(
        env_cls, "_resolve_teacher_server_configs"
    ):
        return getattr(env_cls, "teacher_namespace", None)
    return None


def _default_openai(default_servers: Any) -> tuple[type[BaseModel], dict[str, Any]]:
    """The model class and defaults shown for ``--openai.*``."""
    if isinstance(default_servers, list) and default_servers:
        first = default_servers[0]
        if isinstance(first, APIServerConfig):
            return type(first), first.model_dump() if len(default_servers) == 1 else {}
    if isinstance(default_servers, APIServerConfig):
        return type(default_servers), default_servers.model_dump()
    if isinstance(default_servers, ServerBaseline):
        return APIServerConfig, default_servers.model_dump()
    return APIServerConfig, {}


def _mode_env_defaults(env_cls: type, command: str, base: dict[str, Any]) -> dict[str, Any]:
    """The env defaults of ``command``: ``config_init``'s, with the mode's base overrides."""
    out = dict(base)
    if out.get("wandb_name") is None:
        out["wandb_name"] = env_cls.name or env_cls.__name__
    if command == "check":  # flat groups are reported, not dropped; nothing is written
        out["ensure_scores_are_not_same"] = False
        out["include_messages"] = True
        out["use_wandb"] = False
        out["data_path_to_save_groups"] = None
    elif command == "process":
        out["ensure_scores_are_not_same"] = False
        out["include_messages"] = True
        if out.get("data_path_to_save_groups") is None:
            out["data_path_to_save_groups"] = f"data/{env_cls.name or 'groups'}.jsonl"
        out["use_wandb"] = True
    elif command == "evaluate":
        out["use_wandb"] = True
    return out


def model_flags(
    env_cls: type, command: str, defaults: tuple[Any, Any] | None = None
) -> dict[str, ModelFlags]:
    """The flag namespaces of ``command``: ``env`` (``--env.*``), ``openai`` (``--openai.*``),
    ``teacher`` (``--teacher.*``, for envs with a teacher server) and ``manager`` (un-prefixed
    ``ServerManagerConfig`` flags), with the defaults ``--help`` shows."""
    default_env, default_servers = defaults or env_cls.config_init()
    openai_cls, openai_defaults = _default_openai(default_servers)
    flags = {
        ENV_NAMESPACE: ModelFlags(
            type(default_env),
            prefix=ENV_PREFIX,
            defaults=_mode_env_defaults(env_cls, command, default_env.model_dump()),
        ),
        OPENAI_NAMESPACE: ModelFlags(openai_cls, prefix=OPENAI_PREFIX, defaults=openai_defaults),
    }
    teacher = _teacher_namespace(env_cls)
    if teacher is not None:
        teacher_cls, teacher_defaults = _default_openai(env_cls.teacher_config_init())
        flags[teacher] = ModelFlags(
            teacher_cls, prefix=f"{teacher}{NAMESPACE_SEP}", defaults=teacher_defaults
        )
    flags[MANAGER] = ModelFlags(ServerManagerConfig)
    if command == CHECK:
        from atroposlib.envs.check import CheckOptions

        flags[CHECK] = ModelFlags(CheckOptions, prefix=f"{CHECK}{NAMESPACE_SEP}")
    return flags


def build_parser(env_cls: type, defaults: tuple[Any, Any] | None = None) -> argparse.ArgumentParser:
    """The argparse parser of ``env_cls.cli()`` (subcommands ``serve``, ``process``,
    ``evaluate``); every flag's help shows its description and default."""
    defaults = defaults or env_cls.config_init()
    parser = ModelArgumentParser(
        prog=Path(sys.argv[0]).name if sys.argv and sys.argv[0] else env_cls.__name__,
        description=f"CLI for {env_cls.__name__}. Precedence: flags > --config YAML > "
        "config_init() defaults.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    titles = {
        ENV_NAMESPACE: "environment (--env.*)",
        OPENAI_NAMESPACE: "inference server (--openai.*)",
        MANAGER: "server manager",
        CHECK: "the check (--check.*)",
    }
    for command, help_text in COMMANDS.items():
        cmd = sub.add_parser(
            command,
            help=help_text,
            description=help_text,
            usage="%(prog)s [--config FILE.yaml] [--env.FIELD VALUE ...] "
            "[--openai.FIELD VALUE ...] [--slurm] [--testing]",
        )
        cmd.add_argument(
            "--config",
            default=argparse.SUPPRESS,
            metavar="FILE.yaml",
            help="Path to .yaml config file (env:, openai:, slurm:, testing:). CLI args "
            "override this.",
        )
        for namespace, flags in model_flags(env_cls, command, defaults).items():
            title = titles.get(namespace, f"teacher server (--{namespace}.*)")
            flags.add_to(cmd.add_argument_group(title))
    return parser


# ---------------------------------------------------------------------------- values


def _suggest(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _load_yaml(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise CliError(f"--config: no such file: {path}")
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise CliError(f"--config {path}: invalid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise CliError(
            f"--config {path}: the top level must be a mapping, got {type(data).__name__}"
        )
    return data


def _check_yaml_keys(
    data: Mapping[str, Any],
    path: str,
    env_model: type[BaseModel],
    openai_model: type[BaseModel],
    extra_top: Sequence[str] = (),
) -> None:
    top = (ENV_NAMESPACE, OPENAI_NAMESPACE, *MANAGER_KEYS, *extra_top)
    for key in data:
        if key not in top:
            logger.warning(
                "%s: ignoring unknown top-level key %r%s", path, key, _suggest(str(key), top)
            )
    env_section = data.get(ENV_NAMESPACE) or {}
    if not isinstance(env_section, dict):
        raise CliError(f"{path}: '{ENV_NAMESPACE}' must be a mapping")
    for key in env_section:
        if key not in env_model.model_fields:
            raise CliError(
                f"{path}: unknown key '{ENV_NAMESPACE}.{key}'"
                f"{_suggest(str(key), list(env_model.model_fields))}"
            )
    servers = data.get(OPENAI_NAMESPACE) or {}
    sections = servers if isinstance(servers, list) else [servers]
    for i, section in enumerate(sections):
        where = f"{OPENAI_NAMESPACE}[{i}]" if isinstance(servers, list) else OPENAI_NAMESPACE
        if not isinstance(section, dict):
            raise CliError(f"{path}: '{where}' must be a mapping")
        for key in section:
            if key not in openai_model.model_fields:
                raise CliError(
                    f"{path}: unknown key '{where}.{key}'"
                    f"{_suggest(str(key), list(openai_model.model_fields))}"
                )


# ---------------------------------------------------------------------------- resolution


def resolve_config(env_cls: type, argv: Sequence[str]) -> ResolvedConfig:
    """Parse ``argv`` (without the program name) into the configs a subcommand runs with.

    Raises:
        CliError: Unknown flags, unreadable YAML, unknown YAML keys, invalid values.
        SystemExit: ``--help`` (code 0) or an argparse usage error (code 2).
    """
    default_env, default_servers = env_cls.config_init()
    parser = build_parser(env_cls, (default_env, default_servers))
    args, unknown = parser.parse_known_args(list(argv))
    if args.command is None:
        parser.print_help(sys.stderr)
        raise CliError(f"choose a command: {', '.join(COMMANDS)}")
    if unknown:
        sub = parser._subparsers._group_actions[0].choices[args.command]  # type: ignore[union-attr]
        known = [opt for action in sub._actions for opt in action.option_strings]
        bad = unknown[0]
        flag = bad.split("=", 1)[0]
        if flag.startswith("-"):
            raise CliError(f"unknown flag {flag}{_suggest(flag, known)}")
        raise CliError(f"unexpected argument {bad!r}")
    flags = model_flags(env_cls, args.command, (default_env, default_servers))
    yaml_path = getattr(args, "config", None)
    yaml_config = _load_yaml(yaml_path) if yaml_path else {}
    openai_cls, openai_defaults = _default_openai(default_servers)
    teacher = _teacher_namespace(env_cls)
    _check_yaml_keys(
        yaml_config, yaml_path or "", type(default_env), openai_cls, (teacher,) if teacher else ()
    )

    def validated(namespace: str, data: dict[str, Any], section: Mapping[str, Any]) -> Any:
        ns_flags = flags[namespace]
        try:
            return ns_flags.validate(
                data, given=ns_flags.given(args), config=section, config_path=yaml_path
            )
        except FlagError as exc:
            raise CliError(exc.message) from None

    # env: config_init (+ mode overrides) < YAML < CLI
    yaml_env = yaml_config.get(ENV_NAMESPACE) or {}
    env_dict = merge_dicts(
        _mode_env_defaults(env_cls, args.command, default_env.model_dump()),
        yaml_env,
        flags[ENV_NAMESPACE].values(args),
    )
    env_config = validated(ENV_NAMESPACE, env_dict, yaml_env)

    # openai: config_init < YAML < CLI, then upstream's single/multi-server resolution
    openai_values = flags[OPENAI_NAMESPACE].values(args)
    cli_openai = {f"{OPENAI_PREFIX}{k}": v for k, v in openai_values.items()}
    yaml_openai = yaml_config.get(OPENAI_NAMESPACE) or {}
    single_yaml = (
        yaml_openai[0] if isinstance(yaml_openai, list) and len(yaml_openai) == 1 else yaml_openai
    )
    yaml_single = single_yaml if isinstance(single_yaml, dict) else {}
    openai_dict = merge_dicts(openai_defaults, yaml_single, openai_values)
    if cli_openai or yaml_single:
        validated(OPENAI_NAMESPACE, openai_dict, yaml_single)
    if isinstance(yaml_openai, list) and len(yaml_openai) > 1:
        for i, section in enumerate(yaml_openai):
            server_flags = ModelFlags(APIServerConfig, prefix=f"{OPENAI_NAMESPACE}[{i}].")
            try:
                server_flags.validate(section, config=section, config_path=yaml_path)
            except FlagError as exc:
                raise CliError(exc.message) from None
    try:
        server_configs = resolve_openai_configs(
            default_server_configs=default_servers,
            openai_config_dict=openai_dict,
            yaml_config=yaml_config,
            cli_passed_flags=cli_openai,
            logger=logger,
        )
    except ServerConfigError as exc:
        raise CliError(exc.message, exit_code=exc.exit_code) from None

    # server manager: defaults < YAML top level < CLI
    yaml_manager = {k: yaml_config[k] for k in MANAGER_KEYS if k in yaml_config}
    manager_dict = merge_dicts(
        ServerManagerConfig().model_dump(), yaml_manager, flags[MANAGER].values(args)
    )
    manager_config = validated(MANAGER, manager_dict, yaml_manager)

    extra: dict[str, Any] = {}
    if teacher is not None:
        teacher_prefix = f"{teacher}{NAMESPACE_SEP}"
        try:
            teacher_configs = env_cls._resolve_teacher_server_configs(
                default_teacher_server_configs=env_cls.teacher_config_init(),
                yaml_config=yaml_config,
                cli_passed_flags={
                    f"{teacher_prefix}{k}": v for k, v in flags[teacher].values(args).items()
                },
            )
        except ServerConfigError as exc:
            raise CliError(f"{teacher}: {exc.message}", exit_code=exc.exit_code) from None
        if teacher_configs is not None:
            extra["teacher_server_configs"] = teacher_configs
    options = None
    if args.command == CHECK:
        options = validated(CHECK, flags[CHECK].values(args), {})
    return ResolvedConfig(
        args.command, env_config, server_configs, manager_config, yaml_config, extra, options
    )


def _dump_evaluate_config(resolved: ResolvedConfig, directory: str) -> Path:
    servers = resolved.server_configs
    if isinstance(servers, list):
        openai: Any = [s.model_dump(mode="json") for s in servers]
    elif isinstance(servers, APIServerConfig):
        openai = servers.model_dump(mode="json")
    else:
        openai = {}
    data = {
        ENV_NAMESPACE: resolved.env_config.model_dump(mode="json"),
        OPENAI_NAMESPACE: openai,
        "slurm": resolved.manager_config.slurm,
        "testing": resolved.manager_config.testing,
    }
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "evaluate_config.yaml"
    path.write_text(yaml.safe_dump(data, default_flow_style=False, sort_keys=False))
    return path


def _warn_local(servers: Any, command: str) -> None:
    configs = servers if isinstance(servers, list) else [servers]
    for cfg in configs:
        url = getattr(cfg, "base_url", None) or ""
        if any(h in url for h in ("localhost", "0.0.0.0", "127.0.0.1")):
            logger.warning(
                "Using a local base_url (%s) in '%s' mode: make sure a server is running there.",
                url,
                command,
            )
            return


def build_env(env_cls: type, resolved: ResolvedConfig) -> Any:
    """Construct the env from ``resolved`` (ServerManager options passed through)."""
    token = SERVER_MANAGER_OPTIONS.set(
        {
            "max_n_completions": resolved.manager_config.max_n_completions,
            "proxy_url": resolved.manager_config.proxy_url,
        }
    )
    # Extra arguments the class's own ``__init__`` does not take (an env listed before
    # TeacherDistillationEnv among its bases, as upstream's gsm8k_server_teacher_distill.py,
    # has GSM8kEnv's four-argument ``__init__``) reach the mixin's ``__init__`` through
    # ``ENV_INIT_EXTRAS`` instead of a TypeError.
    passed, extras = _split_init_kwargs(env_cls, resolved.extra_env_kwargs)
    extras_token = ENV_INIT_EXTRAS.set(extras)
    try:
        return env_cls(
            config=resolved.env_config,
            server_configs=resolved.server_configs,
            slurm=resolved.manager_config.slurm,
            testing=resolved.manager_config.testing,
            **passed,
        )
    finally:
        ENV_INIT_EXTRAS.reset(extras_token)
        SERVER_MANAGER_OPTIONS.reset(token)


def _split_init_kwargs(
    env_cls: type, kwargs: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``kwargs`` split into those ``env_cls.__init__`` accepts by name and the rest."""
    try:
        params = inspect.signature(env_cls.__init__).parameters
    except (TypeError, ValueError):
        return dict(kwargs), {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs), {}
    passed = {k: v for k, v in kwargs.items() if k in params}
    return passed, {k: v for k, v in kwargs.items() if k not in params}


def run_cli(env_cls: type, argv: Sequence[str] | None = None) -> int:
    """Run ``env_cls``'s command line; the process exit code (0 success, 2 usage error,
    1 failure, 130 interrupted)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        # httpx logs every request at INFO: one line per /health poll and per batch sent
        # would bury what the env itself reports.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        resolved = resolve_config(env_cls, argv)
    except CliError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exc.exit_code
    if resolved.command == CHECK:
        from atroposlib.envs.check import run_check

        report = run_check(env_cls, resolved, resolved.command_options)
        print(report.render())
        return 0 if report.ok else 1
    from rich.console import Console

    console = Console(stderr=True)
    console.print(resolved.env_config)
    console.print(resolved.server_configs)
    if resolved.command != "serve":
        _warn_local(resolved.server_configs, resolved.command)
    if resolved.command == "evaluate" and resolved.env_config.data_dir_to_save_evals:
        path = _dump_evaluate_config(resolved, resolved.env_config.data_dir_to_save_evals)
        logger.info("Dumped evaluate config to %s", path)
    env = build_env(env_cls, resolved)
    if resolved.command == "serve":
        coro = env.env_manager()
    elif resolved.command == "process":
        env.n_groups_to_process = resolved.env_config.total_steps
        env.group_size_to_process = resolved.env_config.group_size
        coro = env.process_manager()
    else:
        coro = env._run_evaluate()
    try:
        asyncio.run(coro)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
