"""Keep CONFIG.md in step with the config models it documents.

Each documented model has a table in CONFIG.md between ``<!-- BEGIN name -->`` and
``<!-- END name -->`` markers, rendered from the same :class:`~atroposlib.utils.cli.ModelFlags`
that builds the command's flags (flag, type, default, description), so CONFIG.md and ``--help``
come from the same source.

``python -m atroposlib.cli.config_docs --write`` rewrites the tables; ``--check`` exits 1 when
CONFIG.md is out of date (the tests run it).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from atroposlib.utils.cli import FlagSpec, ModelFlags


def _sections() -> dict[str, Callable[[], str]]:
    from atroposlib.envs.config import BaseEnvConfig
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
    from atroposlib.envs.server_handling.server_manager import ServerManagerConfig

    def parser_of(module: str) -> Callable[[], str]:
        def render() -> str:
            import importlib

            return render_parser(importlib.import_module(module).build_parser())

        return render

    def api_settings() -> str:
        from atroposlib.cli.run_api import FLAGS

        return render_table(FLAGS, env=True)

    def check_options() -> str:
        from atroposlib.envs.check import CheckOptions

        return render_table(ModelFlags(CheckOptions, prefix="check."))

    return {
        "api-settings": api_settings,
        "env-config": lambda: render_table(ModelFlags(BaseEnvConfig, prefix="env.")),
        "openai-config": lambda: render_table(ModelFlags(APIServerConfig, prefix="openai.")),
        "server-manager-config": lambda: render_table(ModelFlags(ServerManagerConfig)),
        "env-check": check_options,
        "atropos-serve": parser_of("atroposlib.inference.cli"),
        "atropos-sft-gen": parser_of("atroposlib.cli.sft"),
        "atropos-dpo-gen": parser_of("atroposlib.cli.dpo"),
        "view-run": parser_of("atroposlib.cli.view_run"),
        "atropos-quickstart": parser_of("example_trainer.quickstart"),
        "atropos-grpo": parser_of("example_trainer.config"),
        "atropos-launch": parser_of("atroposlib.cli.launch"),
        "atropos-check-trainer": parser_of("atroposlib.cli.check_trainer"),
        "run-description": render_run_spec,
    }


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _names(spec: FlagSpec) -> str:
    if spec.positional:
        return f"`{spec.name.upper()}`"
    names = ", ".join(f"`{n}`" for n in spec.invocation.split(", "))
    if spec.choices:
        names += " (" + " \\| ".join(str(c) for c in spec.choices) + ")"
    if spec.repeatable:
        names += " (repeatable)"
    return names


def render_parser(parser: argparse.ArgumentParser) -> str:
    """A markdown table of an argparse parser's options (positionals first).

    Options made by :class:`~atroposlib.utils.cli.ModelFlags` show their canonical spelling,
    default and description, as ``--help`` does.
    """
    rows = ["| flag | default | description |", "|---|---|---|"]
    for action in parser._actions:  # argparse has no public accessor for its actions
        if isinstance(action, argparse._HelpAction):
            continue
        spec: FlagSpec | None = getattr(action, "spec", None)
        if spec is not None:
            default = "required" if spec.positional else f"`{spec.default}`"
            rows.append(f"| {_names(spec)} | {default} | {_cell(spec.description)} |")
            continue
        names = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest}`"
        if action.choices:
            names += " (" + " \\| ".join(str(c) for c in action.choices) + ")"
        if not action.option_strings:
            default = "required" if action.nargs is None else "optional"
        elif isinstance(action, argparse._StoreTrueAction):
            default = "off"
        elif action.default is None or action.default is argparse.SUPPRESS:
            default = "—"
        else:
            default = f"`{action.default}`"
        help_text = (action.help or "").replace("%(default)s", str(action.default))
        rows.append(f"| {names} | {default} | {_cell(help_text.replace('%%', '%'))} |")
    return "\n".join(rows)


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    text = text.replace("typing.", "").replace("NoneType", "None")
    return text.replace("|", "\\|")  # a bare | would end the markdown table cell


def render_table(flags: ModelFlags, env: bool = False) -> str:
    """A markdown table of a model's flags: flag, (environment variable,) type, default,
    description."""
    header = (
        "| flag | env var | type | default | description |"
        if env
        else ("| flag | type | default | description |")
    )
    rule = "|---|---|---|---|---|" if env else "|---|---|---|---|"
    rows = [header, rule]
    for name, spec in flags.specs.items():
        cells = [", ".join(f"`{n}`" for n in spec.invocation.split(", "))]
        if env:
            cells.append(f"`{spec.env_var}`")
        annotation = flags.model.model_fields[name].annotation
        default = repr(spec.default) if isinstance(_raw_default(flags, name), str) else spec.default
        cells += [f"`{_type_name(annotation)}`", f"`{default}`", _cell(spec.description)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def render_yaml_fields(model: type[Any], prefix: str = "") -> str:
    """A markdown table of a YAML-only model's fields: key, type, default, description."""
    from typing import get_args, get_origin

    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if field.is_required():
            default = "required"
        elif field.default_factory is not None:
            value = field.default_factory()
            default = "(see below)" if isinstance(value, BaseModel) else f"`{value}`"
        elif field.default is PydanticUndefined:
            default = "—"
        else:
            default = (
                f"`{field.default!r}`" if isinstance(field.default, str) else (f"`{field.default}`")
            )
        kind = _type_name(field.annotation)
        args = [a for a in get_args(field.annotation) if isinstance(a, type)]
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            kind = "mapping"
        elif get_origin(field.annotation) is list and args and issubclass(args[0], BaseModel):
            kind = "list of mappings"
        elif any(issubclass(a, BaseModel) for a in args):
            kind = "mapping or None"
        rows.append(
            f"| `{prefix}{name}` | `{kind}` | {default} | {_cell(field.description or '')} |"
        )
    return "\n".join(rows)


