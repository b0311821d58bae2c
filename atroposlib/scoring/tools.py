"""Tools a model can call, executed safely, and the parsing of its calls.

A ``ToolRegistry`` holds ``Tool``s (name, description, JSON-schema parameters, a Python
function). It renders them for a prompt in both formats models are trained on:

* Hermes: a ``<tools>[...]</tools>`` block in the system prompt; the model answers with
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` and gets
  ``<tool_response>...</tool_response>`` back (``hermes_system_prompt``,
  ``parse_hermes_calls``).
* OpenAI: the ``tools=[{"type": "function", "function": {...}}]`` request field and
  ``message.tool_calls`` in the reply (``openai_tools``, ``parse_openai_calls``).

``ToolRegistry.execute(call)`` validates the arguments against the schema (required fields,
types, no unknown fields) and runs the function; any failure comes back as a ``ToolResult``
with ``ok=False`` and an error naming the field, never as an exception.

Built-in tools (``default_registry()``), all pure Python with no ``eval``, files or network:

* ``calculator(expression)``: arithmetic over an AST whitelist (``+ - * / // % **``,
  parentheses, ``sqrt abs round min max``), bounded in size and exponent.
* ``lookup(entity, attribute)``: facts from a small local corpus (``CORPUS``: countries,
  planets, chemical elements).
* ``convert_units(value, from_unit, to_unit)``: length, mass, time, volume, temperature.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from atroposlib.utils.tool_call_parser import _loads

__all__ = [
    "CORPUS",
    "ParsedCall",
    "Tool",
    "ToolError",
    "ToolRegistry",
    "ToolResult",
    "calculator",
    "convert_units",
    "default_registry",
    "lookup",
    "parse_hermes_calls",
    "parse_openai_calls",
    "safe_arithmetic",
]


class ToolError(ValueError):
    """A tool refused its input (the message says which argument and why)."""


# --------------------------------------------------------------------------- calculator

_BIN_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY_OPS: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt,
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
}
_CONSTS = {"pi": math.pi, "e": math.e}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 1e15
_THOUSANDS = re.compile(r"(?<=\d),(\d{3})(?!\d)")


def safe_arithmetic(expression: str) -> float | int:
    """Evaluate an arithmetic expression without ``eval``.

    Raises:
        ToolError: on anything but numbers, the whitelisted operators and functions, on
            division by zero, exponents above 64, or results beyond 1e15.
    """
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError("expression: must be a non-empty string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression: longer than {MAX_EXPRESSION_CHARS} characters")
    text = expression.replace("^", "**").replace("×", "*").replace("÷", "/")
    text = _THOUSANDS.sub(r"\1", text)
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"expression: not valid arithmetic ({exc.msg})") from None

    def check(value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ToolError("expression: not a number")
        if isinstance(value, float) and not math.isfinite(value):
            raise ToolError("expression: result is not finite")
        if abs(value) > MAX_MAGNITUDE:
            raise ToolError("expression: result too large")
        return value

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant):
            return check(node.value)
        if isinstance(node, ast.Name) and node.id in _CONSTS:
            return _CONSTS[node.id]
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
            return check(_UNARY_OPS[type(node.op)](ev(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BIN_OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ToolError("expression: exponent above 64")
            if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
                raise ToolError("expression: division by zero")
            return check(_BIN_OPS[type(node.op)](left, right))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _FUNCS
            and not node.keywords
            and len(node.args) <= 8
        ):
            args = [ev(a) for a in node.args]
            try:
                return check(_FUNCS[node.func.id](*args))
            except (TypeError, ValueError) as exc:
                raise ToolError(f"expression: {node.func.id}: {exc}") from None
        raise ToolError(f"expression: unsupported element {type(node).__name__}")

    result = ev(tree)
    if isinstance(result, float) and result.is_integer() and abs(result) < 2**53:
        return int(result)
    return round(result, 10) if isinstance(result, float) else result


def calculator(expression: str) -> float | int:
    """Evaluate an arithmetic expression, e.g. ``(12 + 30) * 2 / 7``."""
    return safe_arithmetic(expression)


# --------------------------------------------------------------------------- lookup corpus

#: The local knowledge base of ``lookup``: entity -> attribute -> value (numbers are plain
#: numbers so tasks can compute with them; rounded public figures).
CORPUS: dict[str, dict[str, Any]] = {
    "france": {
        "type": "country",
        "capital": "Paris",
        "population": 68_000_000,
        "area_km2": 551_695,
    },
    "germany": {
        "type": "country",
        "capital": "Berlin",
        "population": 84_000_000,
        "area_km2": 357_588,
    },
    "japan": {
        "type": "country",
        "capital": "Tokyo",
        "population": 124_000_000,
        "area_km2": 377_975,
    },
    "brazil": {
        "type": "country",
        "capital": "Brasilia",
        "population": 203_000_000,
        "area_km2": 8_515_767,
    },
    "canada": {
        "type": "country",
        "capital": "Ottawa",
        "population": 40_000_000,
        "area_km2": 9_984_670,
    },
    "kenya": {
        "type": "country",
        "capital": "Nairobi",
        "population": 55_000_000,
        "area_km2": 580_367,
    },
    "australia": {
        "type": "country",
        "capital": "Canberra",
        "population": 27_000_000,
        "area_km2": 7_692_024,
    },
    "egypt": {
        "type": "country",
        "capital": "Cairo",
        "population": 112_000_000,
        "area_km2": 1_002_450,
    },
    "mercury": {"type": "planet", "moons": 0, "diameter_km": 4_879, "day_hours": 4_222.6},
    "venus": {"type": "planet", "moons": 0, "diameter_km": 12_104, "day_hours": 2_802},
    "earth": {"type": "planet", "moons": 1, "diameter_km": 12_756, "day_hours": 24},
    "mars": {"type": "planet", "moons": 2, "diameter_km": 6_792, "day_hours": 24.7},
    "jupiter": {"type": "planet", "moons": 95, "diameter_km": 142_984, "day_hours": 9.9},
    "saturn": {"type": "planet", "moons": 146, "diameter_km": 120_536, "day_hours": 10.7},
    "hydrogen": {"type": "element", "symbol": "H", "atomic_number": 1, "atomic_mass": 1.008},
    "carbon": {"type": "element", "symbol": "C", "atomic_number": 6, "atomic_mass": 12.011},
    "oxygen": {"type": "element", "symbol": "O", "atomic_number": 8, "atomic_mass": 15.999},
    "iron": {"type": "element", "symbol": "Fe", "atomic_number": 26, "atomic_mass": 55.845},
    "gold": {"type": "element", "symbol": "Au", "atomic_number": 79, "atomic_mass": 196.967},
    "silver": {"type": "element", "symbol": "Ag", "atomic_number": 47, "atomic_mass": 107.868},
}


def lookup(entity: str, attribute: str | None = None) -> Any:
    """A fact from ``CORPUS``: ``lookup("France", "capital")``; without ``attribute``, every
    fact about the entity."""
    key = " ".join(str(entity).lower().split())
    if key not in CORPUS:
        raise ToolError(f"entity: unknown {entity!r} (known: {', '.join(sorted(CORPUS))})")
    facts = CORPUS[key]
    if attribute is None or attribute == "":
        return dict(facts)
    attr = str(attribute).lower().strip().replace(" ", "_")
    if attr not in facts:
        raise ToolError(f"attribute: {entity!r} has no {attribute!r} (has: {', '.join(facts)})")
    return facts[attr]


# --------------------------------------------------------------------------- units

_UNITS: dict[str, tuple[str, float]] = {
    # length (meters)
    "m": ("length", 1.0), "km": ("length", 1000.0), "cm": ("length", 0.01),
    "mm": ("length", 0.001), "mi": ("length", 1609.344), "ft": ("length", 0.3048),
    "in": ("length", 0.0254), "yd": ("length", 0.9144),
    # mass (kilograms)
    "kg": ("mass", 1.0), "g": ("mass", 0.001), "lb": ("mass", 0.45359237), "oz": ("mass", 0.028349523125),
    "t": ("mass", 1000.0),
    # time (seconds)
    "s": ("time", 1.0), "min": ("time", 60.0), "h": ("time", 3600.0), "day": ("time", 86400.0),
    "week": ("time", 604800.0),
    # volume (liters)
    "l": ("volume", 1.0), "ml": ("volume", 0.001), "gal": ("volume", 3.785411784),
    # temperature (handled apart)
    "c": ("temperature", 0.0), "f": ("temperature", 0.0), "k": ("temperature", 0.0),
}  # fmt: skip
_ALIASES = {
    "meter": "m", "meters": "m", "metre": "m", "kilometer": "km", "kilometers": "km",
    "centimeter": "cm", "centimeters": "cm", "millimeter": "mm", "mile": "mi", "miles": "mi",
    "foot": "ft", "feet": "ft", "inch": "in", "inches": "in", "yard": "yd", "yards": "yd",
    "kilogram": "kg", "kilograms": "kg", "gram": "g", "grams": "g", "pound": "lb",
    "pounds": "lb", "lbs": "lb", "ounce": "oz", "ounces": "oz", "tonne": "t", "tonnes": "t",
    "second": "s", "seconds": "s", "sec": "s", "minute": "min", "minutes": "min", "hour": "h",
    "hours": "h", "hr": "h", "days": "day", "weeks": "week", "liter": "l", "liters": "l",
    "litre": "l", "milliliter": "ml", "gallon": "gal", "gallons": "gal", "celsius": "c",
    "fahrenheit": "f", "kelvin": "k", "°c": "c", "°f": "f",
}  # fmt: skip


def _unit(name: Any, field_name: str) -> str:
    key = str(name).strip().lower()
    key = _ALIASES.get(key, key)
    if key not in _UNITS:
        raise ToolError(f"{field_name}: unknown unit {name!r}")
    return key


def convert_units(value: float, from_unit: str, to_unit: str) -> float:
    """Convert ``value`` between units of one kind (length, mass, time, volume,
    temperature), e.g. ``convert_units(3, "mi", "km")``."""
    src, dst = _unit(from_unit, "from_unit"), _unit(to_unit, "to_unit")
    kind_src, factor_src = _UNITS[src]
    kind_dst, factor_dst = _UNITS[dst]
    if kind_src != kind_dst:
        raise ToolError(
            f"to_unit: cannot convert {kind_src} ({from_unit}) to {kind_dst} ({to_unit})"
        )
    if kind_src == "temperature":
        kelvin = {"c": value + 273.15, "f": (value - 32) * 5 / 9 + 273.15, "k": value}[src]
        out = {"c": kelvin - 273.15, "f": (kelvin - 273.15) * 9 / 5 + 32, "k": kelvin}[dst]
    else:
        out = value * factor_src / factor_dst
    return round(out, 6)


# --------------------------------------------------------------------------- registry


@dataclass
class Tool:
    """One callable tool.

    Attributes:
        name: The function name the model uses.
        description: What it does (shown to the model).
        parameters: JSON schema of the arguments (``type: object`` with ``properties`` and
            ``required``); the supported property types are string, number, integer, boolean.
        fn: The Python implementation, called with the validated keyword arguments.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any]

    def spec(self) -> dict[str, Any]:
        """``{"name", "description", "parameters"}`` (the Hermes ``<tools>`` entry)."""
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


