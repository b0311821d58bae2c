"""Tools: safe calculator, corpus lookup, unit conversion, validation and call parsing."""

from __future__ import annotations

import json

import pytest

from atroposlib.scoring.tools import (
    ParsedCall,
    ToolError,
    convert_units,
    default_registry,
    lookup,
    parse_hermes_calls,
    parse_openai_calls,
    safe_arithmetic,
)


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("1 + 2 * 3", 7),
        ("(12 + 30) * 2 / 7", 12),
        ("2 ^ 10", 1024),
        ("sqrt(16) + abs(-2)", 6),
        ("10 / 4", 2.5),
        ("1,000 * 3", 3000),
        ("max(3, 9, 4) - min(2, 5)", 7),
        ("-5 // 2", -3),
    ],
)
def test_calculator_evaluates_arithmetic(expr: str, value: float) -> None:
    assert safe_arithmetic(expr) == value


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("__import__('os').system('echo hi')", "unsupported"),
        ("open('/etc/passwd').read()", "unsupported"),
        ("(lambda: 1)()", "unsupported"),
        ("9 ** 999", "exponent"),
        ("1 / 0", "division by zero"),
        ("10 ** 20", "too large"),
        ("1 +", "not valid arithmetic"),
        ("", "non-empty"),
        ("1+" * 200 + "1", "longer than"),
        ("'a' * 3", "not a number"),
    ],
)
def test_calculator_refuses_anything_else(expr: str, message: str) -> None:
    with pytest.raises(ToolError, match=message):
        safe_arithmetic(expr)


def test_lookup_and_unit_conversion() -> None:
    assert lookup("France", "capital") == "Paris"
    assert lookup("  mars ", "moons") == 2
    assert lookup("gold")["symbol"] == "Au"
    with pytest.raises(ToolError, match="entity: unknown 'Atlantis'"):
        lookup("Atlantis", "capital")
    with pytest.raises(ToolError, match="attribute"):
        lookup("France", "moons")
    assert convert_units(3, "miles", "km") == pytest.approx(4.828032)
    assert convert_units(100, "c", "f") == pytest.approx(212)
    assert convert_units(2, "h", "min") == 120
    with pytest.raises(ToolError, match="to_unit: cannot convert length"):
        convert_units(1, "km", "kg")
    with pytest.raises(ToolError, match="from_unit: unknown unit 'parsec'"):
        convert_units(1, "parsec", "km")


def test_hermes_calls_parse_valid_and_malformed_blocks() -> None:
    text = (
        "Let me compute.\n"
        '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>\n'
        "<tool_call>{'name': 'lookup', 'arguments': {'entity': 'Japan'}}</tool_call>\n"
        "<tool_call>{not json at all}</tool_call>\n"
        '<tool_call>{"arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"3*3\\"}"}</tool_call>'
        '<tool_call>{"name": "lookup"'
    )
    calls = parse_hermes_calls(text)
    assert [c.name for c in calls] == ["calculator", "lookup", "", "", "calculator", ""]
    assert calls[0].arguments == {"expression": "2+2"} and calls[0].error is None
    assert calls[1].arguments == {"entity": "Japan"}
    assert calls[2].error == "tool_call: not valid JSON"
    assert calls[3].error == "name: missing or not a string"
    assert calls[4].arguments == {"expression": "3*3"}
    assert calls[5].error == "tool_call: not closed"
    assert parse_hermes_calls("The answer is 4.") == []


def test_openai_calls_parse() -> None:
    calls = parse_openai_calls(
        [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "lookup", "arguments": '{"entity": "Kenya"}'},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "calculator", "arguments": "{oops"},
            },
        ]
    )
    assert calls[0].id == "c1" and calls[0].arguments == {"entity": "Kenya"}
    assert calls[1].id == "c2" and calls[1].error == "arguments: not valid JSON"


def test_registry_validates_and_executes() -> None:
    reg = default_registry()
    ok = reg.execute(ParsedCall("calculator", {"expression": "6*7"}))
    assert ok.ok and ok.value == 42 and ok.content == "42"
    assert json.loads(ok.hermes_message().split("\n")[1]) == {"name": "calculator", "content": 42}
    assert ok.openai_message()["role"] == "tool"
    cases = [
        (ParsedCall("rm", {}), "name: unknown tool 'rm'"),
        (ParsedCall("calculator", {}), "arguments.expression: required"),
        (ParsedCall("calculator", {"expression": 5}), "arguments.expression: expected string"),
        (ParsedCall("calculator", {"expression": "1", "x": 1}), "arguments.x: not a parameter"),
        (
            ParsedCall("convert_units", {"value": True, "from_unit": "m", "to_unit": "km"}),
            "expected number",
        ),
        (ParsedCall("lookup", {"entity": "Narnia"}), "arguments.entity: unknown"),
        (ParsedCall("calculator", {"expression": "1/0"}), "division by zero"),
    ]
    for call, message in cases:
        result = reg.execute(call)
        assert not result.ok and message in result.content, result.content
    assert "<tools>" in reg.hermes_system_prompt("Be brief.")
    assert [t["function"]["name"] for t in reg.openai_tools()] == [
        "calculator",
        "lookup",
        "convert_units",
    ]