def render_run_spec() -> str:
    """The run description of ``atropos-launch``: the top level, then each section."""
    from atroposlib.launch import spec as s

    parts = [render_yaml_fields(s.RunSpec)]
    for title, model, prefix in (
        ("`api:`", s.ApiSpec, "api."),
        ("`inference:` (a list; each entry)", s.InferenceSpec, "inference[]."),
        ("`environments:` (a list; each entry)", s.EnvironmentSpec, "environments[]."),
        ("`trainer:`", s.TrainerSpec, "trainer."),
        ("`ray:`", s.RaySpec, "ray."),
        ("`slurm:`", s.SlurmSpec, "slurm."),
    ):
        parts.append(f"\n#### {title}\n\n{render_yaml_fields(model, prefix)}")
    return "\n".join(parts)


def _raw_default(flags: ModelFlags, name: str) -> Any:
    if name in flags.defaults:
        return flags.defaults[name]
    field = flags.model.model_fields[name]
    return None if field.is_required() else field.default


def update(text: str) -> str:
    """``text`` with every marked section re-rendered."""
    for name, render in _sections().items():
        pattern = re.compile(
            rf"(<!-- BEGIN {re.escape(name)} -->\n).*?(<!-- END {re.escape(name)} -->)", re.S
        )
        if not pattern.search(text):
            raise SystemExit(
                f"CONFIG.md has no <!-- BEGIN {name} --> ... <!-- END {name} --> block"
            )
        # Defaults that depend on the machine (the running interpreter) are written generically.
        table = render().replace(sys.executable, "<this python>")
        text = pattern.sub(lambda m, table=table: m.group(1) + table + "\n" + m.group(2), text)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--file", default="CONFIG.md", help="Path of CONFIG.md.")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="Rewrite the generated tables.")
    mode.add_argument("--check", action="store_true", help="Exit 1 if they are out of date.")
    args = parser.parse_args(argv)
    path = Path(args.file)
    current = path.read_text()
    fresh = update(current)
    if args.write:
        path.write_text(fresh)
    elif fresh != current:
        print(
            f"{path} is out of date: run python -m atroposlib.cli.config_docs --write",
            file=sys.stderr,
        )
        raise SystemExit(1)


if __name__ == "__main__":
    main()