@dataclass
class ParsedCall:
    """A tool call as the model wrote it.

    Attributes:
        name: Tool name ("" when it could not be read).
        arguments: Decoded arguments (``{}`` when unreadable).
        id: The call id (OpenAI's, or a generated one).
        error: Why the call is malformed, or None when it parsed.
        raw: The text the call came from.
    """

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:16]}")
    error: str | None = None
    raw: str = ""


@dataclass
class ToolResult:
    """The outcome of executing one call: ``ok`` and ``content`` (JSON text of the value, or
    the error message), ``value`` (the Python value when ok)."""

    call: ParsedCall
    ok: bool
    content: str
    value: Any = None

    def hermes_message(self) -> str:
        """The ``<tool_response>`` block fed back in the Hermes format."""
        body = {
            "name": self.call.name,
            "content": self.value if self.ok else {"error": self.content},
        }
        return f"<tool_response>\n{json.dumps(body, ensure_ascii=False)}\n</tool_response>"

    def openai_message(self) -> dict[str, Any]:
        """The ``{"role": "tool", "tool_call_id", "content"}`` message (OpenAI format): the
        value as JSON, or ``{"error": ...}``."""
        content = self.content if self.ok else json.dumps({"error": self.content})
        return {"role": "tool", "tool_call_id": self.call.id, "content": content}


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "boolean": (bool,),
}


