"""``run-api``: serve the trajectory API (``python -m atroposlib.cli.run_api`` works too).

Flags come from :class:`~atroposlib.api.settings.ApiSettings` (each also settable as an
``ATROPOS_*`` environment variable); flags win over the environment.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, get_args

from pydantic import ValidationError

from atroposlib.api.settings import ApiSettings, parse_size

_SIZE_FIELDS = {"max_queue_bytes", "max_request_bytes", "ingest_budget_bytes"}


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """The ``run-api`` argument parser, one flag per :class:`ApiSettings` field."""
    parser = argparse.ArgumentParser(
        prog="run-api",
        allow_abbrev=False,
        description="Serve the Atropos trajectory API (environments POST scored groups, "
        "trainers GET batches).",
    )
    for name, field in ApiSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        env = f"ATROPOS_{name.upper()}"
        kwargs: dict[str, Any] = {
            "dest": name,
            "default": None,
            "help": f"{field.description} [env {env}; default: {field.default}]",
        }
        choices = get_args(field.annotation)
        if name in _SIZE_FIELDS:
            kwargs["type"] = _size_arg
            kwargs["metavar"] = "SIZE"
        elif field.annotation is int:
            kwargs["type"] = int
        elif field.annotation is bool:
            kwargs["action"] = "store_const"
            kwargs["const"] = True
        elif choices and all(isinstance(c, str) for c in choices):
            kwargs["choices"] = list(choices) + [c.lower() for c in choices if c != c.lower()]
        parser.add_argument(flag, **kwargs)
    parser.add_argument(
        "--reload", action="store_true", help="Reload on code changes (development only)."
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``run-api``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    overrides = {name: getattr(args, name) for name in ApiSettings.model_fields}
    try:
        settings = ApiSettings.from_env(**overrides)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = str(err["loc"][0]) if err["loc"] else "?"
        parser.error(f"--{name.replace('_', '-')} (or ATROPOS_{name.upper()}): {err['msg']}")

    import uvicorn

    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    log = logging.getLogger("atroposlib.api")
    log.info(
        "Trajectory API on http://%s:%d (store: %s; limits: %d sequences, %d bytes)",
        settings.host,
        settings.port,
        settings.store or "memory",
        settings.max_queue_sequences,
        settings.max_queue_bytes,
    )
    if settings.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("Binding %s: the API has no authentication.", settings.host)

    if args.reload:
        for name, value in settings.model_dump().items():
            if value is not None:
                os.environ[f"ATROPOS_{name.upper()}"] = str(value)
        uvicorn.run(
            "atroposlib.api.server:create_app_from_env",
            factory=True,
            host=settings.host,
            port=settings.port,
            reload=True,
            log_level=settings.log_level,
        )
        return

    from atroposlib.api.server import create_app

    try:
        app = create_app(settings)
    except Exception as exc:  # a store that cannot be opened is a user-facing error
        print(f"run-api: cannot start: {exc}", file=sys.stderr)
        raise SystemExit(1) from exc
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_keep_alive=30,
    )


if __name__ == "__main__":
    main()
