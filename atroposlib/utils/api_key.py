"""The shared key of ``run-api --api-key``, seen from the clients' side.

Every client of the trajectory API (environments, the example trainer, ``atropos-sft-gen`` /
``atropos-dpo-gen``, ``view-run``) sends the key from the ``ATROPOS_API_KEY`` environment
variable unless it is given one explicitly, so setting that variable for every process of a run
(as ``run-api`` reads it too) is all a run needs. The key travels as
``Authorization: Bearer KEY``; ``run-api`` also accepts ``X-API-Key: KEY``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["API_KEY_ENV", "api_key_headers", "resolve_api_key"]

#: The environment variable that holds the key (``run-api`` reads it as its ``--api-key``).
API_KEY_ENV = "ATROPOS_API_KEY"


def resolve_api_key(
    api_key: str | None = None, environ: Mapping[str, str] | None = None
) -> str | None:
    """The key a client sends: ``api_key`` when given (``""`` means none), else
    ``ATROPOS_API_KEY`` from ``environ`` (default ``os.environ``); surrounding whitespace is
    dropped, and an empty key is no key."""
    if api_key is None:
        api_key = (os.environ if environ is None else environ).get(API_KEY_ENV, "")
    return api_key.strip() or None


def api_key_headers(api_key: str | None) -> dict[str, str]:
    """The headers that carry ``api_key`` (none for no key).

    Raises:
        ValueError: The key has characters an HTTP header cannot carry (the key is not shown).
    """
    if not api_key:
        return {}
    if not api_key.isascii() or not api_key.isprintable():
        raise ValueError(
            f"the API key ({API_KEY_ENV}) must be printable ASCII: HTTP headers cannot carry "
            "other characters"
        )
    return {"Authorization": f"Bearer {api_key}"}
