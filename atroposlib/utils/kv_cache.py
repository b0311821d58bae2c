"""The key/value cache argument of a ``transformers`` model under either of its names.

transformers 5.x renamed ``past_key_values`` (argument and output field) to ``cache`` and warns
on the old name (``FutureWarning: `past_key_values` is deprecated``); versions before the
rename only know ``past_key_values``. These helpers use whichever name the model has, so no
version prints a deprecation warning.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any


@functools.lru_cache(maxsize=64)
def _kwarg_for(forward: Any) -> str:
    try:
        parameters = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


def cache_kwarg(model: Any) -> str:
    """The name of ``model``'s key/value cache argument: ``cache`` or ``past_key_values``."""
    module = getattr(model, "_orig_mod", model)  # a torch.compile wrapper: the model inside
    return _kwarg_for(type(module).forward)


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for ``model(...)``, with the name ``model`` takes."""
    return {cache_kwarg(model): cache}


def output_cache(output: Any) -> Any:
    """The key/value cache a forward pass returned (``output.cache`` or, before the rename,
    ``output.past_key_values``)."""
    fields = list(output.keys()) if hasattr(output, "keys") else []
    if "cache" in fields:
        return output["cache"]
    if "past_key_values" in fields:
        return output["past_key_values"]
    return getattr(output, "cache", None)