class ToolRegistry:
    """A set of tools: rendering for prompts, argument validation and safe execution."""

    def __init__(self, tools: Sequence[Tool] = ()) -> None:
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> None:
        """Add ``tool`` (a name may be registered once)."""
        if tool.name in self.tools:
            raise ValueError(f"tool {tool.name!r} is already registered")
        self.tools[tool.name] = tool

    def openai_tools(self) -> list[dict[str, Any]]:
        """The OpenAI ``tools`` request field."""
        return [{"type": "function", "function": t.spec()} for t in self.tools.values()]

    def hermes_system_prompt(self, preamble: str = "") -> str:
        """A Hermes function-calling system prompt listing every tool."""
        tools = "\n".join(json.dumps(t.spec(), ensure_ascii=False) for t in self.tools.values())
        return (
            (preamble.strip() + "\n\n" if preamble.strip() else "")
            + "You may call one or more functions to help with the user query. The functions "
            "are listed inside <tools></tools>:\n<tools>\n"
            + tools
            + "\n</tools>\nFor each call, write a JSON object with the function name and "
            "arguments inside <tool_call></tool_call> tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n'
            "Results come back inside <tool_response></tool_response> tags."
        )

    def validate(self, call: ParsedCall) -> str | None:
        """Why ``call`` cannot run (unknown tool, missing/unknown/mistyped argument), or
        None."""
        if call.error:
            return call.error
        tool = self.tools.get(call.name)
        if tool is None:
            return f"name: unknown tool {call.name!r} (available: {', '.join(self.tools)})"
        if not isinstance(call.arguments, dict):
            return "arguments: must be a JSON object"
        props = tool.parameters.get("properties", {})
        for name in tool.parameters.get("required", []):
            if name not in call.arguments:
                return f"arguments.{name}: required by {tool.name}"
        for name, value in call.arguments.items():
            if name not in props:
                return f"arguments.{name}: not a parameter of {tool.name}"
            expected = props[name].get("type")
            types = _JSON_TYPES.get(expected)
            if types is None or value is None and name not in tool.parameters.get("required", []):
                continue
            if isinstance(value, bool) and expected != "boolean" or not isinstance(value, types):
                return f"arguments.{name}: expected {expected}, got {type(value).__name__}"
        return None

    def execute(self, call: ParsedCall) -> ToolResult:
        """Validate and run ``call``; failures are returned (``ok=False``), never raised."""
        problem = self.validate(call)
        if problem is not None:
            return ToolResult(call, ok=False, content=f"error: {problem}")
        try:
            value = self.tools[call.name].fn(**call.arguments)
        except ToolError as exc:
            return ToolResult(call, ok=False, content=f"error: arguments.{exc}")
        except (ArithmeticError, ValueError, TypeError, OverflowError) as exc:
            return ToolResult(call, ok=False, content=f"error: {type(exc).__name__}: {exc}")
        return ToolResult(call, ok=True, content=json.dumps(value, ensure_ascii=False), value=value)


