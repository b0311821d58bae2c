"""The trajectory API (``run-api``): environments POST scored groups, trainers GET batches.

``atroposlib.api.app`` (and ``atroposlib.api.server.app``) is the ASGI application configured
from ``ATROPOS_*`` environment variables; :func:`create_app` builds one from explicit settings.
"""

from typing import Any

from atroposlib.api.server import create_app
from atroposlib.api.settings import ApiSettings

__all__ = ["ApiSettings", "app", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "app":
        from atroposlib.api import server

        return server.app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
