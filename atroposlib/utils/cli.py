"""Command lines from pydantic models: one flag style for every atroposlib command.

Every command (``run-api``, ``atropos-serve``, ``atropos-sft-gen``/``atropos-dpo-gen``,
``view-run``, ``atropos-grpo``, ``atropos-quickstart`` and the environment CLI
``serve|process|evaluate``) declares its options as a pydantic model and gets its flags, its
``--help`` text, CONFIG.md's tables and its error messages from :class:`ModelFlags`:

* **names**: one flag per field. A plain flag is the field name in kebab-case
  (``--max-token-len``, canonical) and the snake_case spelling (``--max_token_len``) is accepted
  too. A namespaced flag (``--env.group_size``, ``--openai.base_url``, ``--teacher.*``) is a
  config path: it spells the field as in Python and YAML (canonical), and the kebab-case
  spelling (``--env.group-size``) is accepted too. A field's ``validation_alias`` choices
  (upstream's old names) are flags as well.
* **booleans**: ``--flag`` (true), ``--no-flag`` (false), ``--flag true|false`` and
  ``--flag=false`` (also yes/no, on/off, 1/0).
* **lists**: ``--flag a b c`` or a JSON list ``--flag '["a", "b"]'``; dicts as JSON.
  ``None`` is null for fields that accept null.
* **repeatable flags**: a list field marked ``json_schema_extra=REPEATABLE`` takes one value per
  occurrence (``--env-arg a=1 --env-arg b=2``), kept as written; a value that starts with ``-``
  is given as ``--flag=--value``. The values given add to those of the layers below the command
  line (``base``, a config file), as argparse's ``append`` adds to its default.
* **help**: ``<description> (default: <value>)``, plus ``; env <VAR>`` where an environment
  variable sets the field too, and ``repeatable;`` before the default of a repeatable flag.
  Only the canonical spelling is shown; unambiguous abbreviations are accepted (argparse's),
  also where both spellings of one flag start with them.
* **errors**: a bad value is reported as ``--flag 'value': <what is wrong>`` (or as
  ``key in file.yaml: ...`` when it came from a config file) and the command exits with code 2.

Values are validated by the model itself (one source of truth); argparse only collects strings.

``merge_dicts`` and ``extract_namespace`` (upstream's helpers for layering YAML and CLI values)
are kept: the env CLI and ``TeacherDistillationEnv`` use them.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ValidationError

__all__ = [
    "BOOL_WORDS",
    "FlagError",
    "FlagSpec",
    "ModelArgumentParser",
    "ModelFlags",
    "ModelHelpFormatter",
    "REPEATABLE",
    "extract_namespace",
    "merge_dicts",
    "parse_model",
]

#: Words a boolean flag accepts as its value (pydantic's own boolean spellings).
BOOL_WORDS = frozenset(
    ["true", "false", "yes", "no", "on", "off", "1", "0", "t", "f", "y", "n", "none"]
)


#: ``Field(json_schema_extra=REPEATABLE)`` makes a list field a repeatable flag (one value per
#: occurrence, added to the values of the layers below the command line).
REPEATABLE: dict[str, Any] = {"repeatable": True}


class FlagError(ValueError):
    """A value given for a flag (or a config key) that the model refuses."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


# ----------------------------------------------------------------------------- upstream helpers


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


# ----------------------------------------------------------------------------- field kinds


