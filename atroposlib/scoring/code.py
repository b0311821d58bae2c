"""Run unit tests against a candidate solution in the sandbox (HumanEval / MBPP style).

- :func:`extract_code`: the program in a model response (the last fenced ```python block, or
  any fenced block, or None).
- :func:`humaneval_tests` / :func:`humaneval_program`: split a HumanEval ``check(candidate)`` into
  one test per top-level statement that asserts, and assemble prompt + completion.
- :func:`run_tests` / :func:`arun_tests`: load the candidate, run each test in order in the
  sandbox (:mod:`atroposlib.scoring.sandbox`), and report how many passed. Results stream back
  one line per test, so a candidate that hangs in test 3 still gets credit for tests 1 and 2.

Limitation: tests run in the candidate's process, so a program written to read the harness can
forge its own results; the sandbox keeps the host safe, not the score honest against that.
"""

from __future__ import annotations

import ast
import asyncio
import json
import re
import secrets
from dataclasses import dataclass, field

from atroposlib.scoring.sandbox import SandboxLimits, SandboxResult, run_python

__all__ = [
    "TestReport",
    "arun_tests",
    "extract_code",
    "humaneval_program",
    "humaneval_tests",
    "run_tests",
]

_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)

_HARNESS = r"""
import sys, traceback
_NONCE = {nonce!r}
_TESTS = {tests!r}
_SETUP = {setup!r}
_SOURCE = {source!r}
_ENTRY = {entry!r}

def _report(kind, index, detail=""):
    sys.__stdout__.write(f"{{_NONCE}} {{kind}} {{index}} {{detail[:300]!r}}\n")
    sys.__stdout__.flush()

_ns = {{"__name__": "__main__"}}
try:
    exec(compile(_SOURCE, "solution.py", "exec"), _ns)
    if _SETUP:
        exec(compile(_SETUP, "setup.py", "exec"), _ns)
    if _ENTRY:
        _ns["candidate"] = _ns[_ENTRY]
except BaseException as exc:
    _report("load_error", -1, "".join(traceback.format_exception_only(type(exc), exc)).strip())
    raise SystemExit(3)
for _i, _test in enumerate(_TESTS):
    try:
        exec(compile(_test, f"test_{{_i}}.py", "exec"), _ns)
    except BaseException as exc:
        _report("fail", _i, "".join(traceback.format_exception_only(type(exc), exc)).strip())
    else:
        _report("pass", _i)
"""


@dataclass
class TestReport:
    """How a candidate did: per-test outcomes (None = never ran), and the sandbox's verdict."""

    results: list[bool | None]
    status: str
    reason: str
    sandbox: SandboxResult | None = None
    failures: dict[int, str] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Number of tests."""
        return len(self.results)

    @property
    def passed(self) -> int:
        """Number of tests that passed."""
        return sum(1 for r in self.results if r)

    @property
    def fraction(self) -> float:
        """passed / total (0.0 when there are no tests)."""
        return self.passed / self.total if self.total else 0.0

    @property
    def all_passed(self) -> bool:
        """Every test ran and passed."""
        return self.total > 0 and self.passed == self.total


def extract_code(text: str, language: str = "python") -> str | None:
    """The last fenced code block tagged ``language`` (or untagged / ``py``); failing that the
    last fenced block of any language; None when the text has no complete fenced block."""
    text = text.split("</think>")[-1]
    blocks = _FENCE_RE.findall(text)
    if not blocks:
        return None
    wanted = {language.lower(), "", "py" if language == "python" else language.lower()}
    matching = [code for tag, code in blocks if tag.lower() in wanted]
    return (matching or [code for _, code in blocks])[-1]


def humaneval_tests(test_source: str, check_name: str = "check") -> tuple[str, list[str]]:
    """Split HumanEval's test module into ``(setup, tests)``.

    ``setup`` is the module without ``check`` (``METADATA``, helper imports) plus the non-assert
    statements of ``check``; each top-level statement of ``check`` that contains an ``assert`` is
    one test. Raises ValueError if there is no ``def check(candidate)``.
    """
    module = ast.parse(test_source)
    check = next(
        (n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == check_name), None
    )
    if check is None:
        raise ValueError(f"test source has no 'def {check_name}(candidate)'")
    param = check.args.args[0].arg if check.args.args else "candidate"
    setup_parts = [ast.unparse(n) for n in module.body if n is not check]
    if param != "candidate":
        setup_parts.append(f"{param} = candidate")
    tests: list[str] = []
    for stmt in check.body:
        source = ast.unparse(stmt)
        if any(isinstance(n, ast.Assert) for n in ast.walk(stmt)):
            tests.append(source)
        elif not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):
            setup_parts.append(source)
    return "\n".join(setup_parts), tests


def humaneval_program(prompt: str, completion: str, entry_point: str) -> str:
    """The program to test: the model's code when it defines ``entry_point`` itself (with the
    prompt's imports kept), otherwise prompt + completion (the classic HumanEval layout)."""
    code = extract_code(completion)
    if code is None:
        code = completion
    if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, flags=re.MULTILINE):
        imports = [
            line
            for line in prompt.splitlines()
            if line.startswith(("import ", "from ")) and line not in code
        ]
        return "\n".join([*imports, code])
    return prompt + code


def run_tests(
    program: str,
    tests: list[str],
    *,
    setup: str = "",
    entry_point: str | None = None,
    limits: SandboxLimits | None = None,
) -> TestReport:
    """Run ``tests`` (Python snippets, usually asserts) against ``program`` in the sandbox.

    ``setup`` runs after the program (helper definitions, test fixtures); with ``entry_point``
    the tested function is also bound to the name ``candidate``. Never raises for anything the
    candidate does: syntax errors, crashes and limit hits show up in ``status``/``reason``.
    """
    if not tests:
        raise ValueError("tests: at least one test is needed")
    nonce = secrets.token_hex(12)
    harness = _HARNESS.format(
        nonce=nonce, tests=list(tests), setup=setup, source=program, entry=entry_point
    )
    result = run_python(harness, limits=limits)
    outcomes: list[bool | None] = [None] * len(tests)
    failures: dict[int, str] = {}
    load_error = None
    for line in result.stdout.splitlines():
        if not line.startswith(nonce + " "):
            continue
        _, kind, index, detail = line.split(" ", 3)
        i = int(index)
        if kind == "load_error":
            load_error = ast.literal_eval(detail)
        elif 0 <= i < len(tests):
            outcomes[i] = kind == "pass"
            if kind == "fail":
                failures[i] = ast.literal_eval(detail)
    if load_error is not None:
        status, reason = "load_error", load_error
    elif result.status in ("ok", "error") and all(o is not None for o in outcomes):
        status, reason = "completed", ""
    else:
        status, reason = result.status, result.reason or "harness did not finish"
    return TestReport(outcomes, status, reason, result, failures)


async def arun_tests(program: str, tests: list[str], **kwargs) -> TestReport:
    """:func:`run_tests` in a worker thread."""
    return await asyncio.to_thread(run_tests, program, tests, **kwargs)


def dumps_report(report: TestReport) -> str:
    """A compact JSON summary (for logs and eval samples)."""
    return json.dumps(
        {
            "passed": report.passed,
            "total": report.total,
            "status": report.status,
            "reason": report.reason,
        }
    )