def default_registry() -> ToolRegistry:
    """The built-in ``calculator``, ``lookup`` and ``convert_units`` tools."""
    return ToolRegistry(
        [
            Tool(
                "calculator",
                "Evaluate an arithmetic expression (+ - * / // % ** and sqrt, abs, round, min, "
                "max). Example: (12 + 30) * 2",
                {
                    "type": "object",
                    "properties": {
                        "expression": {"type": "string", "description": "arithmetic expression"}
                    },
                    "required": ["expression"],
                },
                calculator,
            ),
            Tool(
                "lookup",
                "Look up a fact about a country, planet or chemical element, e.g. "
                "entity='France', attribute='population'. Omit attribute to list all facts.",
                {
                    "type": "object",
                    "properties": {
                        "entity": {"type": "string", "description": "what to look up"},
                        "attribute": {"type": "string", "description": "which fact"},
                    },
                    "required": ["entity"],
                },
                lookup,
            ),
            Tool(
                "convert_units",
                "Convert a value between units of length, mass, time, volume or temperature "
                "(m, km, mi, ft, kg, lb, s, min, h, l, gal, c, f, k, ...).",
                {
                    "type": "object",
                    "properties": {
                        "value": {"type": "number"},
                        "from_unit": {"type": "string"},
                        "to_unit": {"type": "string"},
                    },
                    "required": ["value", "from_unit", "to_unit"],
                },
                convert_units,
            ),
        ]
    )