def _strip_optional(annotation: Any) -> tuple[Any, bool]:
    """(the annotation without ``None``, whether it accepted None)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        nullable = len(args) != len(typing.get_args(annotation))
        if len(args) == 1:
            return args[0], nullable
        return annotation, nullable
    return annotation, annotation is type(None) or annotation is Any


def _is_repeatable(info: Any) -> bool:
    extra = info.json_schema_extra
    return isinstance(extra, Mapping) and bool(extra.get("repeatable"))


def _kind(annotation: Any, repeatable: bool = False) -> str:
    """``bool``, ``list``, ``append`` (a repeatable list flag), ``str`` (kept as given) or
    ``value`` (JSON lists/dicts parsed)."""
    inner, _ = _strip_optional(annotation)
    is_list = typing.get_origin(inner) in (list, tuple, set, frozenset) or inner in (list, tuple)
    if repeatable:
        if not is_list:
            raise TypeError(f"a repeatable flag needs a list field, not {annotation!r}")
        return "append"
    if inner is bool:
        return "bool"
    if is_list:
        return "list"
    if inner is str or typing.get_origin(inner) is Literal:
        return "str"
    return "value"


def _choices(annotation: Any) -> list[Any] | None:
    inner, _ = _strip_optional(annotation)
    if typing.get_origin(inner) is Literal:
        return list(typing.get_args(inner))
    return None


def format_default(value: Any) -> str:
    """A default as ``--help`` and CONFIG.md show it."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if hasattr(value, "value") and not isinstance(value, (str, int, float)):
        value = value.value  # enums
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def _kebab(name: str) -> str:
    return name.replace("_", "-")


# ----------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class FlagSpec:
    """One model field as a command-line flag."""

    name: str  #: field name
    dest: str  #: argparse destination (``prefix + name``)
    flag: str  #: canonical spelling, e.g. ``--max-token-len`` or ``--env.group_size``
    aliases: tuple[str, ...]  #: other accepted spellings
    kind: str  #: ``bool``, ``list``, ``append`` (repeatable), ``str`` or ``value``
    nullable: bool  #: whether ``None`` means null
    required: bool
    default: str  #: the default as shown (``required`` for required fields)
    description: str
    choices: list[Any] | None = None
    env_var: str | None = None
    positional: bool = False

    @property
    def help(self) -> str:
        """``<description> (default: X; env VAR)``, ``(repeatable; default: X)``."""
        extra = f"default: {self.default}"
        if self.repeatable:
            extra = f"repeatable; {extra}"
        if self.env_var:
            extra += f"; env {self.env_var}"
        return f"{self.description} ({extra})".strip()

    @property
    def repeatable(self) -> bool:
        """Whether the flag takes one value per occurrence (``--flag a --flag b``)."""
        return self.kind == "append"

    @property
    def negatives(self) -> tuple[str, ...]:
        """``--no-...`` spellings of a boolean flag."""
        if self.kind != "bool":
            return ()
        return tuple("--no-" + f[2:] for f in (self.flag, *self.aliases))

    @property
    def option_strings(self) -> tuple[str, ...]:
        """Every spelling argparse accepts."""
        return (self.flag, *self.aliases, *self.negatives)

    @property
    def invocation(self) -> str:
        """How ``--help`` and CONFIG.md write the flag."""
        if self.positional:
            return self.name.upper()
        if self.kind == "bool":
            return f"{self.flag}, --no-{self.flag[2:]}"
        return self.flag


class _BoolAction(argparse.Action):
    """``--flag`` / ``--flag=WORD`` / ``--no-flag``; stores the word for pydantic to parse."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        self.spec: FlagSpec = kwargs.pop("spec")
        super().__init__(option_strings, dest, nargs="?", **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        negative = option_string in self.spec.negatives
        if negative and values is not None:
            parser.error(f"{option_string} {values!r}: takes no value")
        word = "false" if negative else ("true" if values is None else str(values))
        if word.lower() not in BOOL_WORDS:
            parser.error(f"{self.spec.flag} {word!r}: expected true or false")
        setattr(namespace, self.dest, word)


class ModelHelpFormatter(argparse.HelpFormatter):
    """Shows each model flag once, in its canonical spelling (aliases stay accepted)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        spec = getattr(action, "spec", None)
        if spec is None or spec.positional:
            return super()._format_action_invocation(action)
        if spec.kind == "bool":
            return f"{spec.flag} [BOOL], --no-{spec.flag[2:]}"
        return f"{spec.flag} {self._format_args(action, self._get_default_metavar_for_optional(action))}"


class ModelArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that understands the boolean forms of :class:`ModelFlags`.

    Before argparse sees them, ``--flag WORD`` becomes ``--flag=WORD`` when WORD is a boolean
    word, and a bare ``--flag`` / ``--no-flag`` gets its value attached, so a boolean flag
    never swallows the positional argument after it. An abbreviation that both spellings of one
    flag start with (``--group`` for ``--group-size``/``--group_size``) names that flag, as it
    would with one spelling; one that starts two different flags stays ambiguous.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", ModelHelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(self._attach_bool_values(argv), namespace)

    def _get_option_tuples(self, option_string: str) -> list[Any]:
        # argparse's abbreviation lookup (private; its tuples start with the action): one match
        # per action, so the snake_case alias does not make a kebab-case prefix ambiguous.
        seen: set[int] = set()
        unique = []
        for match in super()._get_option_tuples(option_string):
            if id(match[0]) not in seen:
                seen.add(id(match[0]))
                unique.append(match)
        return unique

    def _attach_bool_values(self, argv: list[str]) -> list[str]:
        out: list[str] = []
        i = 0
        while i < len(argv):
            word = argv[i]
            if word == "--":
                return out + argv[i:]
            action = self._option_string_actions.get(word) if word.startswith("--") else None
            if isinstance(action, _BoolAction):
                spec = action.spec
                if word in spec.negatives:
                    out.append(f"--{spec.flag[2:]}=false")
                elif i + 1 < len(argv) and argv[i + 1].lower() in BOOL_WORDS:
                    out.append(f"{word}={argv[i + 1]}")
                    i += 1
                else:
                    out.append(f"{word}=true")
            else:
                out.append(word)
            i += 1
        return out


# ----------------------------------------------------------------------------- model flags


