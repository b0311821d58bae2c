"""Helpers for namespaced command lines (``--env.group_size 8``) and layered configs.

Upstream's names are kept (``get_prefixed_pydantic_model``, ``merge_dicts``,
``extract_namespace``, ``adjust_model_defaults``, ``get_double_dash_flags``) so code that
imported them keeps working. ``atroposlib.envs.cli`` builds the environment CLI on them.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, Field, create_model

__all__ = [
    "adjust_model_defaults",
    "extract_namespace",
    "get_double_dash_flags",
    "get_prefixed_pydantic_model",
    "merge_dicts",
]


def get_prefixed_pydantic_model(base_model: type[BaseModel], prefix: str) -> type[BaseModel]:
    """A model with every field of ``base_model`` renamed ``{prefix}{name}``, keeping each
    field's type, default (or default factory) and description."""
    fields: dict[str, Any] = {}
    for name, field in base_model.model_fields.items():
        kwargs: dict[str, Any] = {}
        if field.description is not None:
            kwargs["description"] = field.description
        if field.default_factory is not None:
            kwargs["default_factory"] = field.default_factory
        else:
            kwargs["default"] = field.default
        fields[f"{prefix}{name}"] = (field.annotation, Field(**kwargs))
    return create_model(f"{prefix.capitalize()}{base_model.__name__}", **fields)


def merge_dicts(*dicts: Mapping[str, Any]) -> dict[str, Any]:
    """Merge dicts left to right (later ones win); nested dicts are merged recursively.

    The inputs are not modified.
    """
    if not dicts:
        return {}
    result = dict(dicts[0])
    for current in dicts[1:]:
        for key, value in current.items():
            if isinstance(result.get(key), Mapping) and isinstance(value, Mapping):
                result[key] = merge_dicts(result[key], value)
            else:
                result[key] = value
    return result


def extract_namespace(model: Any, prefix: str) -> dict[str, Any]:
    """The entries of ``model`` (a dict, or an object with ``model_dump()``/``to_dict()``)
    whose keys start with ``prefix``, with the prefix stripped."""
    if isinstance(model, Mapping):
        data = model
    elif hasattr(model, "model_dump"):
        data = model.model_dump()
    elif hasattr(model, "to_dict"):
        data = model.to_dict()
    else:
        raise TypeError("Model must have model_dump(), to_dict(), or be a dict.")
    return {k[len(prefix) :]: v for k, v in data.items() if k.startswith(prefix)}


def adjust_model_defaults(
    model_class: type[BaseModel], defaults: Mapping[str, Any] | BaseModel
) -> type[BaseModel]:
    """A subclass ``{Name}WithDefaults`` of ``model_class`` whose fields named in ``defaults``
    get new defaults (descriptions kept; a None default keeps an existing default factory)."""
    values = defaults.model_dump() if isinstance(defaults, BaseModel) else dict(defaults)
    overridden: dict[str, Any] = {}
    for name, info in model_class.model_fields.items():
        if name not in values:
            continue
        kwargs: dict[str, Any] = {}
        if info.description is not None:
            kwargs["description"] = info.description
        if info.default_factory is not None and values[name] is None:
            kwargs["default_factory"] = info.default_factory
        else:
            kwargs["default"] = values[name]
        overridden[name] = (info.annotation, Field(**kwargs))
    return create_model(f"{model_class.__name__}WithDefaults", __base__=model_class, **overridden)


def get_double_dash_flags(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``--key=value`` / ``--key value`` / bare ``--key`` (True) flags of ``argv``
    (default ``sys.argv[1:]``) as a dict of strings; the literal ``None`` becomes None.

    A value may start with ``-`` only in the ``--key=value`` form (``--env.x=-1``); in the
    two-word form a next word starting with ``-`` other than a negative number makes the flag
    bare, as upstream did.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    flags: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            i += 1
            continue
        body = arg[2:]
        if "=" in body:
            key, value = body.split("=", 1)
            if key:
                flags[key] = None if value == "None" else value
            i += 1
        elif i + 1 < len(args) and not _looks_like_flag(args[i + 1]):
            flags[body] = None if args[i + 1] == "None" else args[i + 1]
            i += 2
        else:
            flags[body] = True
            i += 1
    return flags


def _looks_like_flag(word: str) -> bool:
    if not word.startswith("-"):
        return False
    try:
        float(word)
    except ValueError:
        return True
    return False
