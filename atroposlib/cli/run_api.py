"""``run-api``: serve the trajectory API (``python -m atroposlib.cli.run_api`` works too).

Flags come from :class:`~atroposlib.api.settings.ApiSettings` (each also settable as an
``ATROPOS_*`` environment variable); flags win over the environment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from types import FrameType

from pydantic import BaseModel, Field, ValidationError

from atroposlib.api.settings import ENV_PREFIX, ApiSettings
from atroposlib.utils.cli import ModelArgumentParser, ModelFlags
from atroposlib.utils.http_security import is_loopback

FLAGS = ModelFlags(ApiSettings, env_prefix=ENV_PREFIX)


class DevOptions(BaseModel):
    """``run-api``'s options that are not server settings."""

    reload: bool = Field(False, description="Reload on code changes (development only).")


DEV_FLAGS = ModelFlags(DevOptions)


def build_parser() -> ModelArgumentParser:
    """The ``run-api`` argument parser: one flag per :class:`ApiSettings` field."""
    parser = ModelArgumentParser(
        prog="run-api",
        allow_abbrev=False,
        description="Serve the Atropos trajectory API (environments POST scored groups, "
        "trainers GET batches).",
    )
    FLAGS.add_to(parser)
    DEV_FLAGS.add_to(parser)
    return parser


def parse_settings(
    argv: Sequence[str] | None = None, environ: dict[str, str] | None = None
) -> tuple[ApiSettings, DevOptions]:
    """The settings ``run-api`` serves with: ``ATROPOS_*`` variables, then flags. A bad value
    exits with code 2, naming the flag or the variable."""
    parser = build_parser()
    args = parser.parse_args(argv)
    environ = dict(os.environ if environ is None else environ)
    try:
        settings = ApiSettings.from_env(environ, **FLAGS.values(args))
    except ValidationError as exc:
        from_env = {n: environ[f"{ENV_PREFIX}{n.upper()}"] for n in ApiSettings.model_fields
                    if environ.get(f"{ENV_PREFIX}{n.upper()}", "") != ""}  # fmt: skip
        given = FLAGS.given(args)
        for values in (given, from_env):  # error messages quote values: never the key
            if "api_key" in values:
                values["api_key"] = "<hidden>"
        parser.error(
            FLAGS.describe(
                exc,
                given,
                from_env,
                config_path="the environment",
                config_key=lambda name: f"{ENV_PREFIX}{name.upper()}",
            )
        )
    dev = DEV_FLAGS.build(args)
    assert isinstance(dev, DevOptions)
    return settings, dev


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``run-api``."""
    settings, dev = parse_settings(argv)

    import uvicorn

    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    log = logging.getLogger("atroposlib.api")
    where = settings.store or "memory"
    if settings.replay:
        where = f"replaying {settings.replay} ({settings.replay_mode})"
    elif settings.record:
        where += ", recording batches"
    log.info(
        "Trajectory API on http://%s:%d (store: %s; limits: %d sequences, %d bytes; %s)",
        settings.host,
        settings.port,
        where,
        settings.max_queue_sequences,
        settings.max_queue_bytes,
        "API key required" if settings.api_key else "no API key",
    )
    if not settings.api_key and not is_loopback(settings.host):
        log.warning(
            "Binding %s: the API has no authentication; anyone who can reach this port can "
            "read batches and post data. Set a shared key with --api-key or %sAPI_KEY (every "
            "client sends %sAPI_KEY from its environment).",
            settings.host,
            ENV_PREFIX,
            ENV_PREFIX,
        )

    if dev.reload:
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
    waiters = app.state.api.waiters

    class Server(uvicorn.Server):
        """uvicorn's server, which also answers long-polled ``/batch`` requests at once when
        it is told to stop (uvicorn waits for requests in progress: up to 30 s otherwise)."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            waiters.close()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_keep_alive=30,
    )
    server = Server(config)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:
        raise SystemExit(3)  # uvicorn.run's exit status when the server could not start


if __name__ == "__main__":
    main()