# --------------------------------------------------------------------------- parsing

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def parse_hermes_calls(text: str) -> list[ParsedCall]:
    """Every ``<tool_call>`` block in ``text``, in order. A block that is not a JSON object
    with a string ``name`` (or is never closed) becomes a ``ParsedCall`` with ``error`` set,
    so malformed calls are counted rather than silently skipped."""
    calls: list[ParsedCall] = []
    pos = 0
    while True:
        start = text.find(_OPEN, pos)
        if start < 0:
            return calls
        end = text.find(_CLOSE, start)
        body = text[start + len(_OPEN) : end if end >= 0 else len(text)].strip()
        raw = text[start : end + len(_CLOSE) if end >= 0 else len(text)]
        pos = end + len(_CLOSE) if end >= 0 else len(text)
        if end < 0:
            calls.append(ParsedCall("", {}, error="tool_call: not closed", raw=raw))
            return calls
        calls.append(_call_from_obj(body, raw))


def _call_from_obj(body: Any, raw: str, call_id: str | None = None) -> ParsedCall:
    extra = {"id": call_id} if call_id else {}
    obj = body
    if isinstance(body, str):
        try:
            obj = _loads(body)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return ParsedCall("", {}, error="tool_call: not valid JSON", raw=raw, **extra)
    if not isinstance(obj, Mapping):
        return ParsedCall("", {}, error="tool_call: not a JSON object", raw=raw, **extra)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ParsedCall("", {}, error="name: missing or not a string", raw=raw, **extra)
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return ParsedCall(name, {}, error="arguments: not valid JSON", raw=raw, **extra)
    if not isinstance(arguments, dict):
        return ParsedCall(name, {}, error="arguments: must be a JSON object", raw=raw, **extra)
    return ParsedCall(name, dict(arguments), raw=raw, **extra)


def parse_openai_calls(tool_calls: Sequence[Any] | None) -> list[ParsedCall]:
    """``message.tool_calls`` (SDK objects or dicts) as ``ParsedCall``s; arguments are a
    JSON string in the OpenAI format."""
    calls = []
    for tc in tool_calls or []:
        data = tc.model_dump() if hasattr(tc, "model_dump") else dict(tc)
        function = data.get("function") or {}
        body = {"name": function.get("name"), "arguments": function.get("arguments", "{}")}
        calls.append(_call_from_obj(body, json.dumps(body, default=str), data.get("id")))
    return calls