@dataclass
class ModelFlags:
    """The flags of one pydantic model, and the way back from parsed flags to the model.

    Args:
        model: The pydantic model class.
        prefix: Namespace of the flags (``"env."`` gives ``--env.group_size``); empty for plain
            kebab-case flags.
        defaults: Defaults to show instead of the model's own (e.g. ``config_init()``'s).
        env_prefix: Environment variable prefix shown in the help (``"ATROPOS_"``).
        exclude: Fields that get no flag.
        positional: Fields that are positional arguments, in order.
    """

    model: type[BaseModel]
    prefix: str = ""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    env_prefix: str | None = None
    exclude: Iterable[str] = ()
    positional: Sequence[str] = ()
    specs: dict[str, FlagSpec] = field(init=False)

    def __post_init__(self) -> None:
        excluded = set(self.exclude)
        self.specs = {
            name: self._spec(name, info)
            for name, info in self.model.model_fields.items()
            if name not in excluded
        }

    # -- naming

    def spelling(self, name: str) -> str:
        """The canonical flag of a field name (also of an alias name)."""
        if self.prefix:
            return f"--{self.prefix}{name}"
        return f"--{_kebab(name)}"

    def _spellings(self, name: str) -> list[str]:
        if self.prefix:
            forms = [f"--{self.prefix}{name}", f"--{self.prefix}{_kebab(name)}"]
        else:
            forms = [f"--{_kebab(name)}", f"--{name}"]
        return list(dict.fromkeys(forms))

    def _spec(self, name: str, info: Any) -> FlagSpec:
        names = [name]
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            names += [c for c in alias.choices if isinstance(c, str) and c != name]
        elif isinstance(alias, str) and alias != name:
            names.append(alias)
        spellings = [s for n in names for s in self._spellings(n)]
        spellings = list(dict.fromkeys(spellings))
        if name in self.defaults:
            default = format_default(self.defaults[name])
        elif info.is_required():
            default = "required"
        else:
            default = format_default(info.get_default(call_default_factory=True))
        _, nullable = _strip_optional(info.annotation)
        kind = _kind(info.annotation, _is_repeatable(info))
        return FlagSpec(
            name=name,
            dest=f"{self.prefix}{name}",
            flag=spellings[0],
            aliases=tuple(spellings[1:]),
            kind=kind,
            nullable=nullable,
            required=info.is_required() and name not in self.defaults,
            default=default,
            description=" ".join((info.description or "").split()),
            choices=_choices(info.annotation),
            env_var=f"{self.env_prefix}{name.upper()}" if self.env_prefix else None,
            positional=name in self.positional,
        )

    # -- parser

    def add_to(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> ModelFlags:
        """Add one argument per field to ``parser`` (or an argument group of it).

        Flags default to "not given" (absent from the namespace), so that layered defaults
        (model, YAML, environment) are applied by :meth:`build`, not by argparse.
        """
        for name in self.positional:
            spec = self.specs[name]
            action = parser.add_argument(
                spec.dest, metavar=name.upper(), help=spec.description.replace("%", "%%")
            )
            action.spec = spec  # type: ignore[attr-defined]
        for spec in self.specs.values():
            if spec.positional:
                continue
            kwargs: dict[str, Any] = {
                "dest": spec.dest,
                "default": argparse.SUPPRESS,
                "help": spec.help.replace("%", "%%"),
            }
            if spec.kind == "bool":
                kwargs.update(action=_BoolAction, spec=spec, metavar="BOOL")
                action = parser.add_argument(*spec.option_strings, **kwargs)
                continue
            if spec.choices:
                kwargs["metavar"] = "{" + ",".join(str(c) for c in spec.choices) + "}"
            else:
                kwargs["metavar"] = spec.name.upper()
            if spec.kind == "list":
                kwargs["nargs"] = "*"
            elif spec.kind == "append":
                kwargs["action"] = "append"
            action = parser.add_argument(*spec.option_strings, **kwargs)
            action.spec = spec  # type: ignore[attr-defined]
        return self

    # -- values

    def given(self, namespace: argparse.Namespace | Mapping[str, Any]) -> dict[str, Any]:
        """The flags given on the command line, as ``{field: raw value}``."""
        data = vars(namespace) if isinstance(namespace, argparse.Namespace) else namespace
        return {s.name: data[s.dest] for s in self.specs.values() if s.dest in data}

    def coerce(self, name: str, raw: Any) -> Any:
        """A flag's raw value as the model should see it."""
        spec = self.specs[name]
        if spec.kind == "append":
            return list(raw)  # one value per occurrence, as written
        if spec.kind == "list" and isinstance(raw, list):
            if len(raw) == 1 and isinstance(raw[0], str):
                single = raw[0].strip()
                if single == "None" and spec.nullable:
                    return None
                if single.startswith("["):
                    try:
                        return json.loads(single)
                    except json.JSONDecodeError:
                        pass
            return raw
        if not isinstance(raw, str):
            return raw
        if raw == "None" and spec.nullable:
            return None
        stripped = raw.strip()
        if spec.kind == "value" and stripped[:1] in "[{":
            try:
                return json.loads(stripped)
            except json.JSONDecodeError:
                return raw
        return raw

    def values(self, namespace: argparse.Namespace | Mapping[str, Any]) -> dict[str, Any]:
        """The flags given, as ``{field: value}`` ready for the model."""
        return {name: self.coerce(name, raw) for name, raw in self.given(namespace).items()}

    def build(
        self,
        namespace: argparse.Namespace | Mapping[str, Any],
        *,
        base: Mapping[str, Any] | None = None,
        config: Mapping[str, Any] | None = None,
        config_path: str | None = None,
    ) -> BaseModel:
        """The validated model: ``base`` < ``config`` (a YAML section) < the flags given.

        A repeatable flag's values are added to the list ``base``/``config`` give it.

        Raises:
            FlagError: A value the model refuses, naming the flag or the config key.
        """
        flags = self.values(namespace)
        below = merge_dicts(dict(base or {}), dict(config or {}))
        for name, given in flags.items():
            if self.specs[name].repeatable and isinstance(below.get(name), list):
                flags[name] = [*below[name], *given]
        data = merge_dicts(below, flags)
        return self.validate(data, given=self.given(namespace), config=config or {},
                             config_path=config_path)  # fmt: skip

    def validate(
        self,
        data: Mapping[str, Any],
        *,
        given: Mapping[str, Any] | None = None,
        config: Mapping[str, Any] | None = None,
        config_path: str | None = None,
    ) -> BaseModel:
        """``model.model_validate(data)``, with errors naming where each value came from."""
        try:
            return self.model.model_validate(dict(data))
        except ValidationError as exc:
            raise FlagError(self.describe(exc, given or {}, config or {}, config_path)) from None

    def describe(
        self,
        exc: ValidationError,
        given: Mapping[str, Any],
        config: Mapping[str, Any] | None = None,
        config_path: str | None = None,
        config_key: Callable[[str], str] | None = None,
    ) -> str:
        """One line per error: ``--flag 'x': msg``, ``key in FILE: msg``, ``--flag: msg`` (a
        required flag missing) or ``--flag (default): msg``. ``config_key(name)`` names a field in ``config`` (default:
        ``prefix + name``, the YAML path)."""
        config = config or {}
        if config_key is None:
            config_key = lambda name: f"{self.prefix}{name}"  # noqa: E731
        lines = []
        for err in exc.errors():
            loc = err.get("loc") or ()
            name = str(loc[0]) if loc else ""
            msg = err["msg"]
            if not name or name not in self.model.model_fields:
                lines.append(f"{name or 'config'}: {msg}")
                continue
            spec = self.specs.get(name)
            flag = spec.flag if spec and not spec.positional else (
                name.upper() if spec else f"{self.prefix}{name}"
            )  # fmt: skip
            if err.get("type") == "missing" and name not in given:
                lines.append(f"{flag}: {msg}")
            elif name in given:
                raw = given[name]
                shown = " ".join(raw) if isinstance(raw, list) else raw
                lines.append(f"{flag} {shown!r}: {msg}")
            elif name in config:
                lines.append(f"{config_key(name)} in {config_path}: {msg}")
            else:
                lines.append(f"{flag} (default): {msg}")
        return "; ".join(lines)

    def canonical_key(self, key: str) -> str | None:
        """The field a config-file key names (a field name, an alias, either spelling)."""
        wanted = key.replace("-", "_")
        for name, info in self.model.model_fields.items():
            alias = info.validation_alias
            names = [name]
            if isinstance(alias, AliasChoices):
                names += [c for c in alias.choices if isinstance(c, str)]
            elif isinstance(alias, str):
                names.append(alias)
            if wanted in names:
                return name
        return None


def parse_model(
    flags: ModelFlags,
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None = None,
    *,
    base: Mapping[str, Any] | Callable[[dict[str, Any]], Mapping[str, Any]] | None = None,
    check: Callable[[BaseModel], None] | None = None,
) -> tuple[BaseModel, argparse.Namespace]:
    """Parse ``argv`` with ``parser`` (built with ``flags.add_to``) into the validated model.

    ``base`` holds values under the flags (see :meth:`ModelFlags.build`); it may be a function
    of the flags given (``{field: value}``), for a preset that a flag picks (``--recipe``).
    A value the model refuses, or one ``check(model)`` refuses with a ``FlagError``, is a usage
    error: the message names the flag and the process exits with code 2.
    """
    namespace = parser.parse_args(argv)
    try:
        if callable(base):
            base = base(flags.values(namespace))
        model = flags.build(namespace, base=base)
        if check is not None:
            check(model)
    except FlagError as exc:
        parser.error(exc.message)
    return model, namespace
