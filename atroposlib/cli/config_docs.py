"""Keep CONFIG.md in step with the config models it documents.

Each documented model has a table in CONFIG.md between ``<!-- BEGIN name -->`` and
``<!-- END name -->`` markers, rendered from the model's fields (name, type, default,
description), so CONFIG.md and ``--help`` come from the same source.

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

from pydantic import BaseModel
from pydantic_core import PydanticUndefined


def _sections() -> dict[str, Callable[[], str]]:
    from atroposlib.api.settings import ApiSettings
    from atroposlib.envs.config import BaseEnvConfig
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
    from atroposlib.envs.server_handling.server_manager import ServerManagerConfig

    def parser_of(module: str) -> Callable[[], str]:
        def render() -> str:
            import importlib

            return render_parser(importlib.import_module(module).build_parser())

        return render

    return {
        "api-settings": lambda: render_table(
            ApiSettings, flag=lambda n: "--" + n.replace("_", "-"), env=True
        ),
        "env-config": lambda: render_table(BaseEnvConfig, flag=lambda n: "--env." + n),
        "openai-config": lambda: render_table(APIServerConfig, flag=lambda n: "--openai." + n),
        "server-manager-config": lambda: render_table(ServerManagerConfig, flag=lambda n: "--" + n),
        "atropos-serve": parser_of("atroposlib.inference.cli"),
        "atropos-sft-gen": parser_of("atroposlib.cli.sft"),
        "atropos-dpo-gen": parser_of("atroposlib.cli.dpo"),
        "view-run": parser_of("atroposlib.cli.view_run"),
        "atropos-quickstart": parser_of("example_trainer.quickstart"),
        "atropos-grpo": parser_of("example_trainer.config"),
    }


def render_parser(parser: argparse.ArgumentParser) -> str:
    """A markdown table of an argparse parser's options (positionals first)."""
    rows = ["| flag | default | description |", "|---|---|---|"]
    for action in parser._actions:  # argparse has no public accessor for its actions
        if isinstance(action, argparse._HelpAction):
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
        help_text = help_text.replace("%%", "%").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| {names} | {default} | {help_text} |")
    return "\n".join(rows)


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    text = text.replace("typing.", "").replace("NoneType", "None")
    return text.replace("|", "\\|")  # a bare | would end the markdown table cell


def _default(field: Any) -> str:
    if field.default is PydanticUndefined:
        return "required"
    return repr(field.default) if isinstance(field.default, str) else str(field.default)


def render_table(model: type[BaseModel], flag: Callable[[str], str], env: bool = False) -> str:
    """A markdown table of ``model``'s fields."""
    header = (
        "| flag | env var | type | default | description |"
        if env
        else ("| flag | type | default | description |")
    )
    rule = "|---|---|---|---|---|" if env else "|---|---|---|---|"
    rows = [header, rule]
    for name, field in model.model_fields.items():
        desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
        cells = [f"`{flag(name)}`"]
        if env:
            cells.append(f"`ATROPOS_{name.upper()}`")
        cells += [f"`{_type_name(field.annotation)}`", f"`{_default(field)}`", desc]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


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
